"""Where spilled shards live in durable storage, and the per-rank manifest that publishes them.

    <root>/<job_id>/step-<step:012d>/rank-<rank:06d>.shard    the shard's bytes (maybe compressed)
    <root>/<job_id>/step-<step:012d>/rank-<rank:06d>.json     its manifest, written LAST: the publish
    <root>/<job_id>/step-<step:012d>/SPILL                    intent marker: every owner spills this step

A shard without its manifest is invisible (a half-written spill) and garbage-collected later. A step
is spilled when the manifests of all world_size ranks exist and name the same timeline (the save that
produced the shards): durable storage holds one version of a step, and a newer timeline's re-save of
it replaces the old files rank by rank (manifest removed first, published last), never mixing them. Job ids are validated by the wire
contract's pattern and steps and ranks are ints, so no name from the network reaches a path.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from memstore.errors import LayoutError
from memstore.v1.keys import job_id_problem, timeline_problem

STEP_DIR = re.compile(r"step-(\d{12})$")
RANK_FILE = re.compile(r"rank-(\d{6})\.(shard|json)(\.tmp-[0-9a-f]+)?$")  # .tmp-*: a local write in progress (or debris)
MANIFEST_VERSION = 1


def job_dir(root: str, job_id: str) -> str:
    problem = job_id_problem(job_id)
    if problem:
        raise LayoutError(problem)
    return f"{root.rstrip('/')}/{job_id}"


def step_dir(root: str, job_id: str, step: int) -> str:
    if step < 0:
        raise LayoutError(f"step {step} is negative")
    return f"{job_dir(root, job_id)}/step-{step:012d}"


def shard_path(root: str, job_id: str, step: int, rank: int) -> str:
    return f"{step_dir(root, job_id, step)}/rank-{rank:06d}.shard"


def manifest_path(root: str, job_id: str, step: int, rank: int) -> str:
    return f"{step_dir(root, job_id, step)}/rank-{rank:06d}.json"


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

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes, where: str = "manifest") -> SpilledManifest:
        try:
            raw: Any = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise LayoutError(f"{where} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict) or raw.get("version") != MANIFEST_VERSION:
            raise LayoutError(f"{where}: unknown manifest version {raw.get('version') if isinstance(raw, dict) else raw!r}")
        try:
            m = cls(**raw)
        except TypeError as exc:
            raise LayoutError(f"{where}: {exc}") from None
        ints = (m.step, m.rank, m.world_size, m.nbytes, m.chunk_size)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints) or m.chunk_size == 0:
            raise LayoutError(f"{where}: step, rank, world_size, nbytes and chunk_size must be non-negative ints")
        if timeline_problem(m.timeline):
            raise LayoutError(f"{where}: {timeline_problem(m.timeline)}")
        if m.rank >= m.world_size or job_id_problem(m.job_id):
            raise LayoutError(f"{where}: rank {m.rank} / world_size {m.world_size} / job {m.job_id!r} invalid")
        n_chunks = -(-m.nbytes // m.chunk_size) if m.nbytes else 0
        if len(m.checksums) != n_chunks or len(m.stored_chunks) != n_chunks:
            raise LayoutError(f"{where}: {len(m.checksums)} checksums / {len(m.stored_chunks)} chunk sizes for {n_chunks} chunks")
        return m
