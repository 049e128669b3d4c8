"""One shared-memory segment: a mapped region of a file on the tmpfs (or anonymous memory) holding one shard,
and ``SegmentMaker``, which makes them.

``memstore.server.memory.pool.SegmentPool`` recycles and accounts them; ``memstore.server.memory.reserve.Reserve`` keeps
fresh ones faulted in ahead of need; ``memstore.server.memory.leftovers.Leftovers`` maps those a previous store left.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import secrets
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from memstore.core.sizes import format_size
from memstore.errors import CapacityExceeded
from memstore.server.memory.pages import MAP_FLAGS, fault_in, give_back
from memstore.server.memory.shm_dirs import SEGMENT_PREFIX, sidecar_path
from memstore.v1.pagefaults import address_of, populate_supported, populate_writable

log = logging.getLogger(__name__)

NO_RING = -1  # Segment.ring of a segment in no rank's capture ring


class Segment:
    """One mapped region. ``path`` is None for anonymous memory (no shm dir configured)."""

    __slots__ = ("_closed", "described", "exported", "fresh", "mm", "owner", "path", "ring", "size", "sparse")

    def __init__(self, path: str | None, size: int, mm: mmap.mmap) -> None:
        self.path = path
        self.owner = ""  # job whose bytes the segment last held; pooled segments are reused by that job only
        # The rank of ``owner`` whose capture ring it belongs to (NO_RING: none): it goes back to that rank's saves
        # only, because its client keeps it mapped and registered for DMA (never resized while in a ring).
        self.ring = NO_RING
        # A reader mapped it (copy-on-write): its bytes must never change, so it is unlinked, not recycled.
        self.exported = False
        self.described = False  # a sidecar exists next to it (SegmentPool.describe)
        self.fresh = False  # made for the shard that took it, never touched: its pages fault in as they are written
        # Made without its pages (``SegmentMaker.create(sparse=True)``): its client faults them in before writing
        # (``populate_writable``), so until a commit shows it did, nothing else may write into it (never pooled).
        self.sparse = False
        self.size = size
        self.mm = mm
        self._closed = False

    @contextlib.contextmanager
    def opened(self) -> Iterator[int | None]:
        """A read-only descriptor of the segment's file while the block runs, to send its pages from by reference
        (``datachannel.send_all(source=)``); None for anonymous memory or a file that is gone (unlinked on export)."""
        fd = None
        if self.path:
            with contextlib.suppress(OSError):
                fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    def view(self, nbytes: int | None = None) -> memoryview:
        """The first ``nbytes`` (default ``size``; the map may be longer after a shrink, see ``shrink_to``)."""
        return memoryview(self.mm)[: self.size if nbytes is None else nbytes]

    def extend(self, size: int) -> bool:
        """Make the file and the map ``size`` bytes long, the file's blocks reserved now (a full tmpfs fails here,
        not with SIGBUS later); whether it could (anonymous memory cannot grow). ``size`` is the caller's to set."""
        if not self.path:
            return False
        try:
            fd = os.open(self.path, os.O_RDWR)
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
            self.mm.resize(size)  # sets the file's size and remaps
        except (OSError, ValueError, TypeError) as exc:
            log.debug("cannot grow segment %s to %d bytes: %s", self.path, size, exc)
            return False
        return True

    def shrink_to(self, size: int) -> None:
        """Give the pages past ``size`` back (the map keeps its length; nothing reads past ``size``). Costs ~0.2 s
        per GiB: the reserve's thread calls it, off the saves' path. Failures are logged."""
        try:
            if self.path:
                os.truncate(self.path, size)
            else:
                give_back(self.mm, size)
        except (OSError, ValueError) as exc:
            log.debug("cannot trim segment %s to %d bytes: %s", self.path, size, exc)

    def unmap(self) -> bool:
        """Unmap, keeping the file (and sidecar) on the tmpfs. Whether it is unmapped now (False: a view of this
        store's still references the map, which goes when that view does)."""
        if self._closed:
            return True
        self._closed = True
        try:
            self.mm.close()
        except BufferError:
            # A memoryview still references the map (an in-flight reader); the pages go when it does.
            log.debug("segment %s still exported; unmapped when its last view is released", self.path)
            return False
        return True

    def destroy(self, free_pages: bool = False) -> None:
        """Unmap and unlink the file and its sidecar.

        ``free_pages``: empty the file first (truncate it to 0), so its pages go back to the kernel now even while a
        client still maps it: a capture ring's segment leaving the ring (its client drops the mapping only at its next
        ``Allocate``). Only for a segment nobody reads or writes any more: never an exported one (a reader's mapping),
        nor while a view of this store's still references it. Pages a client registered for DMA stay pinned until it
        unregisters them."""
        unmapped = self.unmap()
        if free_pages and unmapped and self.path and not self.exported:
            try:
                os.truncate(self.path, 0)
            except OSError as exc:
                log.debug("cannot empty segment %s before unlinking it: %s", self.path, exc)
        if self.path:
            for path in (self.path, sidecar_path(self.path)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            self.described = False


SPARSE_MARGIN = 64 << 20  # a sparse segment is made only with this much more room on the tmpfs than it needs


def _room_on(directory: Path) -> int:
    """Bytes the filesystem of ``directory`` has free for an unprivileged writer."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


class SegmentMaker:
    """Makes segments: files ``seg-<pid>-<n>-<hex>`` in ``directory`` on the tmpfs (None: anonymous memory)."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self._names = itertools.count()

    def create(self, size: int, *, used: int, capacity: int, sparse: bool = False) -> Segment:
        """A fresh segment of ``size`` bytes, its pages allocated and mapped (on all cores, ``populate_writable``,
        where the kernel has it). Raises CapacityExceeded (with ``used`` and ``capacity``, the pool's counts) if the
        tmpfs cannot hold it.

        ``sparse`` (a segment a client maps and writes: a save's): only the file is made, at once; the client faults
        its pages in on all its cores as it maps it (``memstore.v1.pagefaults.populate_writable``: a full tmpfs is an
        error there, not a SIGBUS), instead of the store faulting them in on one thread and the client mapping them
        again. Where the kernel cannot report a full tmpfs that way, or the tmpfs has not room for it now, it is made
        as usual."""
        if self.directory is None:
            return Segment(None, size, mmap.mmap(-1, size, flags=MAP_FLAGS))
        directory = self.directory
        if sparse and populate_supported() and _room_on(directory) >= size + SPARSE_MARGIN:
            seg = self._new_file(size, lambda fd: mmap.mmap(fd, size, flags=mmap.MAP_SHARED))
            seg.sparse = True
            return seg

        def full(why: str) -> CapacityExceeded:
            return CapacityExceeded(
                f"shared memory {directory} cannot hold {format_size(size)} more: {why}; enlarge the tmpfs (/dev/shm) or lower --capacity",
                needed=size,
                used=used,
                capacity=capacity,
            )

        def reserve_and_map(fd: int) -> mmap.mmap:
            if populate_supported():
                # Allocated, zeroed and mapped in one pass on several cores: a fallocate (one core, under the
                # file's lock) and then a populating map cost about twice as long. A full tmpfs fails the call.
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
                if populate_writable(address_of(mm), size):
                    return mm
                mm.close()
                raise full("its pages could not be faulted in")
            try:
                os.posix_fallocate(fd, 0, size)  # fail now, not with SIGBUS later, if tmpfs is full
            except OSError as exc:
                raise full(exc.strerror or str(exc)) from None
            return mmap.mmap(fd, size, flags=MAP_FLAGS)

        return self._new_file(size, reserve_and_map)

    def create_cancellable(self, size: int, cancel: threading.Event) -> Segment:
        """A fresh segment of ``size`` bytes faulted in step by step (``memstore.server.memory.pages.fault_in``), raising
        InterruptedError as soon as ``cancel`` is set: the reserve's, which gives way to an allocation."""
        if self.directory is None:
            return Segment(None, size, fault_in(-1, size, cancel))
        return self._new_file(size, lambda fd: fault_in(fd, size, cancel))

    def map_existing(self, path: str, size: int) -> Segment:
        """Map the first ``size`` bytes of the segment file at ``path`` (one a previous store left)."""
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, size, flags=MAP_FLAGS)
        finally:
            os.close(fd)
        return Segment(path, size, mm)

    def _new_file(self, size: int, map_fd: Callable[[int], mmap.mmap]) -> Segment:
        assert self.directory is not None
        path = self.directory / f"{SEGMENT_PREFIX}{os.getpid()}-{next(self._names)}-{secrets.token_hex(4)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = map_fd(fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        return Segment(str(path), size, mm)
