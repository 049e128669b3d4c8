"""Verification beside the copy: a shard's chunks hashed on threads while its tensors are copied out of it.

A restore onto a device copies every tensor out of the shard's memory (through the bounce ring, or straight out
of a registered segment). Had the store hashed the whole shard first, a pass over every byte would come before the
first copy (about 50 ms/GiB on the H200's host, before the DMA's 20 ms). Instead the store lends the copy as it is
(``OpenRequest.reader_verifies``) and the reader hashes it here: every chunk, in order, on ``workers`` threads, ahead
of the copies; a copy of a tensor waits only for the chunks that hold it (``gate``). So the hashing of chunk i+1
runs while chunk i is copied, and on a host with cores to spare the copy never waits at all.

``finish`` waits for every chunk, the ones no tensor covers too (the header, numpy arrays, padding): a load returns
nothing before every byte of its shard verified against the checksums made at save time. A chunk that fails raises
``CorruptShardError``: the tensors copied so far are dropped with the load, and the reader asks the store again
(``FetchRequest.discard_local``), which checks its copy, drops it and pulls one that verifies.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from memstore.v1.integrity import checksum, chunk_count, chunk_spans
from trainer_client.errors import CorruptShardError

VERIFY_AHEAD_THREADS = max(1, min(16, (os.cpu_count() or 2) - 1))  # all cores but the one copying, up to 16


class ChunkCheck:
    """The chunks of one shard in memory at ``base`` (``view``: its first ``nbytes`` bytes), hashed ahead of the copies.

    ``close`` (or ``finish``) must run before the memory goes: until then threads read it.
    """

    def __init__(
        self, view: memoryview, base: int, chunk_size: int, checksums: Sequence[int], what: str, workers: int = VERIFY_AHEAD_THREADS
    ) -> None:  # fmt: skip
        nbytes = len(view)
        if chunk_size <= 0 or len(checksums) != chunk_count(nbytes, chunk_size):
            raise CorruptShardError(f"{what}: {len(checksums)} checksums of {chunk_size}-byte chunks do not fit {nbytes} bytes")
        self.base, self.nbytes, self.chunk_size, self.what = base, nbytes, chunk_size, what
        self._view = view
        self._checksums = list(checksums)
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="memstore-verify")
        self._chunks: list[Future[bool]] = [
            self._pool.submit(self._check, index, offset, length) for index, (offset, length) in enumerate(chunk_spans(nbytes, chunk_size))
        ]

    def _check(self, index: int, offset: int, length: int) -> bool:
        return checksum(self._view[offset : offset + length]) == self._checksums[index]

    def gate(self, addr: int, nbytes: int) -> None:
        """Before bytes ``[addr, addr + nbytes)`` are copied: wait until the chunks holding them verified; raise
        ``CorruptShardError`` if one failed. Bytes outside the shard are none of its business."""
        start = addr - self.base
        if nbytes <= 0 or start < 0 or start >= self.nbytes:
            return
        last = min(self.nbytes, start + nbytes) - 1
        for index in range(start // self.chunk_size, last // self.chunk_size + 1):
            self._wait(index)

    def finish(self) -> None:
        """Wait for every chunk (raise if one failed), then let go of the memory."""
        try:
            for index in range(len(self._chunks)):
                self._wait(index)
        finally:
            self.close()

    def close(self) -> None:
        """Stop hashing (chunks not started are dropped) and wait for the threads: the memory may go after this."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._view.release()

    def _wait(self, index: int) -> None:
        if not self._chunks[index].result():
            raise CorruptShardError(f"chunk {index} of {self.what} failed its checksum")
