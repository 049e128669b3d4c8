"""Chunked byte streams of the wire contract, shared by stores and trainer clients.

Senders slice a shard buffer into ``manifest.chunk_size`` pieces; receivers copy each piece straight
into a preallocated destination and verify its checksum as it lands, so a corrupt or short stream is
rejected before anything is registered. Receivers verify against the core's Manifest
(``memstore.core.model``; ``memstore.v1.manifests`` converts a received one, once per shard); the
messages that are sent are built from the wire's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from memstore.core.model import Manifest, Stripe
from memstore.errors import OversizedChunk, StreamChecksumError, StreamError
from memstore.v1 import store_pb2 as pb
from memstore.v1.integrity import MAX_CHUNK_BYTES, MAX_CHUNKS_PER_SHARD, SPILL_CODECS, checksum, chunk_count, chunk_spans
from memstore.v1.keys import host_id_problem, key_problem, metrics_problem


def manifest_problem(m: Manifest) -> str | None:
    """Why a manifest can't describe a valid stream, or None."""
    if m.chunk_size <= 0 or m.chunk_size > MAX_CHUNK_BYTES:
        return f"manifest chunk_size {m.chunk_size} is invalid: expected 1..{MAX_CHUNK_BYTES} (MAX_CHUNK_BYTES, the largest --chunk-bytes)"
    if m.nbytes < 0:
        return f"manifest nbytes {m.nbytes} is invalid: expected >= 0"
    expected = chunk_count(m.nbytes, m.chunk_size)
    if expected > MAX_CHUNKS_PER_SHARD:
        return (
            f"manifest of {m.nbytes} bytes in chunks of {m.chunk_size} has {expected} chunks: at most {MAX_CHUNKS_PER_SHARD} "
            "(MAX_CHUNKS_PER_SHARD) per shard; raise the sender's --chunk-bytes"
        )
    if len(m.checksums) != expected:
        return f"manifest has {len(m.checksums)} checksums for {m.nbytes} bytes in chunks of {m.chunk_size}; expected {expected}"
    return None


def stripe_problem(s: Stripe, rank: int, world_size: int, nbytes: int) -> str | None:
    """Why ``s`` cannot describe the stripe that shard ``rank`` (of ``nbytes`` bytes, in a job of ``world_size``
    ranks) holds of its replica group's save, or None. The store checks it at Commit and at every transfer's header."""
    n = len(s.group)
    if not 1 <= n <= world_size:
        return f"stripe.group has {n} ranks: expected 1..world_size ({world_size})"
    if not 0 <= s.index < n:
        return f"stripe.index {s.index} is out of range: stripe.group has {n} ranks"
    seen: set[int] = set()
    for r in s.group:
        if not 0 <= r < world_size:
            return f"stripe.group names rank {r}: expected ranks 0..{world_size - 1} (world_size {world_size})"
        if r in seen:
            return f"stripe.group names rank {r} twice: the ranks of a replica group are distinct"
        seen.add(r)
    if s.group[s.index] != rank:
        return f"stripe.group[{s.index}] (stripe.index) is rank {s.group[s.index]}, but the shard is rank {rank}"
    if s.stripe_nbytes > s.logical_nbytes:
        return f"stripe.stripe_nbytes {s.stripe_nbytes} is more than stripe.logical_nbytes {s.logical_nbytes}: a stripe is part of it"
    if s.stripe_nbytes > nbytes:
        return f"stripe.stripe_nbytes {s.stripe_nbytes} is more than the shard's nbytes {nbytes}: the shard holds its stripe"
    return None


def shard_manifest_problem(m: Manifest, owner_required: bool = True) -> str | None:
    """Why a shard's manifest from the network (a Put header, a data-channel ticket, a pulled copy) is not valid, or None.

    Its key, world size and timeline, its stream layout (``manifest_problem``), its owner's host id (may be
    empty only for a client's save, where the receiving store becomes the owner), its metrics, its codec and its
    stripe (``stripe_problem``), if any.
    """
    k = m.key
    problem = key_problem(k.job_id, k.step, k.rank, m.world_size, k.timeline) or manifest_problem(m) or metrics_problem(m.metrics)
    if not problem and m.stripe is not None:
        problem = stripe_problem(m.stripe, k.rank, m.world_size, m.nbytes)
    if problem:
        return problem
    if (owner_required or m.owner_host) and host_id_problem(m.owner_host, "manifest owner_host"):
        return host_id_problem(m.owner_host, "manifest owner_host")
    if m.spill_codec and m.spill_codec not in SPILL_CODECS:
        return f"spill codec {m.spill_codec!r:.40} is unknown: expected one of {', '.join(SPILL_CODECS)} (or empty for the store's default)"
    return None


def iter_chunks(buf: memoryview, nbytes: int, chunk_size: int) -> Iterator[bytes]:
    """The shard's bytes as protobuf-ready chunks (one copy each: protobuf needs ``bytes``)."""
    mv = memoryview(buf)
    for off, length in chunk_spans(nbytes, chunk_size):
        yield bytes(mv[off : off + length])


def put_requests(header: pb.PutHeader, buf: memoryview) -> Iterator[pb.PutRequest]:
    yield pb.PutRequest(header=header)
    m = header.manifest
    for chunk in iter_chunks(buf, m.nbytes, m.chunk_size):
        yield pb.PutRequest(chunk=chunk)


def get_responses(manifest: pb.Manifest, buf: memoryview, chunk_size: int = 0) -> Iterator[pb.GetResponse]:
    yield pb.GetResponse(manifest=manifest)
    for chunk in iter_chunks(buf, manifest.nbytes, manifest.chunk_size):
        yield pb.GetResponse(chunk=chunk)


def verify_chunk(manifest: Manifest, index: int, data: memoryview | bytes, where: str = "", expected: int | None = None) -> None:
    """Raise StreamChecksumError unless ``data`` is chunk ``index`` of the manifest's shard (the one chunk check of both
    transports); ``expected``: the checksum that came with the chunk (streamed checksums) instead of the manifest's."""
    check_chunk(manifest, index, checksum(data), where, expected)


def check_chunk(manifest: Manifest, index: int, got: int, where: str = "", expected: int | None = None) -> None:
    """``verify_chunk`` for a chunk whose checksum ``got`` was computed as it arrived (``running_checksum``)."""
    want = manifest.checksums[index] if expected is None else expected
    if got != want:
        k = manifest.key
        raise StreamChecksumError(
            f"chunk {index} of {k.job_id}/step={k.step}/rank={k.rank} failed its checksum{where} (got {got:016x}, expected {want:016x})",
        )


def receive_chunks(chunks: Iterable[bytes], manifest: Manifest, dest: memoryview, on_chunk: Callable[[int], None] | None = None) -> int:
    """Copy ``chunks`` into ``dest`` verifying each against the manifest. Returns bytes received.

    Raises StreamError on an oversized chunk, a checksum mismatch, or a stream of the wrong length.
    """
    out = memoryview(dest)
    spans = list(chunk_spans(manifest.nbytes, manifest.chunk_size))
    index = 0
    for chunk in chunks:
        if index >= len(spans):
            raise StreamError(f"stream has more than the {len(spans)} chunks its manifest declares")
        off, length = spans[index]
        if len(chunk) != length:
            if len(chunk) > length:
                raise OversizedChunk(
                    f"chunk {index} has {len(chunk)} bytes: more than the {length} its manifest declares "
                    f"(chunk size {manifest.chunk_size}, the sender's --chunk-bytes)"
                )
            raise StreamError(f"chunk {index} has {len(chunk)} bytes; the manifest expects {length}")
        verify_chunk(manifest, index, chunk)
        out[off : off + length] = chunk
        index += 1
        if on_chunk:
            on_chunk(index)
    if index != len(spans):
        raise StreamError(f"stream ended after {index} of {len(spans)} chunks")
    return manifest.nbytes
