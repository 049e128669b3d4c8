"""The prefault reserve (``--prefault``): fresh segments faulted in ahead of need, handed to whichever job saves
or receives next.

The first touch of fresh pages costs ~10x a copy into pre-faulted ones, so a background thread ("prefault")
faults segments in while the store serves. They never held any job's bytes (owner ``FRESH``), so any job may
take one; the one handed out is resized to the shard: grown at once when it is a few pages short, trimmed on the
thread, off the save's path, when it is larger. An allocation that needs the bytes being faulted in cancels that
within one step (``memstore.server.memory.pages.FAULT_STEP``). How much to keep, in what pieces: the policy
(``memstore.core.reserve_policy``).

The reserve lives inside the segment pool's capacity and under its lock: ``Reserve`` is given the pool's
Condition, and asks the pool, through ``Holdings``, for the capacity and the bytes the jobs hold. Methods said
to run "lock held" are called by the pool with that lock held; the others take it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from memstore.core.reserve_policy import ReserveGoal, ReservePolicy
from memstore.core.sizes import format_size
from memstore.server.memory.pages import round_up
from memstore.server.memory.segment import Segment, SegmentMaker

log = logging.getLogger(__name__)

FRESH = ""  # owner of a reserve segment: it never held any job's bytes, so any job may take it
GROW_FRACTION = 8  # a fresh segment up to 1/8 short of a shard grows to fit it
TRIM_FACTOR = 8  # ... and one up to 8x the shard is trimmed to it; a far smaller shard faults in fresh memory of its own
CANCEL_WAIT_SECONDS = 5.0  # how long an allocation waits for the reserve to give back bytes it is faulting in
YIELD_SECONDS = 2.0  # how long the thread holds a new segment back while the store moves bytes in the foreground
YIELD_POLL_SECONDS = 0.005


class Holdings(Protocol):
    """What the reserve asks of the pool it lives in."""

    capacity: int

    def held_by_jobs(self) -> int:
        """Bytes of the segments in use and in the jobs' pools: all the pool holds but the reserve (lock held)."""
        ...

    def job_bytes(self, job: str) -> int:
        """Bytes of the segments job ``job`` holds: in use (shards, leases) and pooled (lock held)."""
        ...

    def drop_pooled(self, jobs: set[str]) -> None:
        """Give back to the kernel the pooled segments of ``jobs`` that belong to no capture ring (takes the lock)."""
        ...


class Reserve:
    """Fresh, pre-faulted segments, their background thread, and the bytes being faulted in (``warming``).

    Every byte counts against the pool's capacity: ``fresh_bytes`` (ready, part of the pool's pooled bytes) and
    ``warming`` (being faulted in). Without a policy (None) it stays empty and starts no thread.
    """

    def __init__(self, policy: ReservePolicy | None, maker: SegmentMaker, lock: threading.Condition, holdings: Holdings) -> None:
        self.policy = policy
        self._maker = maker
        self._lock = lock  # the pool's: notified when bytes are given back or added
        self._holdings = holdings
        self._fresh: list[Segment] = []
        self.fresh_bytes = 0  # bytes of the fresh segments ready
        self.warming = 0  # bytes being faulted in right now (not ready yet; they count against the capacity)
        self._room_wanted = 0  # allocations waiting for the reserve to give bytes back
        self._cancel = threading.Event()
        self._shrinks: list[tuple[Segment, int]] = []  # segments handed out larger than needed: trim to these sizes
        self._wake = threading.Event()
        self.thread: threading.Thread | None = None
        self._busy: Callable[[], bool] | None = None  # start(busy=): the store is moving bytes in the foreground
        self._yield_seconds = YIELD_SECONDS
        self._closed = False

    # -- what the pool asks, lock held --------------------------------------------------------
    @property
    def held_bytes(self) -> int:
        """Fresh bytes ready plus those being faulted in now."""
        return self.fresh_bytes + self.warming

    def segments(self) -> list[Segment]:
        """The fresh segments ready (lock held)."""
        return list(self._fresh)

    def saw(self, nbytes: int, stream: tuple[str, int] | None = None) -> None:
        """A shard of ``nbytes`` (of ``stream``: job, rank) is being placed: the policy learns it, the thread looks
        again (lock held)."""
        if self.policy is not None:
            self.policy.saw(nbytes, stream)  # under the lock: goal() iterates what saw() appends to
            self._wake.set()

    def announce(self, nbytes: int, stream: tuple[str, int]) -> None:
        """``stream``'s shards, ``nbytes`` each, will come (``ReservePolicy.announce``); the thread looks again (lock
        held)."""
        if self.policy is not None:
            self.policy.announce(nbytes, stream)
            self._wake.set()

    def pick(self, nbytes: int, max_size: int | None = None, preferred: str = "") -> Segment | None:
        """The smallest fresh segment that fits ``nbytes`` after resizing (and ``max_size``), ``preferred`` (a
        path) first when it is one of them; left in the reserve (lock held)."""
        size = round_up(nbytes)
        if max_size is not None and size > max_size:
            return None
        low = size - size // GROW_FRACTION  # a fresh segment a little short of the shard grows to fit it
        best: Segment | None = None
        for seg in self._fresh:
            # (an anonymous segment can't grow: shared anonymous memory has a fixed size)
            if (low if seg.path else nbytes) <= seg.size <= TRIM_FACTOR * size:
                if preferred and seg.path == preferred:
                    return seg
                if best is None or seg.size < best.size:
                    best = seg
        return best

    def take(self, seg: Segment, nbytes: int, owner: str) -> bool:
        """Hand ``seg`` (from ``pick``) to job ``owner``, resized to ``nbytes`` rounded up to pages: what a new
        segment would take, so accounting and quotas see the same bytes either way. False, leaving it in the
        reserve, if it cannot grow (lock held)."""
        if not self._resize(seg, round_up(nbytes)):
            return False
        self._fresh.remove(seg)
        self.fresh_bytes -= seg.size
        seg.owner = owner
        self._wake.set()
        return True

    def remove(self, seg: Segment) -> None:
        """Take ``seg`` out of the reserve, to be destroyed by the caller (lock held)."""
        self._fresh.remove(seg)
        self.fresh_bytes -= seg.size

    def await_fitting(self, size: int) -> bool:
        """If the thread is faulting in a segment that fits ``size`` bytes, wait for it to finish (faster than
        starting another); whether it waited (lock held)."""
        if self.warming < size - size // GROW_FRACTION:
            return False
        self._lock.wait_for(lambda: not self.warming or self._closed, timeout=CANCEL_WAIT_SECONDS * 4)
        return True

    def give_way(self, size: int) -> None:
        """Make the thread give back the bytes it is faulting in while they stand between ``size`` more bytes and
        the capacity (it stops within one step), and wait for that, up to ``CANCEL_WAIT_SECONDS`` (lock held)."""
        deadline = time.monotonic() + CANCEL_WAIT_SECONDS
        self._room_wanted += 1  # the thread starts nothing new meanwhile
        try:
            while self.warming and self._holdings.held_by_jobs() + self.held_bytes + size > self._holdings.capacity:
                self._cancel.set()
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
        finally:
            self._room_wanted -= 1

    def stop(self) -> list[Segment]:
        """Stop the thread (it exits within one step; ``join`` waits) and hand over the fresh segments, to be
        destroyed by the caller (lock held)."""
        self._closed = True
        self._cancel.set()
        self._wake.set()
        fresh, self._fresh = self._fresh, []
        self.fresh_bytes = 0
        return fresh

    # -- the thread -------------------------------------------------------------------------------
    @property
    def filling(self) -> bool:
        """Whether the reserve is being faulted in toward its goal (it is short of it, and the capacity has room)."""
        if self.policy is None or self._closed:
            return False
        with self._lock:
            if self.warming:
                return True
            held = self._holdings.held_by_jobs()
            goal = self.policy.goal(held=held, job_bytes=self._holdings.job_bytes)
            room = held + self.fresh_bytes + round_up(goal.segment_bytes) <= self._holdings.capacity
            return room and goal.wants_another(self.fresh_bytes)

    def start(self, busy: Callable[[], bool] | None = None, yield_seconds: float = YIELD_SECONDS) -> None:
        """Start faulting in the reserve in the background (no-op without a policy or when started). ``busy``: whether
        the store is moving bytes in the foreground (a save being copied in, a shard pushed, received or pulled); the
        thread starts no new segment while it is, for up to ``yield_seconds`` each. Faulting in takes a core (0.14 s per
        GiB on huge pages, about 0.5 s on 4 KiB pages, on the development VM): beside a replacement's first repair pull,
        the restore waiting on that pull took 0.46-0.56 s instead of 0.36-0.38 s (1 GiB, huge pages, 2 cores). It never
        pauses inside a segment, so an allocation waiting for the bytes it is faulting in never waits on a transfer."""
        if self.policy is None or self.thread is not None:
            return
        self._busy = busy
        self._yield_seconds = yield_seconds
        self.thread = threading.Thread(target=self._loop, name="prefault", daemon=True)
        self._wake.set()
        self.thread.start()

    def look_again(self) -> None:
        """Have the thread look at the goal and the idle jobs now, not at its next periodic wake-up."""
        self._wake.set()

    def fill_now(self) -> int:
        """Fault in, on the calling thread, what the policy wants ready before the store serves
        (``ReservePolicy.before_serving``), within the goal and the capacity; the fresh bytes ready then."""
        if self.policy is None:
            return 0
        want = self.policy.before_serving()
        while not self._closed and self.fresh_bytes < want and self._add_one():
            pass
        return self.fresh_bytes

    def join(self, timeout: float) -> None:
        """Wait for the thread to exit after ``stop`` (not when called from the thread itself)."""
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=timeout)

    def _loop(self) -> None:
        while not self._closed:
            self._wake.wait(timeout=5.0)
            self._wake.clear()
            self._apply_shrinks()
            self._give_back_spares()
            while not self._closed:
                self._yield_to_foreground()
                if not self._add_one():
                    break

    def _yield_to_foreground(self) -> None:
        """Wait (bounded) while the store is busy in the foreground, before a new segment."""
        if self._busy is None:
            return
        deadline = time.monotonic() + self._yield_seconds
        while not self._closed and self._busy() and time.monotonic() < deadline:
            time.sleep(YIELD_POLL_SECONDS)

    def _resize(self, seg: Segment, size: int) -> bool:
        """Resize fresh ``seg`` to ``size`` bytes: grown now if the capacity has room, trimmed later by the
        thread (lock held)."""
        if seg.size == size:
            return True
        if size > seg.size:
            if self._holdings.held_by_jobs() + self.held_bytes + size - seg.size > self._holdings.capacity:
                return False
            if not seg.extend(size):
                return False
        else:
            self._shrinks.append((seg, size))
            self._wake.set()
        self.fresh_bytes += size - seg.size
        seg.size = size
        return True

    def _apply_shrinks(self) -> None:
        with self._lock:
            shrinks, self._shrinks = self._shrinks, []
        for seg, size in shrinks:
            seg.shrink_to(size)

    def _goal(self) -> ReserveGoal:
        assert self.policy is not None
        with self._lock:
            return self.policy.goal(held=self._holdings.held_by_jobs(), job_bytes=self._holdings.job_bytes)

    def _give_back_spares(self) -> None:
        """The automatic reserve holds no more than the active jobs lack of their cycle: fresh segments beyond that
        (the jobs got their cycle from elsewhere, or stopped saving) go back to the kernel, and so do the pooled
        spares of jobs that stopped saving (``ReservePolicy.idle_jobs``): their kept steps stay, nothing else."""
        if self.policy is None or not self.policy.auto:
            return
        goal = self._goal()
        extra: list[Segment] = []
        with self._lock:
            idle = self.policy.idle_jobs()
            for seg in sorted(self._fresh, key=lambda s: s.size, reverse=True):
                if self.fresh_bytes - seg.size // 2 < goal.target:
                    break
                self.remove(seg)
                extra.append(seg)
        for seg in extra:
            seg.destroy()
        if idle:
            self._holdings.drop_pooled(idle)

    def _drop_undersized(self, goal: ReserveGoal) -> None:
        """Fresh segments far too small for the shards seen now make way for ones that fit."""
        stale: list[Segment] = []
        low = goal.unit - goal.unit // GROW_FRACTION
        with self._lock:
            for seg in sorted((s for s in self._fresh if s.size < low), key=lambda s: s.size):
                if goal.wants_another(self.fresh_bytes):
                    break
                self.remove(seg)
                stale.append(seg)
        for seg in stale:
            seg.destroy()

    def _add_one(self) -> bool:
        """Fault in one more fresh segment if the goal wants one and the capacity has room; whether it did."""
        goal = self._goal()
        self._drop_undersized(goal)
        with self._lock:
            if self._closed or self._room_wanted or not goal.wants_another(self.fresh_bytes):
                return False
            size = round_up(goal.segment_bytes)
            if self._holdings.held_by_jobs() + self.held_bytes + size > self._holdings.capacity:
                return False  # the reserve never pushes out shards, pooled segments or the capacity
            self.warming += size
            self._cancel.clear()
        seg = None
        try:
            seg = self._maker.create_cancellable(size, self._cancel)
        except Exception as exc:  # tmpfs full, or cancelled: try again at the next wake-up
            log.debug("reserve: no fresh %s segment: %s", format_size(size), exc)
        with self._lock:
            self.warming -= size
            fits = self._holdings.held_by_jobs() + self.fresh_bytes + size <= self._holdings.capacity
            added = seg is not None and not self._closed and fits
            if added:
                assert seg is not None
                seg.owner = FRESH
                self._fresh.append(seg)
                self.fresh_bytes += size
            self._lock.notify_all()
        if seg is not None and not added:
            seg.destroy()
        return added
