"""Checksums and chunking rules of the wire contract.

A shard's bytes are cut into fixed-size chunks (the last may be shorter); each chunk's xxh3-64 is
computed once, when the shard is captured, and verified on every hop: replica write, restore, spill.
xxh3 runs at ~14 GB/s per core here, several times faster than zlib.crc32, so verification costs far
less than the copy it protects.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import xxhash

CHECKSUM_ALGO = "xxh3_64"
DEFAULT_CHUNK_BYTES = 4 << 20
MAX_CHUNK_BYTES = 64 << 20
# Chunks (and so checksums) of one shard. With the default --chunk-bytes (4 MiB) that is 4 TiB per shard;
# it bounds the memory a manifest from the network may take before anything else is checked.
MAX_CHUNKS_PER_SHARD = 1 << 20
# Hashing threads only for shards with at least this many bytes per thread: starting and joining a pool costs about
# 0.2 ms (1 ms on a busy 2-core host), while one thread hashes 8 MiB in about 1 ms (0.3 ms when it is in cache), so a
# small shard (a replica group's stripe, a small model's restore) is hashed fastest on the caller's thread.
PARALLEL_HASH_MIN_BYTES = 8 << 20
# Codecs of the durable tier a client may ask for per job (Manifest.spill_codec); "" = the store's default.
SPILL_CODECS = ("none", "zstd", "zstd-shuffle2", "zstd-shuffle4")


def chunk_count(nbytes: int, chunk_size: int) -> int:
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return max(1, -(-nbytes // chunk_size)) if nbytes else 0


def chunk_spans(nbytes: int, chunk_size: int) -> Iterator[tuple[int, int]]:
    """Yield (offset, length) of every chunk of a buffer of ``nbytes``."""
    for offset in range(0, nbytes, chunk_size):
        yield offset, min(chunk_size, nbytes - offset)


def checksum(data: memoryview | bytes | bytearray) -> int:
    return xxhash.xxh3_64_intdigest(data)


def running_checksum() -> xxhash.xxh3_64:
    """A checksum fed piece by piece (``update``); its ``intdigest()`` equals ``checksum`` of the pieces joined. A
    receiver hashes each piece right after it lands, while it is still in the core's cache, instead of reading the
    whole chunk back from memory afterwards."""
    return xxhash.xxh3_64()


@dataclass(frozen=True)
class ChunkChecksums:
    """A shard's chunk checksums as a client computed them while it copied the shard (``CommitRequest.chunk_checksums``):
    the store takes them as its manifest's instead of reading the shard back to hash it."""

    chunk_size: int
    values: tuple[int, ...]
    algo: str = CHECKSUM_ALGO

    def problem(self, nbytes: int, chunk_size: int) -> str | None:
        """What is wrong with these for a shard of ``nbytes`` on a store cutting chunks of ``chunk_size``, or None."""
        if self.algo != CHECKSUM_ALGO:
            return f"chunk checksums use {self.algo!r}; this store verifies {CHECKSUM_ALGO!r}"
        if self.chunk_size != chunk_size:
            return f"chunk checksums were computed over {self.chunk_size}-byte chunks; this store cuts {chunk_size}-byte ones"
        want = chunk_count(nbytes, chunk_size)
        if len(self.values) != want:
            return f"{len(self.values)} chunk checksums for a shard of {nbytes} bytes, which has {want} chunks of {chunk_size} bytes"
        return None


def compute_checksums(buf: memoryview, nbytes: int, chunk_size: int, workers: int = 1) -> list[int]:
    """Every chunk's checksum; ``workers > 1`` hashes on that many threads (xxhash releases the GIL)."""
    mv = memoryview(buf)
    spans = list(chunk_spans(nbytes, chunk_size))
    workers = max(1, min(workers, len(spans), nbytes // PARALLEL_HASH_MIN_BYTES))
    if workers == 1:
        return [checksum(mv[off : off + length]) for off, length in spans]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda span: checksum(mv[span[0] : span[0] + span[1]]), spans))


def first_mismatch(buf: memoryview, nbytes: int, chunk_size: int, expected: Sequence[int], workers: int = 1) -> int | None:
    """Index of the first chunk whose checksum differs from ``expected``, or None if all match.

    xxhash releases the GIL, so ``workers > 1`` hashes chunks on up to that many threads (restores
    verify a whole shard at once and are otherwise idle), one per ``PARALLEL_HASH_MIN_BYTES`` of the shard.
    """
    if len(expected) != chunk_count(nbytes, chunk_size):
        return -1
    mv = memoryview(buf)
    spans = list(chunk_spans(nbytes, chunk_size))

    def bad_in(indexes: range) -> int | None:
        for index in indexes:
            off, length = spans[index]
            if checksum(mv[off : off + length]) != expected[index]:
                return index
        return None

    workers = max(1, min(workers, len(spans), nbytes // PARALLEL_HASH_MIN_BYTES))
    if workers == 1:
        return bad_in(range(len(spans)))
    step = -(-len(spans) // workers)
    parts = [range(i, min(i + step, len(spans))) for i in range(0, len(spans), step)]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        found = [i for i in pool.map(bad_in, parts) if i is not None]
    return min(found) if found else None


class StreamedChecksums:
    """A shard's chunk checksums computed while it is sent: each chunk is hashed once, by whichever stream sends it
    first (``of``), and the rest (``complete``) once every push has ended, so the owner's manifest carries exactly the
    checksums the receivers verified against."""

    LOCKS = 64

    def __init__(self, nbytes: int, chunk_size: int) -> None:
        self.nbytes = nbytes
        self.chunk_size = chunk_size
        self._sums: list[int | None] = [None] * chunk_count(nbytes, chunk_size)
        self._locks = [threading.Lock() for _ in range(min(self.LOCKS, max(1, len(self._sums))))]

    def of(self, index: int, buf: memoryview) -> int:
        """Chunk ``index``'s checksum (``buf``: the whole shard), computed on first use."""
        with self._locks[index % len(self._locks)]:
            value = self._sums[index]
            if value is None:
                off = index * self.chunk_size
                value = self._sums[index] = checksum(buf[off : min(self.nbytes, off + self.chunk_size)])
            return value

    def complete(self, buf: memoryview) -> tuple[int, ...]:
        """Every chunk's checksum, computing those no stream has (from the end: streams start at their part's front)."""
        mv = memoryview(buf)
        for i in reversed(range(len(self._sums))):
            self.of(i, mv)
        return tuple(self.of(i, mv) for i in range(len(self._sums)))
