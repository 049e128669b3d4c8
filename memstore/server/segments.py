"""RAM that holds shard bytes: shared-memory segments, pooled and pre-faulted.

Each shard lives in one segment, a file on a tmpfs (``--shm-dir``) mapped by the store. A trainer on the
same machine maps the same file and copies its state straight in, so ``save()`` costs one memcpy and no
network hop, and the bytes already belong to the store when the trainer returns. Segments are recycled:
the first touch of fresh pages costs ~10x a copy into pre-faulted ones, so freed segments go back to a
pool and the next save of the same size reuses them.

Every byte of every segment, in use or pooled, counts against the capacity. The pool tracks every
segment it handed out, so it can account them exactly and remove all of them when the store exits.

Files of one store live in ``<shm_dir>/<host_id>-<port>/`` (``segment_dir``), locked by ``.lock``
(``flock``) while the store runs:

- ``seg-<pid>-<n>-<hex>``: a segment (every ``seg-*`` file is one); ``meta-seg-...``: its sidecar, an
  opaque description written by the engine once the segment holds a verified shard (``describe``);
  ``meta-seg-....tmp-<hex>``: a sidecar being written (renamed into place: never half-written).
- A clean exit (``close``) unlinks everything and removes the directory, unless ``keep_files``: then
  the segments in use and their sidecars stay for the next start.
- A new pool deletes what a previous store of its directory left, unless constructed with
  ``adopt_leftovers=True``: then ``adopt(check)``, called right after, maps each leftover segment that
  has a sidecar, keeps those ``check`` accepts and deletes the rest (should ``adopt`` never come, the
  first ``acquire`` deletes them all: a store that does not adopt never serves stale segments).
- A directory whose ``.lock`` nobody holds belongs to no running store: an *orphan*
  (``orphaned_dirs``), removable with ``reclaim_orphans`` (``memstore reclaim-shm``).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import mmap
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from memstore.core.limits import over_limit
from memstore.core.sizes import format_size
from memstore.core.status import Orphan
from memstore.errors import CapacityExceeded, ConfigError, QuotaExceeded, StaleLock

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
_REUSE_SLACK = 1.25  # reuse a pooled segment up to 25% larger than needed rather than allocating anew

LOCK_NAME = ".lock"
SEGMENT_PREFIX = "seg-"
SIDECAR_PREFIX = "meta-"
_TMP_INFIX = ".tmp-"
CLAIM_WAIT_SECONDS = 2.0  # a lock held only briefly (an orphan probe, a reclaim) does not fail a starting store
_STORE_DIR_NAME = re.compile(r"[A-Za-z0-9._-]{1,80}")
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def _round_up(n: int) -> int:
    return max(PAGE, -(-n // PAGE) * PAGE)


def segment_dir(shm_dir: str, host_id: str, listen: str) -> str:
    """The segment directory of one store: ``<shm_dir>/<host_id>-<port>`` ('' when ``shm_dir`` is '').

    ``listen`` is the store's *bound* HOST:PORT: the port is unique among the stores running on a
    machine, so two clusters with the same host ids never share a directory, and a replacement
    started with the same ``--host-id`` and ``--listen`` finds the directory of the store it replaces.
    """
    if not shm_dir:
        return ""
    port = listen.rpartition(":")[2]
    if not port.isdigit():
        raise ValueError(f"listen address {listen!r} has no numeric port")
    return os.path.join(shm_dir, f"{host_id}-{int(port)}")


def sidecar_path(segment_path: str) -> str:
    """Where the sidecar of the segment at ``segment_path`` lives: ``meta-<segment name>`` next to it."""
    head, name = os.path.split(segment_path)
    return os.path.join(head, SIDECAR_PREFIX + name)


class Segment:
    """One mapped region. ``path`` is None for anonymous memory (no shm dir configured)."""

    __slots__ = ("_closed", "described", "exported", "mm", "owner", "path", "size")

    def __init__(self, path: str | None, size: int, mm: mmap.mmap) -> None:
        self.path = path
        self.owner = ""  # job whose bytes the segment last held; pooled segments are reused by that job only
        # A reader mapped it (copy-on-write): its bytes must never change, so it is unlinked, not recycled.
        self.exported = False
        self.described = False  # a sidecar exists next to it (SegmentPool.describe)
        self.size = size
        self.mm = mm
        self._closed = False

    def view(self, nbytes: int | None = None) -> memoryview:
        mv = memoryview(self.mm)
        return mv if nbytes is None else mv[:nbytes]

    def unmap(self) -> None:
        """Unmap, keeping the file (and sidecar) on the tmpfs."""
        if self._closed:
            return
        self._closed = True
        try:
            self.mm.close()
        except BufferError:
            # A memoryview still references the map (an in-flight reader); the pages go when it does.
            log.debug("segment %s still exported; unmapped when its last view is released", self.path)

    def destroy(self) -> None:
        """Unmap and unlink the file and its sidecar."""
        self.unmap()
        if self.path:
            for path in (self.path, sidecar_path(self.path)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            self.described = False


# -- directory locks -----------------------------------------------------------------
def _try_lock(directory: Path, create: bool) -> int | None:
    """flock ``directory/.lock`` exclusively: the fd, or None if another process holds it.

    Raises FileNotFoundError (no lock file and not ``create``), OSError, or StaleLock.
    """
    path = directory / LOCK_NAME
    fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    try:
        st, own = os.stat(path), os.fstat(fd)
        same = (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)
    except FileNotFoundError:
        same = False
    if not same:
        os.close(fd)
        raise StaleLock(str(path))
    return fd


def _is_segment_name(name: str) -> bool:
    return name.startswith(SEGMENT_PREFIX) and _TMP_INFIX not in name


def _is_ours(name: str) -> bool:
    """A name the pool creates in its directory."""
    return name == LOCK_NAME or name.startswith((SEGMENT_PREFIX, SIDECAR_PREFIX))


# -- orphans ---------------------------------------------------------------------------
def _store_dir_contents(directory: Path) -> list[os.DirEntry[str]] | None:
    """The entries of ``directory`` if it looks like a store's segment dir (else None: never touch it)."""
    if not _STORE_DIR_NAME.fullmatch(directory.name) or directory.is_symlink() or not directory.is_dir():
        return None
    try:
        with os.scandir(directory) as it:
            entries = list(it)
    except OSError:
        return None
    if not entries:
        return None
    for e in entries:
        if not _is_ours(e.name) or (e.name != LOCK_NAME and not e.is_file(follow_symlinks=False)):
            return None  # something that is not ours: leave the directory alone
    return entries


def _orphan_of(directory: Path, entries: list[os.DirEntry[str]]) -> Orphan:
    total = files = 0
    for e in entries:
        if e.name == LOCK_NAME:
            continue
        with contextlib.suppress(OSError):
            total += e.stat(follow_symlinks=False).st_size
            files += _is_segment_name(e.name)
    base, _, port = directory.name.rpartition("-")
    host_id = base if base and port.isdigit() else directory.name
    return Orphan(str(directory), host_id, total, files)


def _held(directory: Path) -> bool:
    """Whether a running store holds ``directory``'s lock (probed with a non-blocking flock, released at once)."""
    try:
        fd = _try_lock(directory, create=False)
    except FileNotFoundError:
        return False  # no lock file: no store ever claimed it (or one is creating it right now: it retries)
    except (StaleLock, OSError):
        return True  # cannot tell: treat as owned
    if fd is None:
        return True
    os.close(fd)
    return False


def orphaned_dirs(shm_dir: str) -> list[Orphan]:
    """Segment directories under ``shm_dir`` whose ``.lock`` no running store holds, sorted by path.

    Only directories that look like a store's (nothing but ``.lock``, ``seg-*`` and ``meta-*`` files) are
    considered, so pointing this at a shared directory never reports anybody else's files.
    """
    if not shm_dir:
        return []
    try:
        children = sorted(Path(shm_dir).iterdir())
    except OSError:
        return []
    out: list[Orphan] = []
    for child in children:
        entries = _store_dir_contents(child)
        if entries is not None and not _held(child):
            out.append(_orphan_of(child, entries))
    return out


def reclaim_orphans(shm_dir: str) -> list[Orphan]:
    """Delete the orphaned segment directories under ``shm_dir``; returns those deleted.

    Each one is deleted while holding its lock (so a store starting with that directory meanwhile waits
    for it and then starts in a fresh one); a directory a store claimed since it was listed is skipped.
    """
    reclaimed: list[Orphan] = []
    for orphan in orphaned_dirs(shm_dir):
        directory = Path(orphan.path)
        try:
            fd = _try_lock(directory, create=True)
        except (StaleLock, OSError):
            continue
        if fd is None:
            continue  # claimed since it was listed
        try:
            entries = _store_dir_contents(directory)
            if entries is None:
                continue
            final = _orphan_of(directory, entries)
            for e in entries:
                if e.name != LOCK_NAME:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(e.path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(directory / LOCK_NAME)
            with contextlib.suppress(OSError):
                directory.rmdir()
            log.info("reclaimed orphaned segment dir %s (%d segments, %s)", final.path, final.files, format_size(final.bytes))
            reclaimed.append(final)
        finally:
            os.close(fd)
    return reclaimed


class SegmentPool:
    """Allocates, recycles and accounts segments under a byte budget.

    Every segment handed out is tracked, in use or pooled, until it is destroyed: ``used_bytes`` is
    exactly the bytes of the segments this pool holds, and ``close`` removes all of them.
    """

    def __init__(self, directory: str | None, capacity: int, max_pooled_bytes: int | None = None, *, adopt_leftovers: bool = False) -> None:
        """Claim ``directory`` (None: anonymous memory). What a previous store of the directory left there
        is deleted now, or with ``adopt_leftovers`` kept for ``adopt()``, which must then come next (if it
        does not, the first ``acquire`` deletes the leftovers)."""
        self.capacity = capacity
        self.max_pooled_bytes = capacity if max_pooled_bytes is None else max_pooled_bytes
        # close() with keep_files=None reads this: set by the server from --shm-keep-on-exit before it closes the engine.
        self.keep_files_on_close = False
        self._lock = threading.Lock()
        self._free: list[Segment] = []
        self._in_use: set[Segment] = set()
        self._in_use_bytes = 0
        self._pooled_bytes = 0
        self._reserved_bytes = 0
        self._creating: dict[str, int] = {}  # owner -> bytes of segments being created (not in _in_use yet)
        self._names = itertools.count()
        self._lock_fd: int | None = None
        self._closed = False
        # Leftovers of a previous incarnation await adopt(); the first acquire() deletes them if it never came.
        self._leftovers_pending = False
        self._leftovers_lock = threading.Lock()
        self._adopt_leftovers = adopt_leftovers
        self.directory: Path | None = Path(directory) if directory else None
        if self.directory is not None:
            self._claim_directory(self.directory)
            if adopt_leftovers:
                self._leftovers_pending = True
            else:
                self._delete_untracked()

    # -- directory ownership -------------------------------------------------
    def _claim_directory(self, directory: Path) -> None:
        """Own ``directory`` exclusively (flock on ``.lock``), waiting briefly for a lock held by a probe or a reclaim."""
        deadline = time.monotonic() + CLAIM_WAIT_SECONDS
        while True:
            try:
                directory.mkdir(parents=True, exist_ok=True)
                fd = _try_lock(directory, create=True)
            except StaleLock:
                fd = None  # reclaimed under our feet: recreate it
            except OSError as exc:
                raise ConfigError(f"--shm-dir {directory} is not usable: {exc}") from None
            if fd is not None:
                self._lock_fd = fd
                return
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"--shm-dir {directory} is in use by another running store (same --host-id and --listen port?); give each store its own"
                )
            time.sleep(0.02)

    def _settle_leftovers(self, check: Callable[[Segment, bytes], bool] | None) -> list[tuple[Segment, bytes]]:
        """Adopt (``check`` given) or delete (None) what a previous incarnation left in the directory. Once."""
        assert self.directory is not None
        with self._leftovers_lock:
            if not self._leftovers_pending:
                if check is not None:
                    if not self._adopt_leftovers:
                        raise RuntimeError("SegmentPool.adopt() needs a pool constructed with adopt_leftovers=True")
                    raise RuntimeError("SegmentPool.adopt() must be called once, right after construction, before any acquire()")
                return []
            try:
                kept = self._adopt(check) if check is not None else []
                self._delete_untracked()
            finally:
                self._leftovers_pending = False
        return kept

    def adopt(self, check: Callable[[Segment, bytes], bool]) -> list[tuple[Segment, bytes]]:
        """Take over the segments a previous store of this directory left behind (it was SIGKILLed, or
        exited with ``keep_files``). Call once, right after constructing the pool with
        ``adopt_leftovers=True``, before any ``acquire``.

        Each leftover segment with a sidecar is mapped and passed with its sidecar bytes to ``check``;
        those it accepts (newest sidecars first, as many as fit in the capacity) are kept: in use and
        accounted, marked ``exported`` (a reader of the previous store may still map them, so they are
        never recycled). Everything else in the directory is deleted: segments without a sidecar,
        half-written sidecars, rejected or unreadable segments, ones that do not fit. ``check`` may
        raise: that rejects the segment. Returns the kept (segment, sidecar bytes), newest first.
        """
        if self.directory is None:
            return []
        return self._settle_leftovers(check)

    def _adopt(self, check: Callable[[Segment, bytes], bool]) -> list[tuple[Segment, bytes]]:
        assert self.directory is not None
        candidates: list[tuple[float, str, int]] = []
        try:
            with os.scandir(self.directory) as it:
                for e in it:
                    if not _is_segment_name(e.name) or not e.is_file(follow_symlinks=False):
                        continue
                    try:
                        size = e.stat(follow_symlinks=False).st_size
                        described_at = os.stat(sidecar_path(e.path)).st_mtime
                    except OSError:
                        continue  # no sidecar: never described (or being allocated when the store died)
                    candidates.append((described_at, e.path, size))
        except OSError as exc:
            log.warning("cannot list %s to adopt its segments: %s", self.directory, exc)
            return []
        kept: list[tuple[Segment, bytes]] = []
        rejected = 0
        for _, path, size in sorted(candidates, key=lambda c: (-c[0], c[1])):
            if size <= 0:
                rejected += 1
                continue
            with self._lock:
                fits = self._in_use_bytes + self._pooled_bytes + size <= self.capacity
            if not fits:
                log.warning("not adopting %s (%s): beyond the %s capacity", path, format_size(size), format_size(self.capacity))
                rejected += 1
                continue
            try:
                with open(sidecar_path(path), "rb") as fh:
                    meta = fh.read()
                seg = self._map_existing(path, size)
            except (OSError, ValueError) as exc:
                log.warning("not adopting %s: unreadable: %s", path, exc)
                rejected += 1
                continue
            try:
                ok = bool(check(seg, meta))
            except Exception as exc:
                log.warning("not adopting %s: %s", path, exc)
                ok = False
            if not ok:
                seg.destroy()
                rejected += 1
                continue
            seg.exported = True
            seg.described = True
            with self._lock:
                self._in_use.add(seg)
                self._in_use_bytes += seg.size
            kept.append((seg, meta))
        if candidates or rejected:
            log.info(
                "adopted %d leftover segments (%s) in %s; discarded %d",
                len(kept),
                format_size(sum(s.size for s, _ in kept)),
                self.directory,
                rejected,
            )
        return kept

    def _map_existing(self, path: str, size: int) -> Segment:
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, size, flags=_MAP_FLAGS)
        finally:
            os.close(fd)
        return Segment(path, size, mm)

    def _delete_untracked(self) -> int:
        """Delete every file of the directory this pool does not track (except the lock). Returns how many."""
        assert self.directory is not None
        with self._lock:
            keep = {LOCK_NAME}
            for seg in itertools.chain(self._in_use, self._free):
                if seg.path:
                    keep.add(os.path.basename(seg.path))
                    if seg.described:
                        keep.add(os.path.basename(sidecar_path(seg.path)))
        removed = 0
        try:
            children = list(self.directory.iterdir())
        except OSError:
            return 0
        for child in children:
            if child.name in keep:
                continue
            try:
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
                removed += 1
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("cannot delete %s: %s", child, exc)
        return removed

    def close(self, keep_files: bool | None = None) -> None:
        """Unmap and unlink every segment (in use and pooled) with its sidecar, and remove the directory.

        With ``keep_files`` (None: ``self.keep_files_on_close``) the segments in use and their sidecars
        stay on the tmpfs, for a restart with the same directory to ``adopt``; pooled ones still go.
        """
        keep = self.keep_files_on_close if keep_files is None else keep_files
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
            in_use, self._in_use = list(self._in_use), set()
            self._pooled_bytes = 0
            self._in_use_bytes = 0
            pending = self._leftovers_pending
            self._leftovers_pending = False
        for seg in free:
            seg.destroy()
        kept = [s for s in in_use if keep and s.path]
        for seg in in_use:
            if keep and seg.path:
                seg.unmap()
            else:
                seg.destroy()
        if self.directory is not None and self._lock_fd is not None:
            if kept or (keep and pending):
                log.info(
                    "keeping %d segments (%s) in %s for the next start of this store",
                    len(kept),
                    format_size(sum(s.size for s in kept)),
                    self.directory,
                )
            else:
                # Nothing to keep: remove the directory itself (a port-named directory would otherwise pile up).
                with contextlib.suppress(OSError):
                    shutil.rmtree(self.directory)
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

    @property
    def segment_count(self) -> int:
        """Segments this pool holds, in use and pooled."""
        with self._lock:
            return len(self._in_use) + len(self._free)

    @property
    def tracked_bytes(self) -> int:
        """Bytes of the segments this pool holds; equals ``used_bytes`` whenever no acquire is midway."""
        with self._lock:
            return sum(s.size for s in self._in_use) + sum(s.size for s in self._free)

    def orphans(self) -> list[Orphan]:
        """Orphaned sibling directories: segment dirs under this pool's parent (the ``--shm-dir``) that no running store owns."""
        if self.directory is None:
            return []
        return orphaned_dirs(str(self.directory.parent))

    # -- allocation ------------------------------------------------------------
    def owner_bytes(self, owner: str) -> int:
        """Bytes of the segments in use by job ``owner`` (its shards, replicas, writes in progress)."""
        with self._lock:
            return self._owner_bytes(owner)

    def _owner_bytes(self, owner: str) -> int:
        return sum(s.size for s in self._in_use if s.owner == owner) + self._creating.get(owner, 0)

    def acquire(self, nbytes: int, owner: str, what: str = "shard", quota: int = 0) -> Segment:
        """A segment of at least ``nbytes`` for job ``owner``.

        Pooled segments are only handed back to the job that used them, so one job's leftover bytes are
        never mapped by another job's trainer. Raises CapacityExceeded with the byte counts if it can't fit,
        QuotaExceeded if the job's segments in use would exceed ``quota`` bytes (0 = no quota).
        """
        if self._leftovers_pending:
            self._settle_leftovers(None)  # nobody adopted them: a store that does not adopt starts clean
        size = _round_up(nbytes)
        victims: list[Segment] = []
        with self._lock:
            used = self._owner_bytes(owner) if quota else 0
            seg = self._take_pooled(nbytes, owner, max_size=quota - used if quota else None)
            if seg is not None:
                self._in_use.add(seg)
                self._in_use_bytes += seg.size
                return seg
            if over_limit(used, size, quota):
                raise QuotaExceeded(
                    f"{what} needs {format_size(size)} ({size} bytes) but job {owner!r} holds {format_size(used)} ({used} bytes) "
                    f"of its {format_size(quota)} ({quota} bytes) quota on this store (--job-quota), and dropping its older steps "
                    "(never the newest restorable one) does not make room; raise --job-quota, lower --keep, or save less state per rank",
                    job_id=owner,
                    needed=size,
                    used=used,
                    quota=quota,
                )
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
            self._creating[owner] = self._creating.get(owner, 0) + size  # counts against the quota while being created
        for v in victims:
            v.destroy()
        try:
            seg = self._create(size)
            seg.owner = owner
        except BaseException:
            with self._lock:
                self._in_use_bytes -= size
                self._done_creating(owner, size)
            raise
        with self._lock:
            self._in_use.add(seg)
            self._done_creating(owner, size)
        return seg

    def _done_creating(self, owner: str, size: int) -> None:
        left = self._creating.pop(owner, 0) - size
        if left > 0:
            self._creating[owner] = left

    def _take_pooled(self, nbytes: int, owner: str, max_size: int | None = None) -> Segment | None:
        """The smallest pooled segment of ``owner`` that fits ``nbytes`` without wasting much (and is at most ``max_size``)."""
        best: Segment | None = None
        top = _REUSE_SLACK * nbytes + PAGE if max_size is None else min(_REUSE_SLACK * nbytes + PAGE, max_size)
        for seg in self._free:
            if seg.owner == owner and nbytes <= seg.size <= top and (best is None or seg.size < best.size):
                best = seg
        if best is not None:
            self._free.remove(best)
            self._pooled_bytes -= best.size
        return best

    def _create(self, size: int) -> Segment:
        if self.directory is None:
            return Segment(None, size, mmap.mmap(-1, size, flags=_MAP_FLAGS))
        path = self.directory / f"{SEGMENT_PREFIX}{os.getpid()}-{next(self._names)}-{secrets.token_hex(4)}"
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
            mm = mmap.mmap(fd, size, flags=_MAP_FLAGS)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        return Segment(str(path), size, mm)

    def describe(self, seg: Segment, meta: bytes) -> None:
        """Write ``meta`` (opaque to the pool) as ``seg``'s sidecar, atomically (tmp file + rename).

        A sidecar marks a segment worth adopting after a crash; the engine writes one once the segment
        holds a verified shard. Releasing or destroying the segment removes it. No-op for anonymous
        segments and for a segment not in use (already released: it must not look adoptable).
        Failures are logged, not raised: without a sidecar the shard is just not adopted.
        """
        if seg.path is None:
            return
        sidecar = sidecar_path(seg.path)
        tmp = f"{sidecar}{_TMP_INFIX}{secrets.token_hex(4)}"
        with self._lock:  # serialized with release(), which removes the sidecar
            if seg not in self._in_use:
                log.debug("not describing %s: it is no longer in use", seg.path)
                return
            try:
                with open(tmp, "wb") as fh:
                    fh.write(meta)
                os.replace(tmp, sidecar)
                seg.described = True
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                log.warning("cannot write the sidecar of %s (the shard will not be adopted after a crash): %s", seg.path, exc)

    def release(self, seg: Segment) -> None:
        """Return a segment to the pool (kept mapped and faulted for the next save) or free it.

        Its sidecar goes first: a pooled segment is never adoptable. Releasing a segment that is not
        in use (twice, or after ``close``) is logged and ignored.
        """
        with self._lock:
            if seg not in self._in_use:
                if not self._closed:
                    log.warning("release of segment %s that is not in use; ignored", seg.path)
                return
            self._in_use.remove(seg)
            self._in_use_bytes -= seg.size
            if seg.described and seg.path:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(sidecar_path(seg.path))
                seg.described = False
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
