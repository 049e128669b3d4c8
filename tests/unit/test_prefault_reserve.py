"""memstore.server.memory.reserve.Reserve alone: its fresh segments, resizing, giving way, against a fake pool.

The pool it lives in is a ``FakeHoldings`` (a capacity and the bytes the jobs hold, set by each test); segments
are real (anonymous memory, or files in tmp_path where a test looks at a file's size).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from memstore.core.reserve_policy import HEADROOM, ReservePolicy
from memstore.server.memory.pages import PAGE
from memstore.server.memory.reserve import FRESH, Reserve
from memstore.server.memory.segment import Segment, SegmentMaker
from memstore.testing import wait_for

pytestmark = pytest.mark.unit
MiB = 1 << 20
UNIT = MiB + MiB // HEADROOM  # a reserve segment of a 1 MiB unit


class FakeHoldings:
    """The pool, as the reserve sees it."""

    def __init__(self, capacity: int, held: int = 0) -> None:
        self.capacity = capacity
        self.held = held

    def held_by_jobs(self) -> int:
        return self.held

    def job_bytes(self, job: str) -> int:
        return 0  # what ``held`` counts is other jobs'

    def drop_pooled(self, jobs: set[str]) -> None:
        pass


def wait_until(predicate: Callable[[], bool]) -> None:
    wait_for(predicate, 20.0, interval=0.01)


def make(policy: ReservePolicy | None, holdings: FakeHoldings, maker: SegmentMaker | None = None) -> tuple[Reserve, threading.Condition]:
    """A reserve and the lock it shares with its pool (a plain Lock, as the pool's: not reentrant)."""
    lock = threading.Condition(threading.Lock())
    return Reserve(policy, maker or SegmentMaker(None), lock, holdings), lock


def stop(reserve: Reserve, lock: threading.Condition) -> None:
    with lock:
        leftover = reserve.stop()
    reserve.join(5.0)
    for seg in leftover:
        seg.destroy()


@pytest.fixture
def filled() -> Iterator[tuple[Reserve, FakeHoldings, threading.Condition]]:
    """A reserve of four 1 MiB units in anonymous memory, filled."""
    holdings = FakeHoldings(64 * MiB)
    reserve, lock = make(ReservePolicy(4 * MiB, unit=MiB), holdings)
    reserve.start()
    wait_until(lambda: not reserve.filling)
    yield reserve, holdings, lock
    stop(reserve, lock)


def test_it_fills_to_its_goal_in_fresh_segments_and_counts_them(filled: tuple[Reserve, FakeHoldings, threading.Condition]) -> None:
    reserve, _, lock = filled
    with lock:
        segs = reserve.segments()
    assert [s.size for s in segs] == [UNIT] * 4 and all(s.owner == FRESH for s in segs)
    assert reserve.fresh_bytes == reserve.held_bytes == 4 * UNIT and reserve.warming == 0


def test_pick_is_the_smallest_that_fits_preferred_first_within_max_size(
    filled: tuple[Reserve, FakeHoldings, threading.Condition],
) -> None:
    reserve, _, lock = filled
    with lock:
        assert reserve.pick(MiB) is not None
        assert reserve.pick(UNIT + PAGE) is None  # anonymous memory cannot grow: nothing fits a larger shard
        assert reserve.pick(UNIT // 16) is None  # far smaller: it faults in memory of its own
        assert reserve.pick(MiB, max_size=MiB - PAGE) is None  # beyond the job's quota
        assert reserve.pick(MiB, preferred="/nowhere") in reserve.segments()


def test_take_hands_a_segment_out_trimmed_to_the_shard_and_the_reserve_refills(
    filled: tuple[Reserve, FakeHoldings, threading.Condition],
) -> None:
    reserve, holdings, lock = filled
    with lock:
        seg = reserve.pick(MiB // 2)
        assert seg is not None and reserve.take(seg, MiB // 2, "job")
        assert seg.owner == "job" and seg.size == MiB // 2 and seg not in reserve.segments()
        assert reserve.fresh_bytes == 3 * UNIT
        holdings.held += seg.size  # the pool holds it now
    seg.view()[:] = b"\x01" * seg.size
    wait_until(lambda: not reserve.filling)
    assert reserve.fresh_bytes == 3 * UNIT  # --prefault 4 MiB counts what the jobs hold: three units and the shard
    seg.destroy()


def test_a_segment_a_few_pages_short_grows_only_within_the_capacity(tmp_path: Path) -> None:
    holdings = FakeHoldings(4 * MiB)
    reserve, lock = make(ReservePolicy(UNIT, unit=MiB), holdings, SegmentMaker(tmp_path))  # one unit
    reserve.start()
    wait_until(lambda: not reserve.filling)
    try:
        with lock:
            (seg,) = reserve.segments()
            holdings.held = holdings.capacity - UNIT - PAGE  # one page of room
            assert not reserve.take(seg, UNIT + 2 * PAGE, "job")  # two pages more would exceed the capacity
            assert seg in reserve.segments() and seg.size == UNIT
            assert reserve.take(seg, UNIT + PAGE, "job")
        assert seg.size == UNIT + PAGE and os.stat(seg.path or "").st_size == UNIT + PAGE
        seg.view()[:] = b"\x02" * seg.size  # every byte is there
        seg.destroy()
    finally:
        stop(reserve, lock)


def test_a_larger_segment_handed_out_is_trimmed_off_the_caller_s_path(tmp_path: Path) -> None:
    reserve, lock = make(ReservePolicy(UNIT, unit=MiB), FakeHoldings(4 * MiB), SegmentMaker(tmp_path))
    reserve.start()
    wait_until(lambda: not reserve.filling)
    try:
        with lock:
            (seg,) = reserve.segments()
            assert reserve.take(seg, 4 * PAGE, "job")
        assert seg.size == 4 * PAGE
        wait_until(lambda: os.stat(seg.path or "").st_size == 4 * PAGE)  # by the reserve's thread
        seg.destroy()
    finally:
        stop(reserve, lock)


def test_it_never_fills_beyond_the_capacity_the_jobs_leave() -> None:
    holdings = FakeHoldings(8 * MiB, held=8 * MiB - UNIT - PAGE)  # room for one unit
    reserve, lock = make(ReservePolicy(None, unit=MiB), holdings)  # auto: what the job lacks of its cycle, once seen
    reserve.start()
    assert not reserve.filling and reserve.held_bytes == 0  # no shard seen yet
    with lock:
        reserve.saw(3 * MiB, ("j", 0))
    wait_until(lambda: reserve.fresh_bytes == UNIT)
    assert not reserve.filling  # short of its goal, but the capacity has no room
    with lock:
        leftover = reserve.stop()
    reserve.join(5.0)
    assert reserve.thread is not None and not reserve.thread.is_alive()
    assert [s.size for s in leftover] == [UNIT] and reserve.fresh_bytes == 0
    for seg in leftover:
        seg.destroy()


class BlockingMaker(SegmentMaker):
    """Faulting in blocks until cancelled (an allocation gave way): a reserve caught mid-segment."""

    def __init__(self) -> None:
        super().__init__(None)
        self.started = threading.Event()

    def create_cancellable(self, size: int, cancel: threading.Event) -> Segment:
        self.started.set()
        assert cancel.wait(10), "nothing cancelled the reserve"
        raise InterruptedError("cancelled")


def test_give_way_cancels_the_segment_being_faulted_in() -> None:
    holdings = FakeHoldings(4 * MiB)
    maker = BlockingMaker()
    reserve, lock = make(ReservePolicy(4 * MiB, unit=MiB), holdings, maker)
    reserve.start()
    assert maker.started.wait(10)
    assert reserve.filling
    with lock:
        assert reserve.warming == UNIT
        holdings.held = 3 * MiB  # an allocation of the last MiB: the bytes being faulted in stand in its way
        assert not reserve.await_fitting(2 * MiB)  # nothing that fits is on its way
        reserve.give_way(MiB)
        assert reserve.warming == 0 and reserve.fresh_bytes == 0
    stop(reserve, lock)


def test_without_a_policy_it_stays_empty() -> None:
    reserve, lock = make(None, FakeHoldings(4 * MiB))
    reserve.start()
    with lock:
        reserve.saw(2 * MiB)
        assert reserve.pick(MiB) is None and not reserve.await_fitting(MiB)
    assert reserve.thread is None and not reserve.filling and reserve.held_bytes == 0


def test_the_thread_starts_no_segment_while_the_store_moves_bytes_in_the_foreground() -> None:
    """A save being copied in, a push, a receive or a pull (``Store.foreground_busy``) holds new segments back: on a
    replacement, faulting the reserve in beside its first repair pull made the restore waiting on that pull slower."""
    holdings = FakeHoldings(64 * MiB)
    reserve, lock = make(ReservePolicy(4 * MiB, unit=MiB), holdings)
    busy, asked = threading.Event(), []
    busy.set()

    def foreground() -> bool:
        asked.append(1)
        return busy.is_set()

    reserve.start(busy=foreground, yield_seconds=60.0)
    try:
        wait_until(lambda: len(asked) >= 5)  # the thread is waiting for the foreground, not faulting
        assert reserve.fresh_bytes == 0 and reserve.warming == 0 and reserve.filling
        busy.clear()
        wait_until(lambda: not reserve.filling)
        assert reserve.fresh_bytes == 4 * UNIT
    finally:
        stop(reserve, lock)


def test_a_store_busy_without_a_break_still_gets_its_reserve_and_stops_promptly() -> None:
    holdings = FakeHoldings(64 * MiB)
    reserve, lock = make(ReservePolicy(4 * MiB, unit=MiB), holdings)
    reserve.start(busy=lambda: True, yield_seconds=0.02)  # each segment waits at most 20 ms
    try:
        wait_until(lambda: not reserve.filling)
        assert reserve.fresh_bytes == 4 * UNIT
    finally:
        stop(reserve, lock)
    waiting, lock2 = make(ReservePolicy(4 * MiB, unit=MiB), FakeHoldings(64 * MiB))
    waiting.start(busy=lambda: True, yield_seconds=600.0)
    wait_until(lambda: waiting.thread is not None and waiting.thread.is_alive())
    stop(waiting, lock2)  # joins for at most 5 s
    assert waiting.thread is not None and not waiting.thread.is_alive()
