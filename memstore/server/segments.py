"""RAM that holds shard bytes: shared-memory segments, pooled and pre-faulted.

Each shard lives in one segment, a file on a tmpfs (``--shm-dir``) mapped by the store. A trainer on the
same machine maps the same file and copies its state straight in, so ``save()`` costs one memcpy and no
network hop, and the bytes already belong to the store when the trainer returns. Segments are recycled:
the first touch of fresh pages costs ~10x a copy into pre-faulted ones, so freed segments go back to a
pool and the next save of the same size reuses them.

Every byte of every segment, in use or pooled, counts against the capacity.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import mmap
import os
import secrets
import shutil
import threading
from pathlib import Path

from memstore.core.sizes import format_size
from memstore.errors import CapacityExceeded, ConfigError

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
_REUSE_SLACK = 1.25  # reuse a pooled segment up to 25% larger than needed rather than allocating anew


def _round_up(n: int) -> int:
    return max(PAGE, -(-n // PAGE) * PAGE)


class Segment:
    """One mapped region. ``path`` is None for anonymous memory (no shm dir configured)."""

    __slots__ = ("_closed", "exported", "mm", "owner", "path", "size")

    def __init__(self, path: str | None, size: int, mm: mmap.mmap) -> None:
        self.path = path
        self.owner = ""  # job whose bytes the segment last held; pooled segments are reused by that job only
        # A reader mapped it (copy-on-write): its bytes must never change, so it is unlinked, not recycled.
        self.exported = False
        self.size = size
        self.mm = mm
        self._closed = False

    def view(self, nbytes: int | None = None) -> memoryview:
        mv = memoryview(self.mm)
        return mv if nbytes is None else mv[:nbytes]

    def destroy(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.mm.close()
        except BufferError:
            # A memoryview still references the map (an in-flight reader); the pages go when it does.
            log.debug("segment %s still exported; unmapped when its last view is released", self.path)
        if self.path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class SegmentPool:
    """Allocates, recycles and accounts segments under a byte budget."""

    def __init__(self, directory: str | None, capacity: int, max_pooled_bytes: int | None = None) -> None:
        self.capacity = capacity
        self.max_pooled_bytes = capacity if max_pooled_bytes is None else max_pooled_bytes
        self._lock = threading.Lock()
        self._free: list[Segment] = []
        self._in_use_bytes = 0
        self._pooled_bytes = 0
        self._reserved_bytes = 0
        self._names = itertools.count()
        self._lock_fd: int | None = None
        self.directory: Path | None = Path(directory) if directory else None
        if self.directory is not None:
            self._claim_directory(self.directory)

    # -- directory ownership -------------------------------------------------
    def _claim_directory(self, directory: Path) -> None:
        """Own ``directory`` exclusively and wipe segments left by a previous incarnation.

        A store restarted with the same host id is a *replacement*: it starts with empty RAM and
        pulls what it should hold from its peers, so stale segments are removed, not trusted.
        """
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ConfigError(f"--shm-dir {directory} is not usable: {exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(f"--shm-dir {directory} is in use by another running store; give each store its own") from None
        self._lock_fd = fd
        for child in directory.iterdir():
            if child.name == ".lock":
                continue
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    child.unlink()

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
            self._pooled_bytes = 0
        for seg in free:
            seg.destroy()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- accounting ------------------------------------------------------------
    @property
    def in_use_bytes(self) -> int:
        return self._in_use_bytes

    @property
    def pooled_bytes(self) -> int:
        return self._pooled_bytes

    @property
    def used_bytes(self) -> int:
        return self._in_use_bytes + self._pooled_bytes

    # -- allocation ------------------------------------------------------------
    def acquire(self, nbytes: int, owner: str, what: str = "shard") -> Segment:
        """A segment of at least ``nbytes`` for job ``owner``.

        Pooled segments are only handed back to the job that used them, so one job's leftover bytes are
        never mapped by another job's trainer. Raises CapacityExceeded with the byte counts if it can't fit.
        """
        size = _round_up(nbytes)
        victims: list[Segment] = []
        with self._lock:
            seg = self._take_pooled(nbytes, owner)
            if seg is not None:
                self._in_use_bytes += seg.size
                return seg
            # Make room by dropping pooled segments (largest first) before giving up.
            self._free.sort(key=lambda s: s.size)
            while self._free and self._in_use_bytes + self._pooled_bytes + size > self.capacity:
                victim = self._free.pop()
                self._pooled_bytes -= victim.size
                victims.append(victim)
            if self._in_use_bytes + size > self.capacity:
                for v in victims:
                    v.destroy()
                raise CapacityExceeded(
                    f"{what} needs {format_size(nbytes)} ({nbytes} bytes) but the store holds "
                    f"{format_size(self._in_use_bytes)} ({self._in_use_bytes} bytes) of its "
                    f"{format_size(self.capacity)} ({self.capacity} bytes) capacity; raise --capacity, lower --keep, "
                    "or save less state per rank",
                    needed=nbytes,
                    used=self._in_use_bytes,
                    capacity=self.capacity,
                )
            self._in_use_bytes += size
        for v in victims:
            v.destroy()
        try:
            seg = self._create(size)
            seg.owner = owner
            return seg
        except BaseException:
            with self._lock:
                self._in_use_bytes -= size
            raise

    def _take_pooled(self, nbytes: int, owner: str) -> Segment | None:
        best: Segment | None = None
        for seg in self._free:
            if seg.owner == owner and nbytes <= seg.size <= _REUSE_SLACK * nbytes + PAGE and (best is None or seg.size < best.size):
                best = seg
        if best is not None:
            self._free.remove(best)
            self._pooled_bytes -= best.size
        return best

    def _create(self, size: int) -> Segment:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        if self.directory is None:
            return Segment(None, size, mmap.mmap(-1, size, flags=flags))
        path = self.directory / f"seg-{os.getpid()}-{next(self._names)}-{secrets.token_hex(4)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            try:
                os.posix_fallocate(fd, 0, size)  # fail now, not with SIGBUS later, if tmpfs is full
            except OSError as exc:
                os.unlink(path)
                raise CapacityExceeded(
                    f"shared memory {self.directory} cannot hold {format_size(size)} more: {exc.strerror}; "
                    "enlarge the tmpfs (/dev/shm) or lower --capacity",
                    needed=size,
                    used=self._in_use_bytes,
                    capacity=self.capacity,
                ) from None
            mm = mmap.mmap(fd, size, flags=flags)
        finally:
            os.close(fd)
        return Segment(str(path), size, mm)

    def release(self, seg: Segment) -> None:
        """Return a segment to the pool (kept mapped and faulted for the next save) or free it."""
        with self._lock:
            self._in_use_bytes -= seg.size
            if not seg.exported and self._pooled_bytes + seg.size <= self.max_pooled_bytes:
                self._free.append(seg)
                self._pooled_bytes += seg.size
                return
        seg.destroy()

    def trim(self, keep_bytes: int = 0) -> None:
        """Free pooled segments until at most ``keep_bytes`` stay pooled."""
        victims: list[Segment] = []
        with self._lock:
            self._free.sort(key=lambda s: s.size)
            while self._free and self._pooled_bytes > keep_bytes:
                v = self._free.pop()
                self._pooled_bytes -= v.size
                victims.append(v)
        for v in victims:
            v.destroy()
