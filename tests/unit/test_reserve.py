"""The pre-faulted reserve (--prefault): its policy, and SegmentPool keeping it inside the capacity."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from memstore.config import StoreConfig
from memstore.core.reserve_policy import ANNOUNCED_IDLE_SECONDS, HEADROOM, IDLE_MIN_SECONDS, MIN_UNIT, ReserveGoal, ReservePolicy
from memstore.errors import ConfigError
from memstore.server.memory.pages import PAGE
from memstore.server.memory.pool import SegmentPool
from memstore.server.memory.segment import Segment
from memstore.testing import wait_for

pytestmark = pytest.mark.unit
MiB = 1 << 20


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    wait_for(predicate, timeout, interval=0.01)


def settled(pool: SegmentPool) -> Callable[[], bool]:
    return lambda: not pool.reserve_filling


def fresh_sizes(pool: SegmentPool) -> list[int]:
    return sorted(s.size for s in pool.reserve.segments())


def check_accounting(pool: SegmentPool) -> None:
    """Every byte accounted, and within the capacity (polled: the reserve's thread may be adding a segment)."""

    def exact() -> bool:
        used, tracked, fresh = pool.used_bytes, pool.tracked_bytes, pool.reserve.fresh_bytes
        return used == tracked <= pool.capacity and fresh == sum(fresh_sizes(pool))

    wait_until(exact)


# -- policy ------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_auto_faults_in_what_each_active_job_lacks_of_its_cycle() -> None:
    """(keep + 1) shards per active stream (the kept steps and the one in flight), less what the job holds."""
    clock = Clock()
    policy = ReservePolicy(None, keep=2, clock=clock)
    held = {"a": 0, "b": 0}
    assert policy.goal(job_bytes=held.__getitem__) == ReserveGoal(0, 0)  # nothing seen: nothing to fault in
    policy.saw(16 * MiB, ("a", 0))
    policy.saw(4 * MiB, ("a", 1))
    policy.saw(MIN_UNIT - 1, ("b", 0))  # too small to count: it faults in fast
    assert policy.goal(job_bytes=held.__getitem__) == ReserveGoal(16 * MiB, 3 * 20 * MiB)
    held["a"] = 50 * MiB
    assert policy.goal(job_bytes=held.__getitem__).target == 10 * MiB
    held["a"] = 80 * MiB  # a job holding more than its cycle lends nothing to another
    policy.saw(8 * MiB, ("b", 0))
    assert policy.goal(job_bytes=held.__getitem__).target == 3 * 8 * MiB
    assert policy.goal(held=1 << 40, job_bytes=held.__getitem__).target == 24 * MiB  # auto counts per job, not in total


def test_auto_lets_a_job_that_stopped_saving_go_idle() -> None:
    """Idle after IDLE_CADENCES of its gaps (at least IDLE_MIN_SECONDS) without a shard: no cycle, its spares may go."""
    clock = Clock()
    policy = ReservePolicy(None, keep=2, clock=clock)
    for _ in range(3):
        policy.saw(8 * MiB, ("a", 0))
        policy.saw(8 * MiB, ("b", 0))
        clock.now += 100.0  # a save every 100 s
    assert policy.idle_jobs() == set() and policy.streams_active
    clock.now += 150.0  # 250 s since the last: within three gaps
    assert policy.idle_jobs() == set()
    policy.saw(8 * MiB, ("b", 0))
    clock.now += 100.0  # 350 s since a's last save: idle; b saved 100 s ago
    assert policy.idle_jobs() == {"a"} and policy.streams_active
    assert policy.goal(job_bytes=lambda job: 0).target == 3 * 8 * MiB  # b's cycle only
    clock.now += 700.0  # b's longest recent gap was 250 s: idle after 750 s
    assert policy.idle_jobs() == {"a", "b"} and not policy.streams_active
    assert policy.goal(job_bytes=lambda job: 0).target == 0
    policy.saw(8 * MiB, ("a", 0))  # saving again: active again
    assert policy.idle_jobs() == {"b"}
    quick = ReservePolicy(None, keep=2, clock=clock)
    quick.saw(8 * MiB, ("c", 0))
    clock.now += IDLE_MIN_SECONDS - 1  # one shard, no cadence known: idle after the minimum
    assert quick.idle_jobs() == set()
    clock.now += 2
    assert quick.idle_jobs() == {"c"}


def test_explicit_prefault_counts_what_the_store_holds_and_keeps_one_segment_ready() -> None:
    policy = ReservePolicy(80 * MiB, keep=2)
    goal = policy.goal()
    assert goal.unit == 16 * MiB  # before any shard: N / (keep + 3)
    assert goal.target == 80 * MiB
    assert goal.segment_bytes == 16 * MiB + 16 * MiB // HEADROOM
    assert policy.goal(held=40 * MiB).target == 40 * MiB
    assert policy.goal(held=1 << 30).target == goal.segment_bytes  # never less than one segment
    policy.saw(10 * MiB)
    assert policy.goal().unit == 10 * MiB  # learned
    assert ReservePolicy(64 * MiB, unit=8 * MiB).goal().unit == 8 * MiB  # --prefault-unit wins
    assert ReservePolicy(0).goal() == ReserveGoal(0, 0)


def test_goal_counts_whole_segments() -> None:
    goal = ReserveGoal(16 * MiB, 32 * MiB)
    assert goal.wants_another(0) and goal.wants_another(goal.segment_bytes)
    assert not goal.wants_another(2 * goal.segment_bytes)
    assert not ReserveGoal(0, 32 * MiB).wants_another(0)


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        ({"prefault": "lots"}, "--prefault"),
        ({"prefault": "8GiB", "capacity": "4GiB"}, "larger than --capacity"),
        ({"prefault_unit": "8GiB", "capacity": "4GiB"}, "--prefault-unit"),
    ],
)
def test_bad_prefault_flags_are_named(flags: dict[str, str], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        StoreConfig.load(cli={"host_id": "h0", "listen": "127.0.0.1:7070", "replicas": 1, **flags}, env={}).validated()


def test_prefault_parses_auto_and_sizes() -> None:
    base = {"host_id": "h0", "listen": "127.0.0.1:7070", "replicas": 1}
    assert StoreConfig.load(cli={**base, "prefault": "auto"}, env={}).prefault is None
    assert StoreConfig.load(cli=base, env={"MEMSTORE_PREFAULT": "1GiB"}).prefault == 1 << 30
    assert StoreConfig.load(cli=base, env={}).prefault is None


# -- the pool ----------------------------------------------------------------------------
@pytest.fixture(params=["shm", "anonymous"])
def directory(request: pytest.FixtureRequest, tmp_path: Path) -> str | None:
    if request.param == "anonymous":
        return None
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
    d = base / f"memstore-test-reserve-{os.getpid()}-{time.monotonic_ns()}"
    return str(d)


def test_explicit_prefault_faults_one_pass_of_the_cycle_in_before_serving(directory: str | None) -> None:
    assert ReservePolicy(None).before_serving() == 0 and ReservePolicy(0).before_serving() == 0
    pool = SegmentPool(directory, 64 * MiB, reserve=ReservePolicy(40 * MiB, keep=2))
    try:
        assert ReservePolicy(40 * MiB, keep=2).before_serving() == 8 * MiB  # N / (keep + 3)
        ready = pool.prefault_now()  # on this thread, no background thread started
        unit = 8 * MiB + 8 * MiB // HEADROOM
        assert ready == unit and fresh_sizes(pool) == [unit] and pool.reserve.thread is None
        check_accounting(pool)
        seg = pool.acquire(8 * MiB, "job-a")  # the first shard takes the segment faulted in before serving
        assert pool.reserve.fresh_bytes == 0 and seg.owner == "job-a"
    finally:
        pool.close()


def test_explicit_reserve_fills_at_start_and_any_job_takes_it(directory: str | None) -> None:
    pool = SegmentPool(directory, 64 * MiB, reserve=ReservePolicy(40 * MiB, keep=2))
    try:
        pool.start_reserve()
        wait_until(settled(pool))
        unit = 8 * MiB + 8 * MiB // HEADROOM
        assert fresh_sizes(pool) == [unit] * 5
        check_accounting(pool)
        seg = pool.acquire(8 * MiB, "job-a")
        assert seg.size == 8 * MiB and seg.owner == "job-a"  # a fresh one, trimmed to what a new one would take
        assert pool.in_use_bytes == 8 * MiB
        check_accounting(pool)
        # The reserve refills only while what the store holds stays under --prefault.
        wait_until(settled(pool))
        assert sum(fresh_sizes(pool)) + pool.in_use_bytes <= 40 * MiB + 40 * MiB // HEADROOM
        # A pooled segment of a job goes back to that job only; fresh ones to anyone.
        pool.release(seg)
        other = pool.acquire(8 * MiB, "job-b")
        assert other is not seg and other.owner == "job-b"
        again = pool.acquire(8 * MiB, "job-a")
        assert again is seg
        check_accounting(pool)
    finally:
        pool.close()


def test_a_larger_reserve_segment_is_trimmed_and_a_slightly_smaller_one_grows(directory: str | None) -> None:
    pool = SegmentPool(directory, 64 * MiB, reserve=ReservePolicy(32 * MiB, unit=16 * MiB, keep=2))
    try:
        pool.start_reserve()
        wait_until(settled(pool))
        small = pool.acquire(2 * MiB, "j")  # from a 16 MiB segment: handed out at once, trimmed afterwards
        assert small.size == 2 * MiB
        check_accounting(pool)
        small.view()[:] = b"\x01" * (2 * MiB)
        if small.path:
            wait_until(lambda: os.stat(small.path).st_size == 2 * MiB)  # type: ignore[arg-type]
        wait_until(settled(pool))
        fresh = fresh_sizes(pool)
        big = max(fresh)
        grown = pool.acquire(big + 4 * PAGE, "j")  # up to 1/8 short: grows by the missing pages
        assert grown.size == big + 4 * PAGE
        grown.view()[:] = b"\x02" * grown.size  # every byte is there (no SIGBUS past the old end)
        check_accounting(pool)
    finally:
        pool.close()


def test_auto_reserve_learns_from_the_first_shard(directory: str | None) -> None:
    pool = SegmentPool(directory, 64 * MiB, reserve=ReservePolicy(None))
    try:
        pool.start_reserve()
        assert not pool.reserve_filling  # the goal is empty: nothing to fault in before a shard is seen
        assert pool.reserve_bytes == 0
        first = pool.acquire(4 * MiB, "j", stream=("j", 0))
        wait_until(settled(pool))
        assert fresh_sizes(pool) == [4 * MiB + 4 * MiB // HEADROOM] * 2  # the rest of its cycle: keep + 1 = 3 shards
        second = pool.acquire(4 * MiB, "j", stream=("j", 0))
        assert second.size == 4 * MiB  # taken from the reserve, trimmed to size
        assert first is not second
        check_accounting(pool)
    finally:
        pool.close()


def test_the_reserve_gives_way_to_shards_and_never_exceeds_the_capacity(directory: str | None) -> None:
    pool = SegmentPool(directory, 40 * MiB, reserve=ReservePolicy(40 * MiB, unit=16 * MiB))
    try:
        pool.start_reserve()
        wait_until(settled(pool))
        assert pool.used_bytes <= 40 * MiB
        # Shards of another size: the reserve's segments are dropped to make room, the shards all fit.
        held = [pool.acquire(12 * MiB + 5, f"job-{i}") for i in range(3)]
        assert all(s.size >= 12 * MiB for s in held)
        check_accounting(pool)
        for s in held:
            pool.release(s)
        check_accounting(pool)
    finally:
        pool.close()


def test_an_allocation_cancels_faulting_that_stands_in_its_way(directory: str | None) -> None:
    pool = SegmentPool(directory, 24 * MiB, reserve=ReservePolicy(24 * MiB, unit=8 * MiB))
    gate = threading.Event()
    real_create = pool.maker.create_cancellable

    def slow_create(size: int, cancel: threading.Event) -> Segment:
        gate.set()
        assert cancel.wait(10), "the allocation did not cancel the reserve"
        return real_create(size, cancel)

    pool.maker.create_cancellable = slow_create  # type: ignore[method-assign]
    try:
        pool.start_reserve()
        assert gate.wait(10)
        seg = pool.acquire(20 * MiB, "j")  # 8 MiB being faulted (too small to wait for) + 20 MiB > 24 MiB: it must give way
        assert seg.size >= 20 * MiB
        check_accounting(pool)
    finally:
        pool.close()


def test_peek_names_what_acquire_hands_out_and_preferred_wins(directory: str | None) -> None:
    pool = SegmentPool(directory, 64 * MiB, reserve=ReservePolicy(32 * MiB, unit=4 * MiB))
    try:
        pool.start_reserve()
        wait_until(settled(pool))
        ahead = pool.peek(4 * MiB, "j")
        assert ahead is not None and ahead in pool.reserve.segments()
        assert pool.acquire(4 * MiB, "j") is ahead
        candidates = pool.reserve.segments()
        wanted = max(candidates, key=lambda s: s.path or str(id(s)))
        if wanted.path:
            assert pool.acquire(4 * MiB, "j", preferred=wanted.path) is wanted
    finally:
        pool.close()


def test_close_stops_the_reserve_and_removes_its_files(tmp_path: Path) -> None:
    directory = tmp_path / "segs"
    pool = SegmentPool(str(directory), 256 * MiB, reserve=ReservePolicy(256 * MiB))
    pool.start_reserve()
    wait_until(lambda: pool.reserve_bytes > 0)
    pool.close()
    assert pool.reserve.thread is not None and not pool.reserve.thread.is_alive()
    assert not directory.exists()


def test_a_far_smaller_shard_leaves_the_reserve_alone(directory: str | None) -> None:
    pool = SegmentPool(directory, 64 * MiB, reserve=ReservePolicy(32 * MiB, unit=16 * MiB))
    try:
        pool.start_reserve()
        wait_until(settled(pool))
        before = fresh_sizes(pool)
        tiny = pool.acquire(64 * 1024, "j")  # 1/256 of a unit: fresh memory of its own, not a trimmed unit
        assert tiny.size == 64 * 1024
        assert fresh_sizes(pool) == before
        check_accounting(pool)
    finally:
        pool.close()


def test_only_a_segment_made_for_the_shard_is_fresh(directory: str | None) -> None:
    """A pull faults its destination in ahead of the socket only when it is fresh memory (peers.pull_data(fresh=))."""
    pool = SegmentPool(directory, 64 * MiB, reserve=ReservePolicy(32 * MiB, keep=2))
    try:
        new = pool.acquire(8 * MiB, "job-a")  # no reserve yet: made now
        assert new.fresh
        pool.release(new)
        assert not new.fresh and pool.acquire(8 * MiB, "job-a") is new  # pooled: faulted in already
        pool.prefault_now()
        from_reserve = pool.acquire(8 * MiB, "job-b")
        assert from_reserve is not new and not from_reserve.fresh
    finally:
        pool.close()


def test_a_replacement_expects_its_groups_newest_shards_before_it_serves() -> None:
    """``expect``: what the first repair pass will pull (the newest step of each shard the group holds for this host).
    The automatic reserve faults that much in before serving, up to its goal; an explicit one learns the shard size."""
    auto = ReservePolicy(None, keep=2)
    assert auto.before_serving() == 0  # a fresh store of a fresh cluster: nothing known
    auto.expect([16 * MiB, MIN_UNIT - 1])  # a tiny shard faults in fast: not worth a segment of its own
    assert auto.before_serving() == 16 * MiB and auto.goal().unit == 16 * MiB
    many = ReservePolicy(None, keep=2)
    many.expect([16 * MiB] * 5)
    assert many.before_serving() == 2 * 16 * MiB  # at most the automatic goal: two units
    explicit = ReservePolicy(80 * MiB, keep=2)
    explicit.expect([10 * MiB])
    assert explicit.before_serving() == 16 * MiB and explicit.goal().unit == 10 * MiB  # shard-sized segments
    assert ReservePolicy(0).before_serving() == 0


def test_the_pool_gives_back_the_spares_of_a_job_that_stopped_saving(tmp_path: Path) -> None:
    """A replica's cycle: kept steps plus a pooled spare for the next one. Once its job goes idle, the spare (and any
    fresh memory) goes back to the kernel; the kept steps stay."""
    clock = Clock()
    pool = SegmentPool(str(tmp_path / "h1-1"), 64 * MiB, reserve=ReservePolicy(None, keep=2, clock=clock))
    try:
        pool.start_reserve()
        held = [pool.acquire(4 * MiB, "j", stream=("j", 0)) for _ in range(3)]  # keep + 1 replicas: the whole cycle
        wait_until(settled(pool))
        assert pool.reserve_bytes == 0  # the job holds its cycle: nothing more is faulted in
        pool.release(held[0])  # retention let the oldest go: pooled, the next replica's
        assert pool.pooled_bytes == 4 * MiB
        clock.now += IDLE_MIN_SECONDS + 1  # no replica since: the job is idle
        pool.reserve.look_again()
        wait_until(lambda: pool.pooled_bytes == 0)
        assert pool.used_bytes == 2 * 4 * MiB  # its kept steps
        assert pool.jobs_memory() == {"j": (8 * MiB, 0)}
        check_accounting(pool)
    finally:
        pool.close()


def test_an_announced_stream_is_faulted_in_before_its_first_shard_and_waits_for_it() -> None:
    """A peer's ``Expect``: the stream's cycle is the goal before any replica came; it is not idle until
    ANNOUNCED_IDLE_SECONDS (set-up may come long before the first save), and its first shard starts its cadence."""
    clock = Clock()
    policy = ReservePolicy(None, keep=2, clock=clock)
    policy.announce(MIN_UNIT - 1, ("tiny", 0))  # too small to count
    assert policy.goal(job_bytes=lambda job: 0) == ReserveGoal(0, 0)
    policy.announce(16 * MiB, ("a", 0))
    assert policy.goal(job_bytes=lambda job: 0) == ReserveGoal(16 * MiB, 3 * 16 * MiB)
    clock.now += IDLE_MIN_SECONDS * 10
    assert policy.idle_jobs() == set()  # announced: waits for its first shard
    policy.announce(32 * MiB, ("a", 0))  # a stream known already stays as it is
    assert policy.goal(job_bytes=lambda job: 0).target == 3 * 16 * MiB
    policy.saw(16 * MiB, ("a", 0))  # the first replica: the wait since the announcement is no gap
    clock.now += IDLE_MIN_SECONDS + 1
    assert policy.idle_jobs() == {"a"}
    late = ReservePolicy(None, keep=2, clock=clock)
    late.announce(8 * MiB, ("b", 0))
    clock.now += ANNOUNCED_IDLE_SECONDS + 1  # announced, and no save ever came
    assert late.idle_jobs() == {"b"}
