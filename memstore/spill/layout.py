"""Where spilled shards live in durable storage, and the per-rank manifest that publishes them.

    <root>/<job_id>/step-<step:012d>/rank-<rank:06d>.shard    the shard's bytes (maybe compressed)
    <root>/<job_id>/step-<step:012d>/rank-<rank:06d>.json     its manifest, written LAST: the publish
    <root>/<job_id>/step-<step:012d>/SPILL                    intent marker: every owner spills this step

A shard without its manifest is invisible (a half-written spill) and garbage-collected later. A step
is spilled when the manifests of all world_size ranks exist and name the same timeline (the save that
produced the shards): durable storage holds one version of a step, and a newer timeline's re-save of
it replaces the old files rank by rank (manifest removed first, published last), never mixing them.

No name from the network or from a manifest read back reaches a path unchecked: the functions below
refuse (``LayoutError``, naming the value) a job id outside the wire contract's pattern, any name that is
empty, '.', '..' or holds a separator or NUL, and a step or rank that is not an int >= 0.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from memstore.core.model import Stripe
from memstore.errors import LayoutError
from memstore.v1.integrity import MAX_CHUNK_BYTES, SPILL_CODECS, chunk_spans
from memstore.v1.keys import MAX_WORLD_SIZE, job_id_problem, timeline_problem
from memstore.v1.streams import stripe_problem

STEP_DIR = re.compile(r"step-(\d{12,})$")  # zero-padded to 12 digits; a step >= 10**12 has more
RANK_FILE = re.compile(r"rank-(\d{6,})\.(shard|json)(\.tmp-[0-9a-f]+)?$")  # .tmp-*: a local write in progress (or debris)
MANIFEST_VERSION = 1


def _component(name: str, what: str) -> str:
    """``name`` as one component of a durable path: never empty, '.' or '..', nor holding a separator or a NUL
    (so never absolute either). Every name that reaches a path passes here, whatever checked it before."""
    if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        raise LayoutError(f"{what} {name!r:.160} cannot name a durable path: it would leave its directory or be empty")
    return name


def _index(value: int, what: str) -> int:
    """A step or rank as it goes into a name: an int >= 0 (formatted as digits only)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise LayoutError(f"{what} {value!r:.80} cannot name a durable path: expected an int >= 0")
    return value


def job_dir(root: str, job_id: str) -> str:
    problem = job_id_problem(job_id)
    if problem:
        raise LayoutError(problem)
    return f"{root.rstrip('/')}/{_component(job_id, 'job_id')}"


def step_dir(root: str, job_id: str, step: int) -> str:
    return f"{job_dir(root, job_id)}/step-{_index(step, 'step'):012d}"


def _rank_file(rank: int, ext: str) -> str:
    return f"rank-{_index(rank, 'rank'):06d}.{ext}"


def shard_path(root: str, job_id: str, step: int, rank: int) -> str:
    return f"{step_dir(root, job_id, step)}/{_rank_file(rank, 'shard')}"


def manifest_path(root: str, job_id: str, step: int, rank: int) -> str:
    return f"{step_dir(root, job_id, step)}/{_rank_file(rank, 'json')}"


def intent_path(root: str, job_id: str, step: int) -> str:
    return f"{step_dir(root, job_id, step)}/SPILL"


@dataclass
class SpilledManifest:
    """What a reader needs to fetch, decompress and verify one spilled shard."""

    job_id: str
    step: int
    rank: int
    world_size: int
    nbytes: int  # uncompressed shard size
    chunk_size: int
    checksums: list[int]  # xxh3-64 of each uncompressed chunk, from capture
    owner_host: str
    codec: str = "none"
    stored_chunks: list[int] = field(default_factory=list)  # byte length of each stored (encoded) chunk
    metrics: dict[str, float] = field(default_factory=dict)
    format_version: int = 0
    created_unix: float = 0.0
    spilled_unix: float = 0.0
    version: int = MANIFEST_VERSION
    timeline: str = ""  # the save that produced the shard (see memstore.core.restorable)
    stripe: Stripe | None = None  # a stripe of a replica group's save (an object of Stripe's fields); absent: ordinary

    def encode(self) -> bytes:
        doc = asdict(self)
        if self.stripe is None:
            del doc["stripe"]  # an ordinary shard's manifest stays as before stripes (readable by older stores)
        else:
            del doc["stripe"]["slices_only"]  # not kept here (readable by older stores): a restore then decodes the stripe
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes, where: str = "manifest") -> SpilledManifest:
        try:
            raw: Any = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise LayoutError(f"{where} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict) or raw.get("version") != MANIFEST_VERSION:
            found = f"version {raw.get('version')!r}" if isinstance(raw, dict) else f"a JSON {type(raw).__name__}"
            raise LayoutError(f"{where}: expected an object of manifest version {MANIFEST_VERSION}, found {found}")
        stripe = raw.pop("stripe", None)
        try:
            m = cls(**raw)
        except TypeError as exc:
            raise LayoutError(f"{where}: {exc}") from None
        problem = _manifest_problem(m)
        if not problem and stripe is not None:
            m.stripe, problem = _stripe_from_json(stripe)
            if m.stripe is not None:
                problem = stripe_problem(m.stripe, m.rank, m.world_size, m.nbytes)
        if problem:
            raise LayoutError(f"{where}: {problem}")
        return m


def _is_uint(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value: object) -> bool:
    return type(value) in (int, float)


def _stripe_from_json(raw: Any) -> tuple[Stripe | None, str | None]:
    """A manifest's ``stripe`` object as a Stripe, or why it is not one (its fields' types; its sense: ``stripe_problem``)."""
    fields = ("group", "index", "logical_nbytes", "stripe_nbytes")
    if not isinstance(raw, dict) or set(raw) != set(fields):
        return None, f"stripe must be an object of {', '.join(fields)}"
    group = raw["group"]
    if not isinstance(group, list) or len(group) > MAX_WORLD_SIZE or not all(_is_uint(r) for r in group):
        return None, f"stripe.group must be a list of at most {MAX_WORLD_SIZE} non-negative ints"
    if not all(_is_uint(raw[f]) for f in fields[1:]):
        return None, "stripe.index, stripe.logical_nbytes and stripe.stripe_nbytes must be non-negative ints"
    return Stripe(tuple(group), raw["index"], raw["logical_nbytes"], raw["stripe_nbytes"]), None


def _manifest_problem(m: SpilledManifest) -> str | None:
    """Why a decoded manifest cannot describe a spilled shard (every field's type and the chunk table), or None."""
    if not all(_is_uint(v) for v in (m.step, m.rank, m.world_size, m.nbytes, m.chunk_size, m.format_version)):
        return "step, rank, world_size, nbytes, chunk_size and format_version must be non-negative ints"
    if not 1 <= m.chunk_size <= MAX_CHUNK_BYTES:
        return f"chunk_size {m.chunk_size} is invalid: expected 1..{MAX_CHUNK_BYTES}"
    problem = timeline_problem(m.timeline) or job_id_problem(m.job_id)
    if problem:
        return problem
    if m.rank >= m.world_size:
        return f"rank {m.rank} is invalid for world_size {m.world_size}"
    if m.codec not in SPILL_CODECS or not isinstance(m.owner_host, str):
        return f"codec {m.codec!r:.40} / owner_host {m.owner_host!r:.80} invalid: codecs are {', '.join(SPILL_CODECS)}"
    if not isinstance(m.checksums, list) or not all(_is_uint(c) and c < 1 << 64 for c in m.checksums):
        return "checksums must be a list of unsigned 64-bit ints"
    if not isinstance(m.stored_chunks, list) or not all(_is_uint(c) for c in m.stored_chunks):
        return "stored_chunks must be a list of non-negative ints"
    n_chunks = -(-m.nbytes // m.chunk_size)
    if len(m.checksums) != n_chunks or len(m.stored_chunks) != n_chunks:
        return f"{len(m.checksums)} checksums / {len(m.stored_chunks)} chunk sizes for {n_chunks} chunks"
    if m.codec == "none" and m.stored_chunks != [length for _, length in chunk_spans(m.nbytes, m.chunk_size)]:
        return "stored chunk sizes of an uncompressed shard differ from its chunk sizes"
    if not isinstance(m.metrics, dict) or not all(type(k) is str and _is_number(v) for k, v in m.metrics.items()):
        return "metrics must be an object of numbers"
    if not (_is_number(m.created_unix) and _is_number(m.spilled_unix)):
        return "created_unix and spilled_unix must be numbers"
    return None
