"""Reading a spilled shard back: fetch, decode and verify every chunk against its capture checksum."""

from __future__ import annotations

from memstore.errors import CodecError, LayoutError, SpillCorrupt
from memstore.spill import codec as codecs
from memstore.spill import layout
from memstore.spill.layout import SpilledManifest
from memstore.spill.storage import Durable
from memstore.v1.integrity import MAX_CHUNKS_PER_SHARD, checksum, chunk_spans
from memstore.v1.keys import MAX_WORLD_SIZE, host_id_problem


def max_stored_bytes(raw_len: int) -> int:
    """The most bytes a stored chunk of ``raw_len`` original bytes may take (zstd's worst case plus its frame, generously)."""
    return raw_len + (raw_len >> 7) + 4096


def limits_problem(m: SpilledManifest) -> str | None:
    """Why a decoded manifest asks a reader for more than a shard may have (ranks, chunks, stored bytes), or None.

    A manifest read back from durable storage is input like any other: these bound what reading it allocates.
    """
    if m.world_size > MAX_WORLD_SIZE:
        return f"world_size {m.world_size} is beyond {MAX_WORLD_SIZE} (MAX_WORLD_SIZE)"
    if len(m.checksums) > MAX_CHUNKS_PER_SHARD:
        return f"{len(m.checksums)} chunks is beyond {MAX_CHUNKS_PER_SHARD} (MAX_CHUNKS_PER_SHARD) per shard"
    if m.owner_host and host_id_problem(m.owner_host, "owner_host"):
        return host_id_problem(m.owner_host, "owner_host")
    for index, ((_, length), stored) in enumerate(zip(chunk_spans(m.nbytes, m.chunk_size), m.stored_chunks, strict=False)):
        if stored > max_stored_bytes(length):
            return f"stored chunk {index} claims {stored} bytes for {length} original bytes: at most {max_stored_bytes(length)}"
    return None


def read_manifest(durable: Durable, job_id: str, step: int, rank: int) -> SpilledManifest:
    """The published manifest of (job, step, rank); LayoutError if it is malformed, asks for more than a shard may
    have, or describes another shard."""
    path = layout.manifest_path(durable.root, job_id, step, rank)
    m = SpilledManifest.decode(durable.read(path), where=path)
    problem = limits_problem(m)
    if problem:
        raise LayoutError(f"{path}: {problem}")
    if (m.job_id, m.step, m.rank) != (job_id, step, rank):
        raise LayoutError(f"{path} describes {m.job_id!r:.140}/step={m.step}/rank={m.rank}")
    return m


def read_shard_into(durable: Durable, manifest: SpilledManifest, dest: memoryview | bytearray) -> None:
    """Write the shard's original bytes into ``dest``; SpillCorrupt if any chunk fails."""
    m = manifest
    path = layout.shard_path(durable.root, m.job_id, m.step, m.rank)
    spans = list(chunk_spans(m.nbytes, m.chunk_size))
    for index, stored in enumerate(durable.read_stream(path, m.stored_chunks)):
        off, length = spans[index]
        try:
            raw = codecs.decode(m.codec, stored, length)
        except CodecError as exc:
            raise SpillCorrupt(f"{path} chunk {index}: {exc}") from None
        if checksum(raw) != m.checksums[index]:
            raise SpillCorrupt(f"{path} chunk {index} failed its checksum")
        dest[off : off + length] = raw


def read_shard(durable: Durable, manifest: SpilledManifest) -> bytearray:
    out = bytearray(manifest.nbytes)
    read_shard_into(durable, manifest, out)
    return out
