"""ec:K+M with keep >= 2: a save into its rank's full capture ring takes the segment of the rank's oldest kept step
(``memstore.core.retention.recycled_copy``, ``memstore.server.engine.recycling``), only below a newer step known
restorable by every rank (a floor, one sent with the save's Allocate included, or the newest the janitor learnt) and
committed here, and when nothing reads the oldest; never at keep 1 nor under replicas."""

from __future__ import annotations

import mmap
from typing import Any

import pytest

from memstore.config import StoreConfig
from memstore.core.floors import Floor, Floors
from memstore.core.model import ShardKey, ShardState
from memstore.core.retention import recycled_copy
from memstore.errors import InvalidArgument
from memstore.server.engine.catalog import Catalog
from memstore.server.engine.entries import Entry
from memstore.server.engine.eviction import Eviction
from memstore.server.engine.recycling import Recycler
from memstore.server.engine.room import Room
from memstore.server.memory.pool import Segment
from memstore.server.memory.rings import reserves_at_save, ring_limit, saves_recycle
from memstore.server.store import Store
from tests.unit.engine_fakes import FakePool, KiB, config, make_catalog

pytestmark = pytest.mark.unit

JOB = "job"
RANK = 3
FIVE = ",".join(f"h{i}=127.0.0.1:{7070 + i}" for i in range(5))
C, R, U = ShardState.COMMITTED, ShardState.REPLICATING, ShardState.UNDER_REPLICATED


def k(step: int, timeline: str = "") -> ShardKey:
    return ShardKey(JOB, step, RANK, timeline)


# ---- the rule (memstore.core.retention.recycled_copy)


def v(step: int, timeline: str = "") -> tuple[int, str]:
    return step, timeline


def test_the_oldest_kept_step_goes_below_a_newer_step_every_rank_can_restore_held_committed() -> None:
    assert recycled_copy([(k(1), C, 1.0), (k(2), C, 2.0)], [v(2)]) == k(1)
    assert recycled_copy([(k(1), C, 1.0), (k(2), U, 2.0), (k(3), C, 3.0)], [v(3)]) == k(1)  # the oldest, whatever the middle
    assert recycled_copy([(k(1), C, 1.0), (k(2), C, 2.0), (k(3), R, 3.0)], [v(2), None]) == k(1)  # the newest in flight
    assert recycled_copy([(k(1), C, 1.0), (k(2), C, 2.0)], [v(1), v(2)]) == k(1)  # either known version newer will do


def test_nothing_goes_while_nothing_newer_is_known_restorable_everywhere() -> None:
    # This rank's newest step committed tells nothing of another rank's save of it, which may still be in flight: the
    # oldest kept step may be the newest every rank can restore after a loss.
    assert recycled_copy([(k(1), C, 1.0), (k(2), C, 2.0)]) is None  # unknown: no floor, nothing learnt
    assert recycled_copy([(k(1), C, 1.0), (k(2), C, 2.0)], [None, None]) is None
    assert recycled_copy([(k(1), C, 1.0), (k(2), C, 2.0)], [v(1)]) is None  # the oldest is the newest restorable
    assert recycled_copy([(k(2), C, 2.0), (k(3), C, 3.0)], [v(1)]) is None  # a stale value: step 2 looks retirable otherwise
    assert recycled_copy([(k(1), C, 1.0), (k(2), C, 2.0)], [v(5)]) is None  # not held here (a floor of steps gone)


@pytest.mark.parametrize("known", [R, U, ShardState.CAPTURED])
def test_nothing_goes_while_the_known_restorable_step_is_not_committed_here(known: ShardState) -> None:
    assert recycled_copy([(k(1), C, 1.0), (k(2), known, 2.0)], [v(2)]) is None  # in flight, or its parity incomplete


def test_nothing_goes_with_one_step_an_oldest_in_flight_or_due_for_spilling() -> None:
    assert recycled_copy([(k(1), C, 1.0)], [v(1)]) is None  # the newest is the oldest
    assert recycled_copy([(k(1), R, 1.0), (k(2), C, 2.0)], [v(2)]) is None  # the oldest still in flight
    assert recycled_copy([(k(1), C, 1.0), (k(2), C, 2.0)], [v(2)], protected_steps=[1]) is None  # due for spilling


def test_a_newer_timeline_is_newer_whatever_its_step() -> None:
    # The job went back: step 5 of the new timeline "b" is the newest, step 7 of the abandoned one the oldest.
    assert recycled_copy([(k(7, "a"), C, 1.0), (k(5, "b"), C, 2.0)], [v(5, "b")]) == k(7, "a")
    assert recycled_copy([(k(7, "a"), C, 1.0), (k(5, "b"), R, 2.0)], [v(5, "b")]) is None
    assert recycled_copy([(k(7, "a"), C, 1.0), (k(5, "b"), C, 2.0)], [v(7, "a")]) is None  # the abandoned run's: not newer
    assert recycled_copy([(k(7, "a"), C, 1.0), (k(5, "b"), C, 2.0)], [v(5, "a")]) is None  # a version nobody holds here


# ---- the engine (Recycler, Room) over the fake pool


class RingPool(FakePool):
    """The fake pool with one full capture ring: a released ring segment is pooled, ``acquire(preferred=...)`` hands it
    back; anything else is a new segment (the ring grows)."""

    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.full = True
        self.pooled: dict[str, Segment] = {}
        self.grown: list[int] = []
        self.preferred: list[str] = []

    def ring_full(self, owner: str, ring: int) -> int:
        return 2 if self.full and not self.pooled else 0

    def count_growth(self, owner: str, ring: int, size: int) -> None:
        self.grown.append(size)

    def recyclable(self, seg: Segment, nbytes: int) -> bool:
        return not seg.exported and nbytes <= seg.size

    def release(self, seg: Segment, reuse: bool = True, written: bool = False) -> None:
        super().release(seg, reuse)
        if reuse and seg.path and not seg.exported:
            self.pooled[seg.path] = seg

    def acquire(self, nbytes: int, owner: str, what: str = "", quota: int = 0, preferred: str = "", ring: int = -1, **kw: Any) -> Segment:
        self.preferred.append(preferred)
        seg = self.pooled.pop(preferred, None)
        if seg is not None:
            self.used += seg.size
            return seg
        seg = Segment(f"/fake/shm/seg-{len(self.preferred)}", nbytes, mmap.mmap(-1, nbytes))
        seg.owner, seg.ring = owner, ring
        self.used += nbytes
        return seg


def ring_save(catalog: Catalog, room: Room, step: int, state: ShardState = C, fill: int = 0) -> Entry:
    """Step ``step`` of rank ``RANK`` saved into its ring through ``room`` and settled as ``state``."""
    key = k(step)
    seg = room.acquire(key, 16 * KiB, ring=RANK)
    seg.view(16 * KiB)[:] = bytes([fill or step]) * (16 * KiB)
    entry = Entry(key, 8, 16 * KiB, seg, "h0", ShardState.CAPTURED)
    catalog.commit_lease(catalog.lease_allocation(entry, ahead=False), None, 0, {}, 1, "")
    with catalog.cond:
        entry.state = state
    return entry


def engine() -> tuple[Catalog, RingPool, Recycler, Room]:
    pool = RingPool()
    catalog, _, _ = make_catalog(config(), pool)  # (the store builds a Recycler only under ec: see the last test)
    eviction = Eviction(catalog)
    recycler = Recycler(catalog, eviction, pool, Floors())  # type: ignore[arg-type]
    return catalog, pool, recycler, Room(eviction, pool, catalog.config, recycler)  # type: ignore[arg-type]


def test_a_save_into_a_full_ring_takes_the_oldest_kept_steps_segment() -> None:
    catalog, pool, recycler, room = engine()
    pool.full = False
    one, two = ring_save(catalog, room, 1), ring_save(catalog, room, 2)
    pool.full = True
    assert recycler.take_oldest(k(3), 16 * KiB) is None and catalog.get(k(1)) is one  # step 2 not known restorable everywhere
    recycler.floors.note(JOB, Floor(2, ""))  # every rank saved step 2 (its clients' agreement)
    three = ring_save(catalog, room, 3, state=R)
    assert three.segment is one.segment and pool.preferred[-1] == one.segment.path  # the segment its client has mapped
    assert catalog.get(k(1)) is None and one.dropped and catalog.get(k(2)) is two  # step 1 retired, step 2 kept
    info, done = catalog.wait_settled(k(1), 0.0)
    assert done and info.state is C  # a wait() on it still learns it committed
    assert (recycler.recycled, pool.grown) == (1, [])
    # Step 3 is not committed here yet: the next save finds nothing it may take, and the ring grows for it.
    recycler.floors.note(JOB, Floor(3, ""))
    four = ring_save(catalog, room, 4)
    assert four.segment not in (two.segment, three.segment) and catalog.get(k(2)) is two
    assert (recycler.recycled, pool.grown) == (1, [2])


def test_a_read_oldest_step_stays_and_the_save_gets_another_segment() -> None:
    catalog, pool, recycler, room = engine()
    pool.full = False
    one, _ = ring_save(catalog, room, 1), ring_save(catalog, room, 2)
    pool.full = True
    recycler.floors.note(JOB, Floor(2, ""))
    assert catalog.pin(one)  # a restore's lease, a spill, a rebuild's ReadRange, a pull, a scrub
    three = ring_save(catalog, room, 3, fill=0x33)
    assert three.segment is not one.segment and catalog.get(k(1)) is one and not one.dropped
    assert bytes(one.segment.view(16 * KiB)[:4]) == b"\x01" * 4  # nobody wrote into what the reader reads
    assert (recycler.recycled, recycler.refused, pool.grown) == (0, 1, [2])
    catalog.unpin(one)
    one.segment.exported = True  # a reader mapped it (Open without transient): never reused
    assert recycler.take_oldest(k(4), 16 * KiB) is None and catalog.get(k(1)) is one


class Spilling:
    """The durable tier: step 1 is due for spilling and not spilled yet."""

    def protected_steps(self, job_id: str) -> set[int]:
        return {1}


@pytest.mark.parametrize("why", ["the newest restorable as learnt", "a floor that lags", "due for spilling"])
def test_the_newest_step_every_rank_can_restore_and_steps_due_for_spilling_stay(why: str) -> None:
    catalog, pool, recycler, room = engine()
    pool.full = False
    ring_save(catalog, room, 1)
    ring_save(catalog, room, 2)
    if why == "the newest restorable as learnt":
        room.eviction.learnt_restorable(JOB, (1, ""))  # the janitor's listing: step 1 is the newest every rank settled
    elif why == "a floor that lags":
        recycler.floors.note(JOB, Floor(1, ""))
    else:
        recycler.floors.note(JOB, Floor(2, ""))
        recycler.durable = Spilling()  # type: ignore[assignment]
    assert recycler.take_oldest(k(3), 16 * KiB) is None and catalog.get(k(1)) is not None
    room.eviction.learnt_restorable(JOB, (2, ""))  # learnt by listing, newer than the floor: either will do
    assert (recycler.take_oldest(k(3), 16 * KiB) is None) is (why == "due for spilling")


@pytest.mark.parametrize(("floor", "recycles"), [(2, True), (1, False), (None, False)])
def test_a_floor_in_the_saves_allocate_is_known_before_its_segment_is_chosen(tmp_path, floor: int | None, recycles: bool) -> None:  # type: ignore[no-untyped-def]
    # The client sends this save's agreement with its Allocate (AllocateRequest.restorable_floor): with it the store knows
    # that every rank saved step 2, and the save takes step 1's segment; a floor that lags (or none) leaves step 1 be.
    cli = {"host_id": "h0", "peers": FIVE, "redundancy": "ec:4+1", "keep": "2", "shm_dir": str(tmp_path), "capacity": "8MiB"}
    store = Store(StoreConfig.load(cli, env={}))
    try:
        paths = []
        for step in (1, 2):
            lease, seg = store.allocate(k(step), 8, 16 * KiB)
            store.catalog.commit_lease(lease, None, 0, {}, 1, "")
            with store.catalog.cond:
                store.catalog.get_locked(k(step)).state = C  # type: ignore[union-attr]
            paths.append(seg.path)
        _, seg = store.allocate(k(3), 8, 16 * KiB, restorable_floor=floor)
        assert store.recycler is not None and store.recycler.recycled == int(recycles)
        assert (seg.path == paths[0], store.catalog.get(k(1)) is None) == (recycles, recycles)
        assert store.floors.get(JOB) == (None if floor is None else Floor(floor, ""))
        with pytest.raises(InvalidArgument):  # a floor names a step the save's ranks saved: at most the saved step
            store.allocate(k(4), 8, 16 * KiB, restorable_floor=5)
    finally:
        store.close()


@pytest.mark.parametrize(
    ("redundancy", "keep", "recycles", "limit"),
    [("ec:4+1", 2, True, 2), ("ec:4+1", 3, True, 3), ("ec:4+1", 1, False, 1), ("replicas:2", 2, False, 3), ("replicas:2", 1, False, 2)],
)
def test_only_ec_with_keep_2_or_more_recycles(tmp_path, redundancy: str, keep: int, recycles: bool, limit: int) -> None:  # type: ignore[no-untyped-def]
    # keep 1: recycling the only kept step would leave nothing restorable during a save; under ec its ring still keeps no
    # spare (a save takes a fresh segment, and the kept step's goes back to the kernel once retention drops it).
    # replicas: the ring keeps its spare, reserved ahead after each commit.
    ec = redundancy.startswith("ec:")
    assert saves_recycle(keep, ec) is recycles and reserves_at_save(ec) is ec and ring_limit(keep, ec) == limit
    cli = {"host_id": "h0", "peers": FIVE, "redundancy": redundancy, "keep": str(keep), "shm_dir": str(tmp_path), "capacity": "8MiB"}
    store = Store(StoreConfig.load(cli, env={}))
    try:
        assert (store.rings_recycle, store.recycler is not None, store.pool.ring_limit) == (recycles, recycles, limit)
        assert (store.reserve_at_save, store.pool.pool_past_limit) == (ec, not ec)
        assert store.room.recycler is store.recycler
    finally:
        store.close()
