"""Faulting memory in ahead of need: populate mappings, ask for huge pages, give pages back.

Used by the segment pool's reserve (``memstore.server.memory.reserve``); every call here lets go of the GIL
for its system call, so a store's other threads keep serving while memory faults in.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading

from memstore.v1.pagefaults import MADV_POPULATE_WRITE, address_of, madvise

PAGE = mmap.PAGESIZE
FAULT_STEP = 64 << 20  # fault_in works in steps of this many bytes, checking for cancellation between them
MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)


def round_up(n: int) -> int:
    """``n`` bytes rounded up to whole pages, at least one page: what a segment of ``n`` bytes takes."""
    return max(PAGE, -(-n // PAGE) * PAGE)


def advise_huge(mm: mmap.mmap) -> None:
    """Ask for transparent huge pages (taken where the kernel allows them for this kind of memory: anonymous
    memory with THP ``madvise``/``always``, tmpfs with ``shmem_enabled`` ``advise``/``within_size``/``always``)."""
    with contextlib.suppress(OSError, ValueError):
        mm.madvise(_MADV_HUGEPAGE)


def populate(mm: mmap.mmap, fd: int, start: int, length: int) -> None:
    """Fault in [start, start+length) of ``mm`` for writing: pages allocated, zeroed and mapped.

    The store's other threads keep running meanwhile (the GIL is released): the reserve faults memory in
    while the store serves saves."""
    if madvise is not None and madvise(address_of(mm) + start, length, MADV_POPULATE_WRITE) == 0:
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
    return madvise is not None and not mm.closed and madvise(address_of(mm) + start, len(mm) - start, _MADV_DONTNEED) == 0


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
