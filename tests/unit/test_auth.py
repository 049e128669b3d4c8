"""Tokens, roles and safe defaults: unit tests of memstore.server.auth, memstore.v1.security and the config rules."""

from __future__ import annotations

import json

import pytest

from memstore.config import FORCE_REMOTE_ENV, StoreConfig
from memstore.errors import AccessDenied, ConfigError, Unauthenticated
from memstore.server.auth import Authenticator, Need, Role
from memstore.v1.security import Credentials, token_of

pytestmark = pytest.mark.unit

CLUSTER, ADMIN, JOB_A = "c" * 20, "a" * 20, "j" * 20


def auth() -> Authenticator:
    return Authenticator(CLUSTER, ADMIN, {"job-a": JOB_A})


def test_roles() -> None:
    a = auth()
    assert a.authorize(CLUSTER, Need.JOB, "any-job").role is Role.CLUSTER
    assert a.authorize(CLUSTER, Need.CLUSTER).role is Role.CLUSTER
    assert a.authorize(ADMIN, Need.ADMIN).role is Role.ADMIN
    assert a.authorize(JOB_A, Need.JOB, "job-a").job == "job-a"
    assert a.authorize(JOB_A, Need.OWN_JOB, "job-a").job == "job-a"
    assert a.authorize(JOB_A, Need.ANY).role is Role.JOB
    for token, need, job in [(JOB_A, Need.JOB, "job-b"), (JOB_A, Need.JOB, ""), (JOB_A, Need.CLUSTER, ""), (JOB_A, Need.ADMIN, ""),
                             (CLUSTER, Need.ADMIN, ""), (CLUSTER, Need.OWN_JOB, "job-a")]:  # fmt: skip
        with pytest.raises(AccessDenied):
            a.authorize(token, need, job)
    for token in ("", "x" * 20, CLUSTER + "x", CLUSTER[:-1]):
        with pytest.raises(Unauthenticated) as err:
            a.authorize(token, Need.ANY)
        assert CLUSTER not in str(err.value)
        assert not token or token not in str(err.value)


def test_open_without_tokens_and_config_errors() -> None:
    assert Authenticator().authorize("", Need.ADMIN).role is Role.ADMIN
    with pytest.raises(ConfigError, match="different"):
        Authenticator(CLUSTER, CLUSTER)
    with pytest.raises(ConfigError, match="--auth-token-file"):
        Authenticator("", ADMIN)


def test_token_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "short").write_text("abc")
    (tmp_path / "jobs.json").write_text(json.dumps({"bad/job": JOB_A}))
    (tmp_path / "jobs2.json").write_text(json.dumps({"job-a": "short"}))
    with pytest.raises(ConfigError, match="too short") as err:
        Authenticator.from_files(str(tmp_path / "short"), "", "")
    assert "abc" not in str(err.value)
    with pytest.raises(ConfigError, match="cannot read"):
        Authenticator.from_files(str(tmp_path / "missing"), "", "")
    (tmp_path / "c").write_text(CLUSTER)
    with pytest.raises(ConfigError, match="bad/job"):
        Authenticator.from_files(str(tmp_path / "c"), "", str(tmp_path / "jobs.json"))
    with pytest.raises(ConfigError, match="job-a") as err:
        Authenticator.from_files(str(tmp_path / "c"), "", str(tmp_path / "jobs2.json"))
    assert "short'" not in str(err.value)


def test_credentials_hide_the_token_and_read_the_environment(tmp_path) -> None:  # type: ignore[no-untyped-def]
    c = Credentials(token=CLUSTER)
    assert CLUSTER not in repr(c)
    (tmp_path / "t").write_text(CLUSTER + "\n")
    assert Credentials.from_env({"MEMSTORE_AUTH_TOKEN_FILE": str(tmp_path / "t")}).token == CLUSTER
    assert Credentials.from_env({"MEMSTORE_AUTH_TOKEN": ADMIN}, token=JOB_A).token == JOB_A  # argument wins
    assert token_of([("authorization", f"Bearer {CLUSTER}")]) == CLUSTER
    assert token_of([("authorization", CLUSTER)]) == ""
    with pytest.raises(ConfigError):
        Credentials(cert="x.pem")


@pytest.mark.parametrize("listen", ["0.0.0.0:7070", "10.1.2.3:7070", "[::]:7070", "example.com:7070"])
def test_serve_refuses_a_reachable_address_without_auth(listen: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="--auth-token-file"):
        StoreConfig.load({"host_id": "h0", "listen": listen, "replicas": 1}, env={})
    assert StoreConfig.load({"host_id": "h0", "listen": listen, "replicas": 1, "insecure": "true"}, env={}).insecure
    (tmp_path / "t").write_text(CLUSTER)
    assert StoreConfig.load({"host_id": "h0", "listen": listen, "replicas": 1, "auth_token_file": str(tmp_path / "t")}, env={})


@pytest.mark.parametrize("listen", ["127.0.0.1:7070", "127.0.0.5:0", "[::1]:7070", "localhost:7070"])
def test_loopback_needs_no_auth(listen: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert StoreConfig.load({"host_id": "h0", "listen": listen, "replicas": 1}, env={}).listen == listen
    monkeypatch.setenv(FORCE_REMOTE_ENV, "1")  # the test-only switch: loopback counts as reachable (tests/ray_integration)
    with pytest.raises(ConfigError, match="reachable from other machines but no --auth-token-file"):
        StoreConfig.load({"host_id": "h0", "listen": listen, "replicas": 1}, env={})


def test_tls_flags_go_together() -> None:
    for cli in ({"tls_cert": "c.pem"}, {"tls_cert": "c.pem", "tls_key": "k.pem"}, {"tls_ca": "ca.pem"}):
        with pytest.raises(ConfigError, match="--tls"):
            StoreConfig.load({"host_id": "h0", "replicas": 1, **cli}, env={})
