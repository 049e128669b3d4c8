"""Who may do what: tokens map to roles, roles and the job a request names decide.

Roles (``docs/security.md``):

- ``admin`` (``--admin-token-file``): everything, including ``Drain``, ``Delete`` of any job and listing every job.
- ``cluster`` (``--auth-token-file``): what stores and trusted trainers do: every job's saves, restores and
  listings, store-to-store copies (replica and repair pushes, ``List`` of every job). Not ``Delete``, not ``Drain``.
- ``job`` (``--job-tokens-file``, one token per job): saves, restores, listings and deletes of that one job only.

With no token configured the store is open (it then listens on loopback only, unless ``--insecure``).
Tokens are compared in constant time against every configured token (no early exit), never logged,
never echoed in an error.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from memstore.errors import AccessDenied, ConfigError, Unauthenticated
from memstore.v1.keys import job_id_problem
from memstore.v1.security import read_token_file, token_problem


class Role(Enum):
    ADMIN = "admin"
    CLUSTER = "cluster"
    JOB = "job"


class Need(Enum):
    """What a call needs: any authenticated caller, the named job's access, store-level (cluster) access, or admin."""

    ANY = "any"
    JOB = "job"
    OWN_JOB = "own_job"  # the job's own token or admin: destructive per-job calls (Delete), not the cluster token
    CLUSTER = "cluster"
    ADMIN = "admin"


@dataclass(frozen=True)
class Principal:
    role: Role
    job: str = ""  # for Role.JOB

    def __str__(self) -> str:
        return f"the token of job {self.job!r}" if self.role is Role.JOB else f"the {self.role.value} token"


OPEN = Principal(Role.ADMIN)  # what every caller is when authentication is off


class Authenticator:
    def __init__(self, cluster: str = "", admin: str = "", jobs: dict[str, str] | None = None) -> None:
        self._tokens: list[tuple[bytes, Principal]] = []
        if cluster:
            self._tokens.append((cluster.encode(), Principal(Role.CLUSTER)))
        if admin:
            self._tokens.append((admin.encode(), Principal(Role.ADMIN)))
        for job, token in (jobs or {}).items():
            self._tokens.append((token.encode(), Principal(Role.JOB, job)))
        if len({t for t, _ in self._tokens}) != len(self._tokens):
            raise ConfigError("auth: two roles or jobs share one token; every token must be different")
        if self._tokens and not cluster:
            raise ConfigError("auth: --admin-token-file/--job-tokens-file need --auth-token-file too (the stores' own token)")

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    @classmethod
    def from_files(cls, cluster_file: str, admin_file: str, jobs_file: str) -> Authenticator:
        cluster = read_token_file(cluster_file, "--auth-token-file") if cluster_file else ""
        admin = read_token_file(admin_file, "--admin-token-file") if admin_file else ""
        return cls(cluster, admin, read_job_tokens(jobs_file) if jobs_file else None)

    def identify(self, token: str) -> Principal | None:
        """The principal ``token`` belongs to, or None. Compares against every token, in constant time each."""
        given = token.encode()
        found: Principal | None = None
        for known, principal in self._tokens:
            if hmac.compare_digest(given, known) and found is None:
                found = principal
        return found

    def authorize(self, token: str, need: Need, job_id: str = "") -> Principal:
        """The caller's principal if it may do what ``need`` (for ``job_id``) asks; else Unauthenticated / AccessDenied."""
        if not self.enabled:
            return OPEN
        principal = self.identify(token) if token else None
        if principal is None:
            raise Unauthenticated(
                "missing or unknown auth token: send the cluster, job or admin token "
                "(auth_token=, MEMSTORE_AUTH_TOKEN or --auth-token-file)"
            )
        if principal.role is Role.ADMIN or need is Need.ANY:
            return principal
        if need is Need.ADMIN:
            raise AccessDenied(f"this needs the admin token; {principal} is not enough")
        if principal.role is Role.CLUSTER and need is Need.OWN_JOB:
            raise AccessDenied(f"deleting a job's shards needs that job's token or the admin token; {principal} is not enough")
        if principal.role is Role.CLUSTER:
            return principal
        if need is Need.CLUSTER:
            raise AccessDenied(f"this needs the cluster or admin token (store-level access to every job); {principal} is not enough")
        if job_id != principal.job:
            target = f"job {job_id!r}" if job_id else "every job"
            raise AccessDenied(f"{principal} gives access to job {principal.job!r} only, not to {target}")
        return principal


def read_job_tokens(path: str) -> dict[str, str]:
    """``{"<job id>": "<token>", ...}`` from ``path``; ConfigError naming the file and the entry (never a token)."""
    flag = "--job-tokens-file"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{flag} {path}: not valid JSON ({type(exc).__name__} at {getattr(exc, 'pos', '?')})") from None
    if not isinstance(data, dict) or not data:
        raise ConfigError(f'{flag} {path}: expected a non-empty JSON object {{"<job id>": "<token>", ...}}')
    out: dict[str, str] = {}
    for job, token in data.items():
        problem = job_id_problem(job)
        if problem:
            raise ConfigError(f"{flag} {path}: {problem}")
        problem = token_problem(token) if isinstance(token, str) else "not a string"
        if problem:
            raise ConfigError(f"{flag} {path}: the token of job {job!r} is invalid: {problem}")
        out[job] = token
    return out
