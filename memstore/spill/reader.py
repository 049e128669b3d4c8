"""Reading a spilled shard back: fetch, decode and verify every chunk against its capture checksum."""

from __future__ import annotations

from memstore.errors import CodecError, LayoutError, SpillCorrupt
from memstore.spill import codec as codecs
from memstore.spill import layout
from memstore.spill.layout import SpilledManifest
from memstore.spill.storage import Durable
from memstore.v1.integrity import checksum, chunk_spans


def read_manifest(durable: Durable, job_id: str, step: int, rank: int) -> SpilledManifest:
    """The published manifest of (job, step, rank); LayoutError if it is malformed or describes another shard."""
    path = layout.manifest_path(durable.root, job_id, step, rank)
    m = SpilledManifest.decode(durable.read(path), where=path)
    if (m.job_id, m.step, m.rank) != (job_id, step, rank):
        raise LayoutError(f"{path} describes {m.job_id}/step={m.step}/rank={m.rank}")
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
