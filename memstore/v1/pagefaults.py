"""Faulting fresh memory in off the caller's thread: ``madvise`` through ctypes (it lets go of the GIL,
where ``mmap.madvise`` holds it for the whole call), ``FaultAhead`` and ``populate_writable``. Used by the data
channel's receivers (stores and clients), by the store's pre-faulted reserve (``memstore.server.memory.pages``) and by a
client mapping a segment it is about to write (``trainer_client.capture.ring``)."""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


madvise = _libc_madvise()  # (address, length, advice) -> 0 or -1; None where libc has no madvise


def address_of(buf: memoryview | mmap.mmap) -> int:
    """The address of a writable buffer's first byte (no export is left behind)."""
    anchor = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


class FaultAhead:
    """Fault the pages of a writable buffer in on a thread, front to back (``MADV_POPULATE_WRITE``, which
    lets go of the GIL through ctypes), while the caller fills it from the front: the first touch of
    fresh memory (~0.3-0.8 s per GiB) then runs beside the copy into it. Best effort: without the call
    (Linux < 5.14) the caller faults the pages itself, as without this helper."""

    STEP = 8 << 20

    def __init__(self, view: memoryview) -> None:
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        if madvise is None or len(view) < 2 * self.STEP or view.readonly:
            return
        start = address_of(view)
        self._thread = threading.Thread(target=self._run, args=(start, len(view)), name="fault-ahead", daemon=True)
        self._thread.start()

    def _run(self, start: int, length: int) -> None:
        assert madvise is not None
        first = start - start % mmap.PAGESIZE
        end = start + length
        for addr in range(first, end, self.STEP):
            if self._stopped.is_set() or madvise(addr, min(self.STEP, end - addr), MADV_POPULATE_WRITE) != 0:
                return

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()


POPULATE_THREADS = max(1, min(4, os.cpu_count() or 1))


@functools.cache
def populate_supported() -> bool:
    """Whether this kernel has ``MADV_POPULATE_WRITE`` (Linux >= 5.14): then a page that cannot be allocated (a full
    tmpfs) is an error of the call, never a SIGBUS at the first write. Tried once on a page of anonymous memory."""
    if madvise is None:
        return False
    probe = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        return madvise(address_of(probe), mmap.PAGESIZE, MADV_POPULATE_WRITE) == 0
    finally:
        probe.close()


def populate_writable(addr: int, length: int, threads: int = POPULATE_THREADS) -> bool:
    """Fault ``[addr, addr + length)`` in for writing, its parts on ``threads`` threads at once: pages a store made
    but never touched (a fresh segment) are allocated and zeroed in parallel, ones already in only get their page
    tables. False if a page could not be allocated (a full tmpfs) or the kernel lacks the call: writing the range
    then risks a SIGBUS, so the caller must not."""
    if not populate_supported():
        return False
    assert madvise is not None
    first = addr - addr % mmap.PAGESIZE
    end = addr + length
    parts = max(1, min(threads, (end - first) // (FaultAhead.STEP * 2)))
    bounds = [first + (end - first) * i // parts // mmap.PAGESIZE * mmap.PAGESIZE for i in range(parts)] + [end]

    def one(i: int) -> bool:
        return madvise(bounds[i], bounds[i + 1] - bounds[i], MADV_POPULATE_WRITE) == 0

    if parts == 1:
        return one(0)
    with ThreadPoolExecutor(max_workers=parts - 1, thread_name_prefix="populate") as pool:
        others = [pool.submit(one, i) for i in range(1, parts)]  # the GIL is let go in each call: they run at once
        mine = one(0)
        return all([mine, *(f.result() for f in others)])
