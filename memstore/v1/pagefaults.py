"""Faulting fresh memory in off the caller's thread: ``madvise`` through ctypes (it lets go of the GIL,
where ``mmap.madvise`` holds it for the whole call), and ``FaultAhead``. Used by the data channel's
receivers (stores and clients) and by the store's pre-faulted reserve (``memstore.server.pages``)."""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections.abc import Callable

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
