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
  (``memstore.server.shm_dirs``).
- The *reserve* (``--prefault``, ``memstore.core.reserve``): fresh segments faulted in by a background
  thread before any shard needs them, handed to whichever job saves or receives next.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from memstore.core.limits import over_limit
from memstore.core.reserve import ReserveGoal, ReservePolicy
from memstore.core.sizes import format_size
from memstore.core.status import Orphan
from memstore.errors import CapacityExceeded, ConfigError, QuotaExceeded, StaleLock
from memstore.server.pages import MAP_FLAGS, PAGE, fault_in, give_back
from memstore.server.rings import ring_limit, ring_members, ring_order
from memstore.server.segment import NO_RING, Segment
from memstore.server.shm_dirs import (
    CLAIM_WAIT_SECONDS,
    LOCK_NAME,
    SEGMENT_PREFIX,
    TMP_INFIX,
    delete_except,
    described_segments,
    orphaned_dirs,
    sidecar_path,
    try_lock,
)

log = logging.getLogger(__name__)

_REUSE_SLACK = 1.25  # reuse a pooled segment up to 25% larger than needed rather than allocating anew

FRESH = ""  # owner of a reserve segment: it never held any job's bytes, so any job may take it


_GROW_FRACTION = 8  # a fresh segment up to 1/8 short of a shard grows to fit it
_TRIM_FACTOR = 8  # ... and one up to 8x the shard is trimmed to it; a far smaller shard faults in fresh memory of its own
_CANCEL_WAIT_SECONDS = 5.0  # how long an allocation waits for the reserve to give back bytes it is faulting in


def _round_up(n: int) -> int:
    return max(PAGE, -(-n // PAGE) * PAGE)


class SegmentPool:
    """Allocates, recycles and accounts segments under a byte budget.

    Every segment handed out is tracked, in use or pooled, until it is destroyed: ``used_bytes`` is
    exactly the bytes of the segments this pool holds, and ``close`` removes all of them.
    """

    def __init__(
        self,
        directory: str | None,
        capacity: int,
        max_pooled_bytes: int | None = None,
        *,
        adopt_leftovers: bool = False,
        reserve: ReservePolicy | None = None,
        ring_limit: int = ring_limit(2),
    ) -> None:
        """Claim ``directory`` (None: anonymous memory). What a previous store of the directory left there
        is deleted now, or with ``adopt_leftovers`` kept for ``adopt()``, which must then come next (if it
        does not, the first ``acquire`` deletes the leftovers). ``reserve``: how much fresh memory to keep
        faulted in ahead of need (``memstore.core.reserve``), once ``start_reserve`` runs; None: none."""
        self.capacity = capacity
        self.max_pooled_bytes = capacity if max_pooled_bytes is None else max_pooled_bytes
        # close() with keep_files=None reads this: set by the server from --shm-keep-on-exit before it closes the engine.
        self.keep_files_on_close = False
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # the reserve gave back or added bytes
        self.reserve = reserve
        self.ring_limit = ring_limit  # segments a client fills its capture ring to (``ring_limit()``); it keeps twice that
        self._fresh_bytes = 0  # pooled bytes in FRESH segments (the reserve), part of _pooled_bytes
        self._warming = 0  # bytes the reserve is faulting in right now (not pooled yet; count against the capacity)
        self._room_wanted = 0  # allocations waiting for the reserve to give bytes back
        self._cancel_warming = threading.Event()
        self._shrinks: list[tuple[Segment, int]] = []  # reserve segments handed out larger than needed: trim to these sizes
        self._reserve_wake = threading.Event()
        self._reserve_thread: threading.Thread | None = None
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
                fd = try_lock(directory, create=True)
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
        candidates = described_segments(self.directory)
        if candidates is None:
            return []
        kept: list[tuple[Segment, bytes]] = []
        rejected = 0
        for _, path, size in candidates:
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
            mm = mmap.mmap(fd, size, flags=MAP_FLAGS)
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
        return delete_except(self.directory, keep)

    def close(self, keep_files: bool | None = None) -> None:
        """Unmap and unlink every segment (in use and pooled) with its sidecar, and remove the directory.

        With ``keep_files`` (None: ``self.keep_files_on_close``) the segments in use and their sidecars
        stay on the tmpfs, for a restart with the same directory to ``adopt``; pooled ones still go.
        """
        keep = self.keep_files_on_close if keep_files is None else keep_files
        with self._lock:
            self._closed = True
            self._cancel_warming.set()
            self._reserve_wake.set()
            free, self._free = self._free, []
            in_use, self._in_use = list(self._in_use), set()
            self._pooled_bytes = 0
            self._fresh_bytes = 0
            self._in_use_bytes = 0
            pending = self._leftovers_pending
            self._leftovers_pending = False
        if self._reserve_thread is not None and self._reserve_thread is not threading.current_thread():
            self._reserve_thread.join(timeout=_CANCEL_WAIT_SECONDS)
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

    def acquire(
        self,
        nbytes: int,
        owner: str,
        what: str = "shard",
        quota: int = 0,
        preferred: str = "",
        ring: int = NO_RING,
        grow: bool = False,
    ) -> Segment:
        """A segment of at least ``nbytes`` for job ``owner``: the pooled one at path ``preferred`` if it is free
        and would be handed to ``owner`` (see ``peek``), else the best pooled one, else a fresh one.

        Pooled segments are only handed back to the job that used them, so one job's leftover bytes are
        never mapped by another job's trainer; fresh ones of the reserve (which never held any job's bytes)
        go to any job. ``ring``: the rank of ``owner`` whose capture ring the segment serves (a client's save):
        a segment of that ring first, and the segment joins the ring; segments of a ring go to no other save
        (replicas and pulls pass NO_RING). With none of the ring's own free, the ring grows: a new or untagged
        segment joins it (its client fills it to ``ring_limit`` ahead of need, see ``trainer_client._ring``; beyond
        that it grows only when retention runs late, and keeps up to twice that many). ``grow``: a segment that
        joins the ring, never one of its own (the client filling it). Raises CapacityExceeded
        with the byte counts if it can't fit, QuotaExceeded if the job's segments in use would exceed ``quota``
        bytes (0 = no quota).
        """
        if self._leftovers_pending:
            self._settle_leftovers(None)  # nobody adopted them: a store that does not adopt starts clean
        size = _round_up(nbytes)
        victims: list[Segment] = []
        with self._lock:
            if self.reserve is not None:
                self.reserve.saw(nbytes)  # under the lock: goal() iterates what saw() appends to
                self._reserve_wake.set()
            used = self._owner_bytes(owner) if quota else 0
            max_size = quota - used if quota else None
            if grow:
                self._refuse_growth_without_headroom(size, owner, used, quota)
            seg = self._take_pooled(nbytes, owner, max_size=max_size, preferred=preferred, ring=ring, grow=grow)
            if seg is None and self._warming >= size - size // _GROW_FRACTION:
                # The reserve is faulting in a segment that fits: finishing it is faster than starting another.
                self._changed.wait_for(lambda: not self._warming or self._closed, timeout=_CANCEL_WAIT_SECONDS * 4)
                seg = self._take_pooled(nbytes, owner, max_size=max_size, preferred=preferred, ring=ring, grow=grow)
            if seg is not None:
                seg.ring = ring
                self._in_use.add(seg)
                self._in_use_bytes += seg.size
                return seg
            self._wait_for_warming(size)
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
            # Make room by dropping pooled segments (largest first) before giving up; a ring's warm-up (``grow``) never does.
            self._free.sort(key=lambda s: s.size)
            while self._free and not grow and self._in_use_bytes + self._pooled_bytes + self._warming + size > self.capacity:
                victim = self._free.pop()
                self._unpool(victim)
                victims.append(victim)
            if self._in_use_bytes + (self._pooled_bytes + self._warming if grow else 0) + size > self.capacity:
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
            seg.ring = ring
        except BaseException:
            with self._lock:
                self._in_use_bytes -= size
                self._done_creating(owner, size)
            raise
        with self._lock:
            self._in_use.add(seg)
            self._done_creating(owner, size)
        return seg

    def _unpool(self, seg: Segment) -> None:
        """Account ``seg``, just taken out of ``_free``, as no longer pooled (lock held)."""
        self._pooled_bytes -= seg.size
        if seg.owner == FRESH:
            self._fresh_bytes -= seg.size

    def _done_creating(self, owner: str, size: int) -> None:
        left = self._creating.pop(owner, 0) - size
        if left > 0:
            self._creating[owner] = left

    def peek(self, nbytes: int, owner: str, ring: int = NO_RING) -> Segment | None:
        """The pooled segment ``acquire(nbytes, owner, ring=ring)`` would hand out now, left in the pool (None: none would)."""
        with self._lock:
            return self._pick_pooled(nbytes, owner, ring=ring)

    def _refuse_growth_without_headroom(self, size: int, owner: str, used: int, quota: int) -> None:
        """A ring grows (``acquire(grow=True)``) only with room left for it and for a save beside it, so the segment it
        holds while its client maps it never makes a save drop a step or fail (lock held)."""
        total = self._in_use_bytes + self._pooled_bytes + self._warming
        if total + 2 * size > self.capacity or (quota and used + 2 * size > quota):
            limit, held = (quota, used) if quota and used + 2 * size > quota else (self.capacity, total)
            raise CapacityExceeded(
                f"no room to grow the capture ring of job {owner!r}: {format_size(held)} held of {format_size(limit)}, and a "
                f"{format_size(size)} segment plus a save beside it would not fit",
                needed=2 * size,
                used=held,
                capacity=limit,
            )

    def _ring_size(self, owner: str, ring: int) -> int:
        return len(ring_members(itertools.chain(self._in_use, self._free), owner, ring))

    def ring_paths(self, owner: str, ring: int) -> list[str]:
        """The paths of the segments of ``owner``'s rank ``ring``'s capture ring, in use and pooled."""
        with self._lock:
            return sorted(s.path for s in ring_members(itertools.chain(self._in_use, self._free), owner, ring) if s.path)

    def _pick_pooled(
        self, nbytes: int, owner: str, max_size: int | None = None, preferred: str = "", ring: int = NO_RING, grow: bool = False
    ) -> Segment | None:
        """The smallest pooled segment of ``owner`` that fits ``nbytes`` without wasting much (and is at most
        ``max_size``), else the smallest fresh one of the reserve that fits after resizing; ``preferred`` (a
        path) first when it is one of those candidates. A segment of ``ring`` (this rank's capture ring) comes
        before any other of ``owner``; segments of another ring are never candidates."""
        top = _REUSE_SLACK * nbytes + PAGE if max_size is None else min(_REUSE_SLACK * nbytes + PAGE, max_size)
        size = _round_up(nbytes)
        low = size - size // _GROW_FRACTION  # a fresh segment a little short of the shard grows to fit it
        own: Segment | None = None
        fresh: Segment | None = None
        allowed = (NO_RING,) if grow else (ring, NO_RING)  # a ring takes its own pooled segments first (ring_order)
        for seg in self._free:
            if seg.owner == owner and owner != FRESH and nbytes <= seg.size <= top and seg.ring in allowed:
                if preferred and seg.path == preferred:
                    return seg
                if own is None or ring_order(seg, ring) < ring_order(own, ring):
                    own = seg
            elif (
                seg.owner == FRESH
                and (low if seg.path else nbytes) <= seg.size <= _TRIM_FACTOR * size
                and (max_size is None or size <= max_size)
            ):
                # (an anonymous segment can't grow: shared anonymous memory has a fixed size)
                if preferred and seg.path == preferred:
                    return seg
                if fresh is None or seg.size < fresh.size:
                    fresh = seg
        return own or fresh

    def _take_pooled(
        self, nbytes: int, owner: str, max_size: int | None = None, preferred: str = "", ring: int = NO_RING, grow: bool = False
    ) -> Segment | None:
        """Take ``_pick_pooled``'s segment out of the pool; a fresh one is resized to fit."""
        best = self._pick_pooled(nbytes, owner, max_size, preferred, ring, grow)
        if best is None:
            return None
        if best.owner != FRESH:
            self._free.remove(best)
            self._pooled_bytes -= best.size
            return best
        size = _round_up(nbytes)
        if not self._fit(best, size):
            return None
        self._free.remove(best)
        self._pooled_bytes -= best.size
        self._fresh_bytes -= best.size
        best.owner = owner
        self._reserve_wake.set()
        return best

    def _fit(self, seg: Segment, size: int) -> bool:
        """Resize fresh ``seg`` to ``size`` bytes (the shard's bytes rounded up to pages, what a new segment would
        take, so accounting and quotas see the same bytes either way); False if it can't grow."""
        if seg.size == size:
            return True
        grow = size > seg.size
        if grow and not seg.path:
            return False
        if grow and self._in_use_bytes + self._pooled_bytes + self._warming + size - seg.size > self.capacity:
            return False
        if not grow:
            # Giving the pages past ``size`` back costs ~0.2 s per GiB: the reserve's thread does it, off the save's path.
            self._shrinks.append((seg, size))
            self._reserve_wake.set()
        try:
            if grow and seg.path:
                fd = os.open(seg.path, os.O_RDWR)
                try:
                    os.posix_fallocate(fd, 0, size)  # fail now, not with SIGBUS later, if tmpfs is full
                finally:
                    os.close(fd)
            if grow:
                seg.mm.resize(size)  # sets the file's size and remaps
        except (OSError, ValueError, TypeError) as exc:
            log.debug("cannot grow reserve segment %s to %d bytes: %s", seg.path, size, exc)
            return False
        if not grow:
            self._pooled_bytes -= seg.size - size
            self._fresh_bytes -= seg.size - size
        else:
            self._pooled_bytes += size - seg.size
            self._fresh_bytes += size - seg.size
        seg.size = size
        return True

    def _apply_shrinks(self) -> None:
        """Give back the pages past the size each shrunk reserve segment was handed out at (the map keeps its
        length; nothing reads past ``Segment.size``)."""
        with self._lock:
            shrinks, self._shrinks = self._shrinks, []
        for seg, size in shrinks:
            try:
                if seg.path:
                    os.truncate(seg.path, size)
                else:
                    give_back(seg.mm, size)
            except (OSError, ValueError) as exc:
                log.debug("cannot trim segment %s to %d bytes: %s", seg.path, size, exc)

    def _wait_for_warming(self, size: int) -> None:
        """With the lock held: if only bytes the reserve is faulting in stand between ``size`` more bytes and the
        capacity, have the reserve give them back (it stops within one step) and wait for that."""
        if not self._warming or self._in_use_bytes + size > self.capacity:
            return
        deadline = time.monotonic() + _CANCEL_WAIT_SECONDS
        self._room_wanted += 1  # the reserve starts nothing new meanwhile
        try:
            while self._warming and self._in_use_bytes + self._pooled_bytes + self._warming + size > self.capacity:
                self._cancel_warming.set()
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
        finally:
            self._room_wanted -= 1

    # -- the reserve -------------------------------------------------------------
    @property
    def reserve_bytes(self) -> int:
        """Fresh, pre-faulted bytes ready for the next shard (pooled), plus those being faulted in now."""
        return self._fresh_bytes + self._warming

    @property
    def reserve_filling(self) -> bool:
        """Whether the reserve is being faulted in toward its goal (it is short of it, and the capacity has room)."""
        if self.reserve is None or self._closed:
            return False
        with self._lock:
            if self._warming:
                return True
            goal = self.reserve.goal(held=self._in_use_bytes + self._pooled_bytes - self._fresh_bytes)
            room = self._in_use_bytes + self._pooled_bytes + _round_up(goal.segment_bytes) <= self.capacity
            return room and goal.wants_another(self._fresh_bytes)

    def start_reserve(self) -> None:
        """Start faulting in the reserve in the background (no-op without a reserve policy or when started)."""
        if self.reserve is None or self._reserve_thread is not None:
            return
        self._reserve_thread = threading.Thread(target=self._reserve_loop, name="prefault", daemon=True)
        self._reserve_wake.set()
        self._reserve_thread.start()

    def _reserve_loop(self) -> None:
        while not self._closed:
            self._reserve_wake.wait(timeout=5.0)
            self._reserve_wake.clear()
            self._apply_shrinks()
            while not self._closed and self._add_to_reserve():
                pass

    def _reserve_goal(self) -> ReserveGoal:
        assert self.reserve is not None
        with self._lock:
            return self.reserve.goal(held=self._in_use_bytes + self._pooled_bytes - self._fresh_bytes)

    def _drop_undersized(self, goal: ReserveGoal) -> None:
        """Fresh segments far too small for the shards seen now make way for ones that fit."""
        stale: list[Segment] = []
        low = goal.unit - goal.unit // _GROW_FRACTION
        with self._lock:
            for seg in sorted((s for s in self._free if s.owner == FRESH and s.size < low), key=lambda s: s.size):
                if goal.wants_another(self._fresh_bytes):
                    break
                self._free.remove(seg)
                self._unpool(seg)
                stale.append(seg)
        for seg in stale:
            seg.destroy()

    def _add_to_reserve(self) -> bool:
        """Fault in one more reserve segment if the goal wants one and the capacity has room; whether it did."""
        goal = self._reserve_goal()
        self._drop_undersized(goal)
        with self._lock:
            if self._closed or self._room_wanted or not goal.wants_another(self._fresh_bytes):
                return False
            size = _round_up(goal.segment_bytes)
            if self._in_use_bytes + self._pooled_bytes + self._warming + size > self.capacity:
                return False  # the reserve never pushes out shards, pooled segments or the capacity
            self._warming += size
            self._cancel_warming.clear()
        seg = None
        try:
            seg = self._create(size, cancel=self._cancel_warming)
        except Exception as exc:  # tmpfs full, or cancelled: try again at the next wake-up
            log.debug("reserve: no fresh %s segment: %s", format_size(size), exc)
        with self._lock:
            self._warming -= size
            added = seg is not None and not self._closed and self._in_use_bytes + self._pooled_bytes + size <= self.capacity
            if added:
                assert seg is not None
                seg.owner = FRESH
                self._free.append(seg)
                self._pooled_bytes += size
                self._fresh_bytes += size
            self._changed.notify_all()
        if seg is not None and not added:
            seg.destroy()
        return added

    def _create(self, size: int, cancel: threading.Event | None = None) -> Segment:
        """A fresh segment of ``size`` bytes, faulted in. With ``cancel`` (the reserve), faulted in steps,
        raising InterruptedError as soon as ``cancel`` is set."""
        if self.directory is None:
            if cancel is None:
                return Segment(None, size, mmap.mmap(-1, size, flags=MAP_FLAGS))
            return Segment(None, size, fault_in(-1, size, cancel))
        path = self.directory / f"{SEGMENT_PREFIX}{os.getpid()}-{next(self._names)}-{secrets.token_hex(4)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            if cancel is not None:
                return Segment(str(path), size, fault_in(fd, size, cancel))
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
            mm = mmap.mmap(fd, size, flags=MAP_FLAGS)
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
        tmp = f"{sidecar}{TMP_INFIX}{secrets.token_hex(4)}"
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
                if seg.ring != NO_RING and self._ring_size(seg.owner, seg.ring) >= 2 * self.ring_limit:  # (seg is out of it now)
                    seg.ring = NO_RING  # the ring is larger than it ever needs: this one serves the job's other saves and replicas
                self._free.append(seg)
                self._pooled_bytes += seg.size
                if seg.ring != NO_RING:
                    self._changed.notify_all()  # an ahead allocation may wait for its ring
                return
        seg.destroy()

    def trim(self, keep_bytes: int = 0) -> None:
        """Free pooled segments until at most ``keep_bytes`` stay pooled."""
        victims: list[Segment] = []
        with self._lock:
            self._free.sort(key=lambda s: s.size)
            while self._free and self._pooled_bytes > keep_bytes:
                v = self._free.pop()
                self._unpool(v)
                victims.append(v)
        for v in victims:
            v.destroy()
