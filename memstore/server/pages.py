"""Faulting memory in ahead of need: populate mappings, ask for huge pages, give pages back.

Used by the segment pool's reserve (``memstore.server.segments``); every call here lets go of the GIL
for its system call, so a store's other threads keep serving while memory faults in.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
from collections.abc import Callable

PAGE = mmap.PAGESIZE
FAULT_STEP = 64 << 20  # fault_in works in steps of this many bytes, checking for cancellation between them
MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)


def advise_huge(mm: mmap.mmap) -> None:
    """Ask for transparent huge pages (taken where the kernel allows them for this kind of memory: anonymous
    memory with THP ``madvise``/``always``, tmpfs with ``shmem_enabled`` ``advise``/``within_size``/``always``)."""
    with contextlib.suppress(OSError, ValueError):
        mm.madvise(_MADV_HUGEPAGE)


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_madvise = _libc_madvise()  # through ctypes, which lets go of the GIL (mmap.madvise holds it for the whole call)


def _address(mm: mmap.mmap) -> int:
    anchor = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor  # no export left behind: the map can still be resized or closed


def populate(mm: mmap.mmap, fd: int, start: int, length: int) -> None:
    """Fault in [start, start+length) of ``mm`` for writing: pages allocated, zeroed and mapped.

    The store's other threads keep running meanwhile (the GIL is released): the reserve faults memory in
    while the store serves saves."""
    if _madvise is not None and _madvise(_address(mm) + start, length, _MADV_POPULATE_WRITE) == 0:
        return
    if fd < 0:
        mv = memoryview(mm)
        try:  # touch one byte per page
            for off in range(start, start + length, PAGE):
                mv[off] = 0
        finally:
            mv.release()
        return
    # Older kernels: a populating mapping of the range zeroes its pages in the page cache.
    extra = mmap.mmap(fd, length, flags=MAP_FLAGS, offset=start)
    extra.close()


def give_back(mm: mmap.mmap, start: int) -> bool:
    """Drop the pages of anonymous ``mm`` from ``start`` to its end (they read as zeros again); whether it could."""
    return _madvise is not None and not mm.closed and _madvise(_address(mm) + start, len(mm) - start, _MADV_DONTNEED) == 0


def fault_in(fd: int, size: int, cancel: threading.Event) -> mmap.mmap:
    """Map ``size`` bytes of file ``fd`` (-1: anonymous memory) shared and fault every page in, allocated
    and zeroed, step by step; InterruptedError as soon as ``cancel`` is set. The file's blocks are reserved
    (``posix_fallocate``) as it goes, so a full tmpfs fails here, not with SIGBUS later."""
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    try:
        advise_huge(mm)
        for start in range(0, size, FAULT_STEP):
            if cancel.is_set():
                raise InterruptedError("faulting in cancelled: an allocation needs the bytes")
            step = min(FAULT_STEP, size - start)
            if fd >= 0:
                os.posix_fallocate(fd, start, step)
            populate(mm, fd, start, step)
    except BaseException:
        mm.close()
        raise
    return mm
