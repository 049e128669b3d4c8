"""Memory helpers of the shard format: flat byte views, parallel memmove (hashing each chunk as it is copied, when
asked), and a GC pause for header bursts."""

from __future__ import annotations

import ctypes
import gc
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from memstore.v1.integrity import chunk_count, running_checksum
from trainer_client.errors import InvalidArgumentError
from trainer_client.serialization.spec import Buffer

__all__ = ["ChunkSums", "GcPaused", "as_byte_view", "memmove_hashing", "parallel_memmove"]


class GcPaused:
    """Pause the cyclic GC while building or parsing a big header.

    Plan and decode create tens of thousands of small lists and dicts in a burst; each
    allocation threshold crossing triggers a collection that walks every live object,
    which measured 2-3x slower for a 10k-tensor state. Only re-enables the GC if it was
    enabled on entry.
    """

    __slots__ = ("was_enabled",)

    def __enter__(self) -> None:
        self.was_enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self.was_enabled:
            gc.enable()


def as_byte_view(buf: Buffer) -> memoryview:
    """A flat unsigned-byte memoryview of ``buf`` (raises TypeError/InvalidArgumentError)."""
    mv = memoryview(buf)
    if mv.format == "B" and mv.ndim == 1 and mv.c_contiguous:
        return mv
    try:
        if not mv.c_contiguous:
            raise InvalidArgumentError("shard buffers must be C-contiguous")
        return mv.cast("B")
    finally:
        mv.release()


# --------------------------------------------------------------------------------------
# large copies
# --------------------------------------------------------------------------------------

_COPY_THREADS = max(1, min(4, os.cpu_count() or 1))
_COPY_PIECE = 16 << 20
HASH_PIECE = 256 << 10  # memmove_hashing copies, then hashes, this much at a time: it is still in L2 when hashed
_copy_pool: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _copy_pool
    if _copy_pool is None:
        _copy_pool = ThreadPoolExecutor(max_workers=_COPY_THREADS, thread_name_prefix="memstore-copy")
    return _copy_pool


def parallel_memmove(moves: list[tuple[int, int, int]]) -> None:
    """Copy (dst, src, n) ranges with plain memmove on a few threads (ctypes drops the GIL).

    Why not ``Tensor.copy_``: its OpenMP workers spin-wait at a barrier, and when the trainer's
    cores are busy (other ranks, data-loader workers, the store) one descheduled worker stalls
    the whole copy: 10 MiB measured at 2.5 ms single-threaded took up to 335 ms that way.
    Independent memmoves of 16 MiB pieces degrade gracefully instead.
    """
    pieces = [(d + off, s + off, min(_COPY_PIECE, n - off)) for d, s, n in moves for off in range(0, n, _COPY_PIECE)]
    if len(pieces) <= 1 or _COPY_THREADS == 1:
        for d, s, n in pieces:
            ctypes.memmove(d, s, n)
        return
    list(_pool().map(lambda p: ctypes.memmove(*p), pieces))


@dataclass
class ChunkSums:
    """Asks ``ShardLayout.write_into`` to hash the shard's ``chunk_size`` chunks as it copies them (the chunking and
    checksum of ``memstore.v1.integrity``); ``values`` holds them afterwards, or stays None where the copy could not
    hash (blobs left to device copies, a copy in marks): the store then hashes the shard itself."""

    chunk_size: int
    values: list[int] | None = None


def memmove_hashing(moves: list[tuple[int, int, int]], base: int, nbytes: int, chunk_size: int) -> list[int]:
    """``parallel_memmove`` of ``moves`` (all inside ``[base, base + nbytes)``) that returns the checksum of every
    ``chunk_size`` chunk of that range. A worker takes one chunk: it copies the chunk's pieces in ``HASH_PIECE`` steps
    and hashes each step right after copying it, while the bytes are still in the core's cache (reading a chunk back
    from memory later, as the store would, costs about three times as much). Every byte of the range that ``moves``
    do not write must be final already: it is hashed as it is."""
    count = chunk_count(nbytes, chunk_size)
    pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(count)]  # (offset in the range, src, n) per chunk
    for d, s, n in moves:
        start, end = d - base, d - base + n
        if start < 0 or end > nbytes:
            raise InvalidArgumentError(f"a copy of {n} bytes at offset {start} lies outside the {nbytes}-byte shard")
        while start < end:
            index = start // chunk_size
            stop = min(end, (index + 1) * chunk_size)
            pieces[index].append((start, s + start - (d - base), stop - start))
            start = stop
    whole = memoryview((ctypes.c_char * nbytes).from_address(base)).cast("B")

    def one(index: int) -> int:
        running = running_checksum()
        at, end = index * chunk_size, min(nbytes, (index + 1) * chunk_size)
        for offset, src, n in sorted(pieces[index]):
            running.update(whole[at:offset])  # bytes written before the copies (header, small blobs, padding)
            for step in range(0, n, HASH_PIECE):
                size = min(HASH_PIECE, n - step)
                ctypes.memmove(base + offset + step, src + step, size)
                running.update(whole[offset + step : offset + step + size])
            at = offset + n
        running.update(whole[at:end])
        return running.intdigest()

    try:
        if count <= 1 or _COPY_THREADS == 1:
            return [one(i) for i in range(count)]
        return list(_pool().map(one, range(count)))
    finally:
        whole.release()
