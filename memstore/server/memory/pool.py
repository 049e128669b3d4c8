"""RAM that holds shard bytes: shared-memory segments, pooled, accounted under a byte budget.

Each shard lives in one segment, a file on a tmpfs (``--shm-dir``) mapped by the store. A trainer on the
same machine maps the same file and copies its state straight in, so ``save()`` costs one memcpy and no
network hop, and the bytes already belong to the store when the trainer returns. Segments are recycled:
the first touch of fresh pages costs ~10x a copy into pre-faulted ones, so freed segments go back to a
pool and the next save of the same size reuses them.

Every byte of every segment, in use or pooled, counts against the capacity. The pool tracks every
segment it handed out, so it can account them exactly and remove all of them when the store exits.

The pool has three collaborators, each in its own module, all sharing its lock where they touch its counts:

- ``memstore.server.memory.segment.SegmentMaker`` makes segments (files ``seg-<pid>-<n>-<hex>``, or anonymous memory);
- ``memstore.server.memory.reserve.Reserve`` (``--prefault``, policy in ``memstore.core.reserve_policy``): fresh segments
  faulted in by a background thread before any shard needs them, handed to whichever job saves or receives next;
- ``memstore.server.memory.leftovers.Leftovers``: what a previous store of the directory left, adopted or deleted.

Files of one store live in ``<shm_dir>/<host_id>-<port>/`` (``segment_dir``), locked by ``.lock``
(``flock``, ``memstore.server.memory.shm_dirs.claim``) while the store runs:

- ``seg-...``: a segment; ``meta-seg-...``: its sidecar, an opaque description written by the engine once the
  segment holds a verified shard (``describe``); ``meta-seg-....tmp-<hex>``: a sidecar being written.
- A clean exit (``close``) unlinks everything and removes the directory, unless ``keep_files``: then
  the segments in use and their sidecars stay for the next start.
- A new pool deletes what a previous store of its directory left, unless constructed with
  ``adopt_leftovers=True``: then ``adopt(check)``, called right after, keeps the described leftovers ``check``
  accepts and deletes the rest (should ``adopt`` never come, the first ``acquire`` deletes them all: a store
  that does not adopt never serves stale segments).
- A directory whose ``.lock`` nobody holds belongs to no running store: an *orphan*
  (``memstore.server.memory.shm_dirs``).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from memstore.core.limits import over_limit
from memstore.core.reserve_policy import ReservePolicy
from memstore.core.sizes import format_size
from memstore.core.status import Orphan
from memstore.errors import CapacityExceeded, QuotaExceeded, RingBusy
from memstore.server.memory.leftovers import Check, Leftovers, adopt_dead_dir, write_sidecar
from memstore.server.memory.pages import PAGE, round_up
from memstore.server.memory.reserve import CANCEL_WAIT_SECONDS, FRESH, Reserve
from memstore.server.memory.rings import RING_SLACK, ring_limit, ring_members, ring_order
from memstore.server.memory.segment import NO_RING, Segment, SegmentMaker
from memstore.server.memory.shm_dirs import claim, orphaned_dirs, sidecar_path

log = logging.getLogger(__name__)

_REUSE_SLACK = 1.25  # reuse a pooled segment up to 25% larger than needed rather than allocating anew


def _reusable(size: int, nbytes: int) -> bool:
    """Whether a pooled segment of ``size`` bytes is handed out for ``nbytes``: it fits without wasting much."""
    return nbytes <= size <= _REUSE_SLACK * nbytes + PAGE


def _allocated(seg: Segment) -> bool:
    """Whether every page of ``seg``'s file is allocated (its blocks cover its size)."""
    try:
        return seg.path is not None and os.stat(seg.path).st_blocks * 512 >= seg.size
    except OSError:
        return False


class SegmentPool:
    """Allocates, recycles and accounts segments under a byte budget.

    Every segment handed out is tracked, in use or pooled (the jobs' pools and the reserve), until it is
    destroyed: ``used_bytes`` is exactly the bytes of the segments this pool holds, and ``close`` removes all
    of them.
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
        pool_past_limit: bool = True,
    ) -> None:
        """Claim ``directory`` (None: anonymous memory). What a previous store of the directory left there
        is deleted now, or with ``adopt_leftovers`` kept for ``adopt()``, which must then come next (if it
        does not, the first ``acquire`` deletes the leftovers). ``reserve``: how much fresh memory to keep
        faulted in ahead of need (``memstore.core.reserve_policy``), once ``start_reserve`` runs; None: none.
        ``pool_past_limit``: a segment released while its ring is over its limit (saves outran retention) leaves the ring
        and stays pooled for the job's other saves; False (rings without a spare, under ec:K+M): it goes back to the
        kernel (a settled shard's pages freed at once, although its client still maps it: ``release``), so the ring's
        memory returns to its limit once its saves settle."""
        self.capacity = capacity
        self.max_pooled_bytes = capacity if max_pooled_bytes is None else max_pooled_bytes
        # close() with keep_files=None reads this: set by the server from --shm-keep-on-exit before it closes the engine.
        self.keep_files_on_close = False
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # the reserve gave back or added bytes
        self.ring_limit = ring_limit  # segments a client fills its capture ring to (``ring_limit()``); at most RING_SLACK more
        self.pool_past_limit = pool_past_limit  # a segment leaving an over-limit ring stays pooled (else it is freed)
        self.ring_overflows = 0  # saves that found their ring full with nothing to reuse, and grew it past its bound
        self._saving: collections.Counter[tuple[str, int]] = collections.Counter()  # rings a save is allocating in
        self._free: list[Segment] = []  # the jobs' pooled segments (the reserve holds its fresh ones)
        self._in_use: set[Segment] = set()
        self._in_use_bytes = 0
        self._pooled_bytes = 0  # bytes of _free
        self._creating: dict[str, int] = {}  # owner -> bytes of segments being created (not in _in_use yet)
        # (owner, ring) -> segments being created for that capture ring: they count as its members (``_ring_size``), so a
        # reservation ahead arriving while the ring's fill makes one waits for it instead of making another
        self._creating_rings: collections.Counter[tuple[str, int]] = collections.Counter()
        self._lock_fd: int | None = None
        self._closed = False
        self.directory: Path | None = Path(directory) if directory else None
        if self.directory is not None:
            self._lock_fd = claim(self.directory)
        self.maker = SegmentMaker(self.directory)
        self.reserve = Reserve(reserve, self.maker, self._changed, self)
        # Leftovers of a previous incarnation await adopt(); the first acquire() deletes them if it never came.
        self.leftovers: Leftovers | None = None
        if self.directory is not None:
            self.leftovers = Leftovers(self.directory, self.maker, adopting=adopt_leftovers)
            if not adopt_leftovers:
                self.leftovers.settle(None, self)

    # -- adoption (memstore.server.memory.leftovers) -------------------------------------------------
    def adopt(self, check: Check) -> list[tuple[Segment, bytes]]:
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
        if self.leftovers is None:
            return []
        return self.leftovers.settle(check, self)

    def adopt_from(self, directory: Path, check: Check) -> list[tuple[Segment, bytes]] | None:
        """Take over the described segments ``check`` accepts from ``directory``, the segment directory of a dead
        predecessor (another host id) on this tmpfs: they move into this pool's directory, in use and accounted
        like ``adopt``'s, and ``directory`` goes with the rest (``leftovers.adopt_dead_dir``). None (nothing
        touched) if a running store holds its lock; [] for a pool without a directory or closed."""
        if self.directory is None or self._closed:
            return []
        return adopt_dead_dir(directory, self.maker, check, self)

    def room_left(self) -> int:
        """Bytes the capacity has left beside every segment this pool holds (``Leftovers`` asks)."""
        with self._lock:
            return self.capacity - self._in_use_bytes - self._pooled_bytes - self.reserve.fresh_bytes

    def hold(self, seg: Segment) -> None:
        """Account ``seg``, mapped elsewhere (an adopted leftover), as in use: released like any other."""
        with self._lock:
            self._in_use.add(seg)
            self._in_use_bytes += seg.size

    def held_names(self) -> set[str]:
        """The file names of the segments this pool holds, in use and pooled, and of their sidecars."""
        names: set[str] = set()
        with self._lock:
            for seg in self._segments():
                if seg.path:
                    names.add(os.path.basename(seg.path))
                    if seg.described:
                        names.add(os.path.basename(sidecar_path(seg.path)))
        return names

    def close(self, keep_files: bool | None = None) -> None:
        """Unmap and unlink every segment (in use and pooled) with its sidecar, and remove the directory.

        With ``keep_files`` (None: ``self.keep_files_on_close``) the segments in use and their sidecars
        stay on the tmpfs, for a restart with the same directory to ``adopt``; pooled ones still go.
        """
        keep = self.keep_files_on_close if keep_files is None else keep_files
        with self._lock:
            self._closed = True
            fresh = self.reserve.stop()
            free, self._free = self._free, []
            in_use, self._in_use = list(self._in_use), set()
            self._pooled_bytes = 0
            self._in_use_bytes = 0
            pending = self.leftovers.abandon() if self.leftovers is not None else False
        self.reserve.join(CANCEL_WAIT_SECONDS)
        for seg in itertools.chain(free, fresh):
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
        """Bytes of the free segments kept faulted in: the jobs' pools and the reserve's fresh ones."""
        return self._pooled_bytes + self.reserve.fresh_bytes

    @property
    def used_bytes(self) -> int:
        return self._in_use_bytes + self.pooled_bytes

    @property
    def segment_count(self) -> int:
        """Segments this pool holds, in use and pooled."""
        with self._lock:
            return sum(1 for _ in self._segments())

    @property
    def tracked_bytes(self) -> int:
        """Bytes of the segments this pool holds; equals ``used_bytes`` whenever no acquire is midway."""
        with self._lock:
            return sum(s.size for s in self._segments())

    def held_by_jobs(self) -> int:
        """Bytes of the segments in use and in the jobs' pools: all but the reserve's (lock held; the reserve asks)."""
        return self._in_use_bytes + self._pooled_bytes

    def _held(self) -> int:
        """Every byte counted against the capacity: segments in use and pooled, and those the reserve is faulting in."""
        return self._in_use_bytes + self._pooled_bytes + self.reserve.held_bytes

    def _segments(self) -> itertools.chain[Segment]:
        return itertools.chain(self._in_use, self._free, self.reserve.segments())

    def orphans(self) -> list[Orphan]:
        """Orphaned sibling directories: segment dirs under this pool's parent (the ``--shm-dir``) that no running store owns."""
        if self.directory is None:
            return []
        return orphaned_dirs(str(self.directory.parent))

    # -- the reserve (memstore.server.memory.reserve) ------------------------------------------------
    @property
    def reserve_bytes(self) -> int:
        """Fresh, pre-faulted bytes ready for the next shard (pooled), plus those being faulted in now."""
        return self.reserve.held_bytes

    @property
    def reserve_filling(self) -> bool:
        """Whether the reserve is being faulted in toward its goal (it is short of it, and the capacity has room)."""
        return self.reserve.filling

    def expect(self, sizes: list[int]) -> None:
        """Shards about to be pulled here, before the store serves (``ReservePolicy.expect``); no-op without a reserve."""
        with self._lock:
            if self.reserve.policy is not None:
                self.reserve.policy.expect(sizes)

    def announce(self, nbytes: int, stream: tuple[str, int]) -> None:
        """Replicas of ``stream`` (job, rank), ``nbytes`` each, will land here (a peer's ``Expect``): the reserve
        learns the stream before its first shard arrives (``ReservePolicy.announce``)."""
        with self._lock:
            self.reserve.announce(nbytes, stream)

    def prefault_now(self) -> int:
        """Fault in the part of the reserve wanted before the store serves (``Reserve.fill_now``); the bytes ready."""
        return self.reserve.fill_now()

    def start_reserve(self, busy: Callable[[], bool] | None = None) -> None:
        """Start faulting in the reserve in the background (no-op without a reserve policy or when started); ``busy``:
        whether the store moves bytes in the foreground, which the reserve's thread yields to (``Reserve.start``)."""
        self.reserve.start(busy)

    # -- allocation ------------------------------------------------------------
    def owner_bytes(self, owner: str) -> int:
        """Bytes of the segments in use by job ``owner`` (its shards, replicas, writes in progress)."""
        with self._lock:
            return self._owner_bytes(owner)

    def _owner_bytes(self, owner: str) -> int:
        return sum(s.size for s in self._in_use if s.owner == owner) + self._creating.get(owner, 0)

    def job_bytes(self, job: str) -> int:
        """Bytes of the segments job ``job`` holds outside its capture rings (which its clients fill themselves): in
        use (replicas, pulls) and pooled (lock held; the reserve asks)."""
        held = itertools.chain(self._in_use, self._free)
        return sum(s.size for s in held if s.owner == job and s.ring == NO_RING) + self._creating.get(job, 0)

    def jobs_memory(self) -> dict[str, tuple[int, int]]:
        """Per job, the bytes of its segments (in use, pooled): what its shards, leases and spares hold here."""
        out: dict[str, tuple[int, int]] = {}
        with self._lock:
            for seg in self._in_use:
                used, pooled = out.get(seg.owner, (0, 0))
                out[seg.owner] = (used + seg.size, pooled)
            for seg in self._free:
                used, pooled = out.get(seg.owner, (0, 0))
                out[seg.owner] = (used, pooled + seg.size)
        return out

    def drop_pooled(self, jobs: set[str]) -> None:
        """Give back to the kernel the pooled segments of ``jobs`` outside every capture ring (a ring's client maps its
        segments: they stay); the reserve calls it for jobs that stopped saving."""
        with self._lock:
            victims = [seg for seg in self._free if seg.owner in jobs and seg.ring == NO_RING]
            for seg in victims:
                self._free.remove(seg)
                self._pooled_bytes -= seg.size
        for seg in victims:
            log.info("job %s stopped saving here: its pooled %s segment goes back to the kernel", seg.owner, format_size(seg.size))
            seg.destroy()

    @contextlib.contextmanager
    def saving_into(self, owner: str, ring: int) -> Iterator[None]:
        """While a save allocates in ``owner``'s ring ``ring``: a reservation ahead waiting for that ring lets it go
        first (a segment retention frees meanwhile is the save's, so the save does not grow the ring)."""
        with self._lock:
            self._saving[(owner, ring)] += 1
        try:
            yield
        finally:
            with self._lock:
                self._saving[(owner, ring)] -= 1
                if not self._saving[(owner, ring)]:
                    del self._saving[(owner, ring)]
                self._changed.notify_all()

    def ring_full(self, owner: str, ring: int) -> int:
        """How many segments rank ``ring`` of job ``owner`` has in its capture ring when it holds at least ``ring_limit``
        and none of them is free (a save would grow it); 0 otherwise."""
        with self._lock:
            if any(s.owner == owner and s.ring == ring for s in self._free):
                return 0
            size = self._ring_size(owner, ring)
            return size if size >= self.ring_limit else 0

    def count_growth(self, owner: str, ring: int, size: int) -> None:
        """A save of ``owner``'s rank ``ring`` grows its full ring of ``size`` segments: nothing could be reused. Beyond
        ``RING_SLACK`` extra segments it is counted as an overflow (``memstore status``) and logged."""
        if size < self.ring_limit + RING_SLACK:
            return
        with self._lock:
            self.ring_overflows += 1
        log.warning(
            "the capture ring of job %s rank %d holds %d segments, all in use, and nothing retention may let go: it grows "
            "(saves outrun replication and retention; a slower cadence or waiting for each save avoids it)",
            owner, ring, size,
        )  # fmt: skip

    def acquire(
        self,
        nbytes: int,
        owner: str,
        what: str = "shard",
        quota: int = 0,
        preferred: str = "",
        ring: int = NO_RING,
        grow: bool = False,
        stream: tuple[str, int] | None = None,
        wait: float = 0.0,
        sparse: bool = False,
    ) -> Segment:
        """A segment of at least ``nbytes`` for job ``owner``: the pooled one at path ``preferred`` if it is free
        and would be handed to ``owner`` (see ``peek``), else the best pooled one, else a fresh one.

        Pooled segments are only handed back to the job that used them, so one job's leftover bytes are
        never mapped by another job's trainer; fresh ones of the reserve (which never held any job's bytes)
        go to any job. ``ring``: the rank of ``owner`` whose capture ring the segment serves (a client's save):
        a segment of that ring first, and the segment joins the ring; segments of a ring go to no other save
        (replicas and pulls pass NO_RING). With none of the ring's own free, the ring grows: a new or untagged
        segment joins it (its client fills it to ``ring_limit`` ahead of need, see ``trainer_client.capture.ring``; beyond
        that it grows only when retention runs late, and keeps up to twice that many). ``grow``: a segment that
        joins the ring, never one of its own (the client filling it). ``stream``: the (job, rank) the shard belongs to
        (the automatic reserve sizes itself by streams). ``wait`` (seconds; a reservation ahead of a save): when the
        ring already holds ``ring_limit`` segments and none is free, wait that long for retention to give one back
        instead of growing the ring (``RingBusy`` if none comes). ``sparse``: a segment made for it is made without its
        pages, which its client faults in (``SegmentMaker.create``). Raises CapacityExceeded
        with the byte counts if it can't fit, QuotaExceeded if the job's segments in use would exceed ``quota``
        bytes (0 = no quota).
        """
        if self.leftovers is not None and self.leftovers.pending:
            self.leftovers.settle(None, self)  # nobody adopted them: a store that does not adopt starts clean
        size = round_up(nbytes)
        victims: list[Segment] = []
        with self._lock:
            # A capture ring is filled by its client (prepare, or its ring's thread): the reserve covers the rest.
            self._learn_and_wait(nbytes, owner, ring, stream if ring == NO_RING else None, wait if not grow else 0.0)
            used = self._owner_bytes(owner) if quota else 0
            max_size = quota - used if quota else None
            if grow:
                self._refuse_growth_past_the_limit(owner, ring)
                self._refuse_growth_without_headroom(size, owner, used, quota)
            seg = self._take_pooled(nbytes, owner, max_size=max_size, preferred=preferred, ring=ring, grow=grow)
            if seg is None and self.reserve.await_fitting(size):
                # The reserve was faulting in a segment that fits: finishing it is faster than starting another.
                seg = self._take_pooled(nbytes, owner, max_size=max_size, preferred=preferred, ring=ring, grow=grow)
            if seg is not None:
                seg.ring = ring
                self._in_use.add(seg)
                self._in_use_bytes += seg.size
                return seg
            if self.reserve.warming and self._in_use_bytes + size <= self.capacity:
                self.reserve.give_way(size)  # only bytes being faulted in stand in the way: have them given back
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
            if not grow:
                victims = self._unpool_largest(lambda: self._held() + size > self.capacity)
            if (self._held() if grow else self._in_use_bytes) + size > self.capacity:
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
            self._start_creating(size, owner, ring)
        for v in victims:
            v.destroy()
        try:
            seg = self.maker.create(size, used=self._in_use_bytes, capacity=self.capacity, sparse=sparse)
            seg.owner = owner
            seg.ring = ring
            seg.fresh = True  # not from the reserve nor a pool: a writer into it may fault its pages in ahead
        except BaseException:
            with self._lock:
                self._in_use_bytes -= size
                self._done_creating(owner, size, ring)
            raise
        with self._lock:
            self._in_use.add(seg)
            self._done_creating(owner, size, ring)
        return seg

    def _learn_and_wait(self, nbytes: int, owner: str, ring: int, stream: tuple[str, int] | None, wait: float) -> None:
        """The reserve learns the shard; a reservation ahead (``wait``) waits for its ring (lock held)."""
        self.reserve.saw(nbytes, stream)
        if wait > 0 and ring != NO_RING:
            self._await_ring(owner, ring, wait)

    def _await_ring(self, owner: str, ring: int, wait: float) -> None:
        """Wait up to ``wait`` seconds while ``owner``'s ring ``ring`` holds ``ring_limit`` segments, none of them free
        (lock held): retention frees the oldest once the newest save settles. Raises ``RingBusy`` if it does not."""

        def free_or_small() -> bool:
            if (owner, ring) in self._saving:
                return False
            if any(s.owner == owner and s.ring == ring for s in self._free):
                return True
            return self._ring_size(owner, ring) < self.ring_limit or self._closed

        if not self._changed.wait_for(free_or_small, timeout=wait):
            raise RingBusy(
                f"the capture ring of job {owner!r} rank {ring} holds {self._ring_size(owner, ring)} segments, all in use, "
                f"and retention freed none within {wait:g} s: the next save allocates when it comes"
            )

    def _unpool_largest(self, more: Callable[[], bool]) -> list[Segment]:
        """Take pooled segments (the jobs' and the reserve's), largest first, out of the pool while ``more()``;
        the caller destroys them (lock held)."""
        self._free.sort(key=lambda s: s.size)
        fresh = self.reserve.segments()
        pooled = sorted(itertools.chain(self._free, fresh), key=lambda s: s.size)
        fresh_set = set(fresh)
        out: list[Segment] = []
        while pooled and more():
            seg = pooled.pop()
            if seg in fresh_set:
                self.reserve.remove(seg)
            else:
                self._free.remove(seg)
                self._pooled_bytes -= seg.size
            out.append(seg)
        return out

    def _start_creating(self, size: int, owner: str, ring: int) -> None:
        """A segment of ``size`` bytes is being made for ``owner`` (its ``ring``): it counts against the capacity, the
        job's quota and the ring's limit meanwhile (lock held)."""
        self._in_use_bytes += size
        self._creating[owner] = self._creating.get(owner, 0) + size
        if ring != NO_RING:
            self._creating_rings[(owner, ring)] += 1

    def _done_creating(self, owner: str, size: int, ring: int) -> None:
        left = self._creating.pop(owner, 0) - size
        if left > 0:
            self._creating[owner] = left
        if ring != NO_RING:
            self._creating_rings[(owner, ring)] -= 1
            if self._creating_rings[(owner, ring)] <= 0:
                del self._creating_rings[(owner, ring)]
            self._changed.notify_all()  # a reservation ahead waiting for its ring sees it smaller if this one failed

    def peek(self, nbytes: int, owner: str, ring: int = NO_RING) -> Segment | None:
        """The pooled segment ``acquire(nbytes, owner, ring=ring)`` would hand out now, left in the pool (None: none would)."""
        with self._lock:
            return self._pick_pooled(nbytes, owner, ring=ring)

    def _refuse_growth_past_the_limit(self, owner: str, ring: int) -> None:
        """A client fills its ring (``grow``) only up to ``ring_limit``: its reservation ahead may have filled it first
        (lock held)."""
        if self._ring_size(owner, ring) >= self.ring_limit:
            raise RingBusy(f"the capture ring of job {owner!r} rank {ring} already holds its {self.ring_limit} segments")

    def _refuse_growth_without_headroom(self, size: int, owner: str, used: int, quota: int) -> None:
        """A ring grows (``acquire(grow=True)``) only with room left for it and for a save beside it, so the segment it
        holds while its client maps it never makes a save drop a step or fail (lock held)."""
        total = self._held()
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
        """Segments of the ring that will serve its saves again, those being created for it included: an exported one
        (a reader mapped it) is freed, not recycled, once its step goes, so it no longer counts against the ring's limit
        (lock held)."""
        held = sum(1 for s in ring_members(itertools.chain(self._in_use, self._free), owner, ring) if not s.exported)
        return held + self._creating_rings.get((owner, ring), 0)

    def recyclable(self, seg: Segment, nbytes: int) -> bool:
        """Whether ``seg``, in use now, would be pooled once released and then handed out for a shard of ``nbytes`` of its
        ring (``memstore.server.engine.recycling``): not exported, not sparse, room in the pool, and its size fits."""
        with self._lock:
            room = self.pooled_bytes + seg.size <= self.max_pooled_bytes
            return room and not seg.exported and not seg.sparse and _reusable(seg.size, nbytes)

    def ring_paths(self, owner: str, ring: int) -> list[str]:
        """The paths of the segments of ``owner``'s rank ``ring``'s capture ring, in use and pooled."""
        with self._lock:
            return sorted(s.path for s in ring_members(itertools.chain(self._in_use, self._free), owner, ring) if s.path)

    def _pick_pooled(
        self, nbytes: int, owner: str, max_size: int | None = None, preferred: str = "", ring: int = NO_RING, grow: bool = False
    ) -> Segment | None:
        """The smallest pooled segment of ``owner`` that fits ``nbytes`` without wasting much (and is at most
        ``max_size``), else the smallest fresh one of the reserve that fits after resizing (``Reserve.pick``);
        ``preferred`` (a path) first when it is one of those candidates. A segment of ``ring`` (this rank's
        capture ring) comes before any other of ``owner``; segments of another ring are never candidates."""
        own: Segment | None = None
        allowed = (NO_RING,) if grow else (ring, NO_RING)  # a ring takes its own pooled segments first (ring_order)
        for seg in self._free:
            fits = _reusable(seg.size, nbytes) and (max_size is None or seg.size <= max_size)
            if seg.owner == owner and owner != FRESH and fits and seg.ring in allowed:
                if preferred and seg.path == preferred:
                    return seg
                if own is None or ring_order(seg, ring) < ring_order(own, ring):
                    own = seg
        fresh = self.reserve.pick(nbytes, max_size, preferred)
        if fresh is not None and preferred and fresh.path == preferred:
            return fresh
        return own or fresh

    def _take_pooled(
        self, nbytes: int, owner: str, max_size: int | None = None, preferred: str = "", ring: int = NO_RING, grow: bool = False
    ) -> Segment | None:
        """Take ``_pick_pooled``'s segment out of the pool; a fresh one is resized to fit (``Reserve.take``)."""
        best = self._pick_pooled(nbytes, owner, max_size, preferred, ring, grow)
        if best is None:
            return None
        if best.owner != FRESH:
            self._free.remove(best)
            self._pooled_bytes -= best.size
            return best
        return best if self.reserve.take(best, nbytes, owner) else None

    def describe(self, seg: Segment, meta: bytes) -> None:
        """Write ``meta`` (opaque to the pool) as ``seg``'s sidecar, atomically (``leftovers.write_sidecar``).

        A sidecar marks a segment worth adopting after a crash; the engine writes one once the segment
        holds a verified shard. Releasing or destroying the segment removes it. No-op for anonymous
        segments and for a segment not in use (already released: it must not look adoptable).
        Failures are logged, not raised: without a sidecar the shard is just not adopted.
        """
        if seg.path is None:
            return
        with self._lock:  # serialized with release(), which removes the sidecar
            if seg not in self._in_use:
                log.debug("not describing %s: it is no longer in use", seg.path)
                return
            try:
                write_sidecar(seg.path, meta)
                seg.described = True
            except OSError as exc:
                log.warning("cannot write the sidecar of %s (the shard will not be adopted after a crash): %s", seg.path, exc)

    def release(self, seg: Segment, reuse: bool = True, written: bool = False) -> None:
        """Return a segment to the pool (kept mapped and faulted for the next save) or free it.

        Its sidecar goes first: a pooled segment is never adoptable. A sparse segment whose pages are not all
        allocated (its client died before faulting them in, or could not) is freed, never pooled; so is one released
        with ``reuse=False`` (nothing is expected to need it soon). Releasing a segment that is not in use (twice, or
        after ``close``) is logged and ignored.

        A segment that leaves its capture ring for the kernel (``pool_past_limit=False``) with ``written`` (it held a
        settled shard: its client's final commit came, so the client writes into it no more) has its pages freed at once,
        although its client may still map it (``Segment.destroy(free_pages=True)``). Without ``written`` (a lease given
        back or expired, a shard dropped in flight) it is only unlinked: its client might still be writing into it, and
        must never meet a SIGBUS for it.
        """
        leaves = False  # it leaves its ring for the kernel: its client may still map it (``Segment.destroy(free_pages)``)
        with self._lock:
            if seg not in self._in_use:
                if not self._closed:
                    log.warning("release of segment %s that is not in use; ignored", seg.path)
                return
            self._in_use.remove(seg)
            self._in_use_bytes -= seg.size
            seg.fresh = False  # whatever was written into it is faulted in now
            if seg.described and seg.path:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(sidecar_path(seg.path))
                seg.described = False
            if seg.sparse and _allocated(seg):
                seg.sparse = False  # its client faulted every page in (a ring's fill, a reservation given back)
            if seg.ring != NO_RING and self._ring_size(seg.owner, seg.ring) >= self.ring_limit:  # (seg is out of it now)
                seg.ring = NO_RING  # the ring grew past its limit (saves outran retention, or keep 1 under ec): it leaves it
                leaves = not self.pool_past_limit and written
                reuse = reuse and self.pool_past_limit  # an ec:K+M ring keeps no spare beside its kept steps
            if reuse and not seg.exported and not seg.sparse and self.pooled_bytes + seg.size <= self.max_pooled_bytes:
                self._free.append(seg)
                self._pooled_bytes += seg.size
                if seg.ring != NO_RING:
                    self._changed.notify_all()  # an ahead allocation may wait for its ring
                return
        seg.destroy(free_pages=leaves)

    def trim(self, keep_bytes: int = 0) -> None:
        """Free pooled segments (the reserve's too) until at most ``keep_bytes`` stay pooled."""
        with self._lock:
            victims = self._unpool_largest(lambda: self.pooled_bytes > keep_bytes)
        for v in victims:
            v.destroy()
