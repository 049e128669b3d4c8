"""trainer_client.capture.ring.CaptureRing against a fake store (segment files in a temp dir) and the fake CUDA runtime:
the lease reserved ahead, exact-size mappings, pruning by the newest answer, and a save that never waits for the
ring's threads."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from memstore.v1 import store_pb2 as pb
from tests.harness.fake_cuda import FakeCudaRuntime
from trainer_client.capture.ring import AHEAD_WAIT_SECONDS, CaptureRing

pytestmark = pytest.mark.unit
PAGE = 4096
KEY = pb.ShardKey(job_id="j", step=1, rank=0)


class FakeStore:
    """Hands out segment files; the ring is every segment it made (``ring`` overrides what it lists)."""

    def __init__(self, directory: Path, file_bytes: int = 0) -> None:
        self.directory = directory
        self.file_bytes = file_bytes  # > segment_bytes: a file longer than the allocation (a reserve segment not trimmed yet)
        self.paths: list[str] = []
        self.ring: list[str] | None = None
        self.requests: list[pb.AllocateRequest] = []
        self.released: list[str] = []
        self.hold = threading.Event()
        self.hold.set()

    def allocate(self, request: pb.AllocateRequest) -> pb.AllocateResponse:
        self.hold.wait(10)
        self.requests.append(request)
        path = str(self.directory / f"seg-{len(self.paths)}")
        size = -(-request.nbytes // PAGE) * PAGE
        Path(path).write_bytes(b"\0" * max(size, self.file_bytes))
        self.paths.append(path)
        ring = self.paths if self.ring is None else [*self.ring, path]
        return pb.AllocateResponse(
            lease_id=f"lease-{len(self.paths)}", segment_path=path, segment_bytes=size, ring_paths=ring, lease_seconds=600, ring_limit=3
        )

    def release(self, lease_id: str) -> None:
        self.released.append(lease_id)


@pytest.fixture
def store(tmp_path: Path) -> FakeStore:
    return FakeStore(tmp_path)


def make_ring(store: FakeStore, ahead: Any = None) -> CaptureRing:
    return CaptureRing(store.allocate, store.release, ahead)


def test_a_save_takes_the_lease_reserved_ahead_without_a_call(store: FakeStore, fake_cuda: FakeCudaRuntime) -> None:
    ring = make_ring(store)
    ring.pinning = True
    ring.reserve_ahead(KEY, 1, 3 * PAGE, grow=False)
    ring.wait_ahead()
    calls = len(store.requests)
    slot = ring.slot(KEY, 1, 3 * PAGE)
    assert len(store.requests) == calls and slot.ahead and slot.pinned
    assert store.requests[0].ahead and not store.requests[0].grow
    assert fake_cuda.registrations == 1
    ring.close()
    assert fake_cuda.live == {}


def test_a_segment_is_mapped_at_exactly_its_allocated_size(tmp_path: Path, fake_cuda: FakeCudaRuntime) -> None:
    store = FakeStore(tmp_path, file_bytes=8 * PAGE)  # the file is longer: the store trims it later
    ring = make_ring(store)
    ring.pinning = True
    slot = ring.slot(KEY, 1, 2 * PAGE)
    assert len(slot.mm) == slot.size == 2 * PAGE
    ((size, _),) = fake_cuda.live.values()
    assert size == 2 * PAGE
    Path(slot.path).write_bytes(b"\0" * 2 * PAGE)  # the store trims it to the allocation: nothing registered past its end
    ring.close()
    assert fake_cuda.failures == []


def test_only_the_newest_answer_prunes_and_never_a_leased_segment(store: FakeStore, fake_cuda: FakeCudaRuntime) -> None:
    ring = make_ring(store)
    first = ring.slot(KEY, 1, PAGE)
    store.ring = []  # the store now lists nothing but the new segment
    second = ring.slot(KEY, 1, PAGE)
    assert first.path in ring.mapped_paths, "a segment this client holds a lease on is never unmapped"
    ring.committed(first)
    ring.committed(second)
    third = ring.slot(KEY, 1, PAGE)
    assert ring.mapped_paths == [third.path]  # the others left the ring: unmapped once no lease held them
    ring.close()


def test_a_late_answer_to_an_older_request_does_not_prune(store: FakeStore, fake_cuda: FakeCudaRuntime) -> None:
    ring = make_ring(store)
    old = ring._next_seq()
    stale = store.allocate(pb.AllocateRequest(key=KEY, world_size=1, nbytes=PAGE))  # answered first, listing seg-0 only
    newer = ring.slot(KEY, 1, PAGE)  # sent later: its answer lists seg-0 and seg-1
    ring.committed(newer)
    store.ring = []
    late = ring._adopt(stale, PAGE, ahead=False, seq=old)  # arrives last: it must not unmap seg-1
    assert newer.path in ring.mapped_paths and late.path in ring.mapped_paths
    ring.close()


def test_a_save_never_waits_for_a_registration_on_the_rings_threads(store: FakeStore, fake_cuda: FakeCudaRuntime) -> None:
    """The ring's fill thread registers (0.06-0.5 s per GiB on a GPU) outside the ring's lock: a save that finds its
    lease reserved takes it at once."""
    ring = make_ring(store)
    ring.pinning = True
    ring.reserve_ahead(KEY, 1, PAGE, grow=False)
    ring.wait_ahead()
    gate, entered = threading.Event(), threading.Event()
    register = fake_cuda.host_register

    def slow_register(addr: int, size: int, flags: int) -> int:
        entered.set()
        gate.wait(10)
        return register(addr, size, flags)

    fake_cuda.host_register = slow_register  # type: ignore[method-assign]
    filler = threading.Thread(target=lambda: ring._reserve(pb.ShardKey(job_id="j", rank=0), 1, PAGE, grow=True))
    filler.start()
    try:
        assert entered.wait(10)
        started = time.monotonic()
        slot = ring.slot(KEY, 1, PAGE)
        assert time.monotonic() - started < 1.0 and slot.ahead and slot.pinned
    finally:
        gate.set()
        filler.join(10)
    ring.close()
    assert fake_cuda.live == {}


def test_the_fill_stops_when_the_store_keeps_no_more(store: FakeStore, fake_cuda: FakeCudaRuntime) -> None:
    """A store whose pool cannot keep the ring's segments (each given back is destroyed) must not be asked forever."""
    store.ring = []  # every answer lists only the segment it hands out: the ring never grows
    ring = make_ring(store)
    ring.prepare(KEY, 1, PAGE)
    assert len(store.requests) <= 3 and all(r.ahead for r in store.requests)
    ring.close()


def test_a_reservation_ahead_asks_again_while_the_ring_is_busy_and_close_stops_it(store: FakeStore) -> None:
    # The store answers ring_busy (its ring full until the newest save settles) twice, then a lease: the reservation
    # asks again and the next save takes it without a call.
    busy = {"left": 2}
    allocate = store.allocate

    def ahead(request: pb.AllocateRequest) -> pb.AllocateResponse:
        if busy["left"] > 0:
            busy["left"] -= 1
            return pb.AllocateResponse(ring_busy=True, ring_paths=store.paths, ring_limit=3)
        return allocate(request)

    ring = make_ring(store, ahead)
    ring.reserve_ahead(KEY, 1, PAGE, grow=False)
    ring.wait_ahead(timeout=10)
    calls = len(store.requests)
    assert ring.slot(KEY, 1, PAGE).ahead and len(store.requests) == calls == 1 and busy["left"] == 0
    ring.close()

    # A ring that stays busy: close() stops the reservation at once (it never waits out the client's deadline).
    asked = threading.Event()

    def always_busy(request: pb.AllocateRequest) -> pb.AllocateResponse:
        asked.set()
        return pb.AllocateResponse(ring_busy=True, ring_limit=3)  # (a real store waits AHEAD_POLL_SECONDS first)

    ring = make_ring(store, always_busy)
    ring.reserve_ahead(KEY, 1, PAGE, grow=False)
    assert asked.wait(10)
    t0 = time.monotonic()
    ring.close()
    assert time.monotonic() - t0 < AHEAD_WAIT_SECONDS / 4


def test_a_save_waits_for_the_reservation_under_way_only_while_the_ring_warms_up(store: FakeStore) -> None:
    """Warming up (fewer segments than the ring's limit), the store never waits for retention: a reservation it has not
    answered yet is making this save's segment, and a save that made its own beside it would hold twice the memory and
    wait for both. Once warm, an unanswered reservation waits for retention, and the save allocates at once."""
    answer = threading.Event()

    def ahead(request: pb.AllocateRequest) -> pb.AllocateResponse:
        assert answer.wait(10)
        return store.allocate(request)

    ring = make_ring(store, ahead)
    ring.committed(ring.slot(KEY, 1, PAGE))  # the first save: the ring holds 1 of its 3 segments
    ring.reserve_ahead(KEY, 1, PAGE, grow=False)
    threading.Timer(0.3, answer.set).start()
    slot = ring.slot(KEY, 1, PAGE)
    assert slot.ahead and len(store.requests) == 2  # the first save's and the reservation's: none of its own
    ring.committed(slot)

    store.ring = [*store.paths, "other"]  # the store lists 3 segments from now on: the ring is warm
    ring.committed(ring.slot(KEY, 1, PAGE))
    answer.clear()
    ring.reserve_ahead(KEY, 1, PAGE, grow=False)
    started = time.monotonic()
    slot = ring.slot(KEY, 1, PAGE)
    assert not slot.ahead and time.monotonic() - started < 1.0  # allocated at once; the reservation stays for the next
    answer.set()
    ring.close()


class RecyclingStore:
    """A store under ec:K+M with keep 2 (``AllocateResponse.reserve_at_save``): the ring holds 2 segments; a save takes a
    free one, else the segment of the oldest step its ring holds (which the store retires then)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.ring: list[str] = []
        self.free: list[str] = []
        self.holding: list[str] = []  # segments holding a kept step, the oldest first
        self.leases: dict[str, str] = {}
        self.requests: list[pb.AllocateRequest] = []

    def allocate(self, request: pb.AllocateRequest) -> pb.AllocateResponse:
        self.requests.append(request)
        if request.grow and len(self.ring) >= 2:
            raise RuntimeError("the ring is full")  # (RingBusy)
        if not request.grow and self.free:
            path = self.free.pop(0)
        elif not request.grow and len(self.ring) >= 2:
            if request.ahead:
                return pb.AllocateResponse(ring_busy=True, ring_paths=self.ring, ring_limit=2, reserve_at_save=True)
            path = self.holding.pop(0)  # the oldest kept step retired: its segment for this save
        else:
            path = str(self.directory / f"seg-{len(self.ring)}")
            Path(path).write_bytes(b"\0" * PAGE)
            self.ring.append(path)
        lease = f"lease-{len(self.requests)}"
        self.leases[lease] = path
        return pb.AllocateResponse(
            lease_id=lease, segment_path=path, segment_bytes=PAGE, ring_paths=self.ring, lease_seconds=600, ring_limit=2,
            reserve_at_save=True,
        )  # fmt: skip

    def release(self, lease_id: str) -> None:
        self.free.append(self.leases.pop(lease_id))

    def commit(self, request: pb.CommitRequest, what: str) -> None:
        self.holding.append(self.leases.pop(request.lease_id))


def test_when_the_store_takes_segments_at_save_time_nothing_is_reserved_ahead_and_nothing_mapped_anew(
    tmp_path: Path, fake_cuda: FakeCudaRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer_client.capture import ring as ring_module
    from trainer_client.capture.ring import Handover

    mappings: list[str] = []
    map_segment = ring_module.map_segment
    monkeypatch.setattr(ring_module, "map_segment", lambda path, size: mappings.append(path) or map_segment(path, size))
    store = RecyclingStore(tmp_path)
    ring = CaptureRing(store.allocate, store.release, commit=store.commit)
    ring.pinning = True
    for step in range(1, 6):
        key = pb.ShardKey(job_id="j", step=step, rank=0)
        slot = ring.take(key, 1, PAGE)
        ring.commit(slot, Handover(key, 1, pb.CommitRequest(), time.perf_counter()))
    ring.wait_ahead(timeout=10)
    # Saves 3, 4 and 5 took the oldest kept step's segment; none was reserved ahead (that would retire a kept step
    # while the job is idle), only the ring's fill (grow) asked ahead.
    assert [r.ahead for r in store.requests if not r.grow] == [False] * 5 and ring.ahead_path() == ""
    assert sorted(mappings) == sorted(store.ring) == ring.mapped_paths and len(store.ring) == 2  # each mapped once
    assert fake_cuda.registrations == 2  # and registered once: no mapping nor registration in a save's path once warm
    ring.close()
    assert fake_cuda.live == {}


def test_a_save_whose_store_takes_its_segment_at_save_time_sends_its_floor_with_the_allocate(tmp_path: Path) -> None:
    # The store may retire the rank's oldest kept step for this save only below a step every rank saved: the Allocate
    # carries the floor this save's agreement found (PlannedShard.allocate_floor), read only in that mode.
    from trainer_client.capture.ring import Handover

    store = RecyclingStore(tmp_path)
    ring = CaptureRing(store.allocate, store.release, commit=store.commit)
    read: list[int] = []

    def floor(step: int) -> tuple[int, str] | None:
        read.append(step)
        return (step - 1, "") if step > 1 else None

    for step in range(1, 5):
        key = pb.ShardKey(job_id="j", step=step, rank=0)
        slot = ring.take(key, 1, PAGE, floor=lambda step=step: floor(step))  # type: ignore[misc]
        ring.commit(slot, Handover(key, 1, pb.CommitRequest(), time.perf_counter()))
    ring.wait_ahead(timeout=10)
    saves = [r for r in store.requests if not r.ahead]
    # The first save learnt the mode from its answer: it read nothing; the later ones sent the step before theirs.
    assert read == [2, 3, 4] and [r.restorable_floor if r.HasField("restorable_floor") else None for r in saves] == [None, 1, 2, 3]
    ring.close()


class KeepOneStore:
    """A store under ec:K+M with keep 1 (``reserve_at_save``, ``ring_limit`` 1): every save gets a fresh segment beside
    the kept step's, which leaves the ring (the store frees it) once the newer save commits (retention drops its step)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.ring: list[str] = []
        self.leases: dict[str, str] = {}
        self.requests: list[pb.AllocateRequest] = []

    def allocate(self, request: pb.AllocateRequest) -> pb.AllocateResponse:
        self.requests.append(request)
        if request.grow and self.ring:
            raise RuntimeError("the ring is full")  # (RingBusy)
        path = str(self.directory / f"seg-{len(self.requests)}")
        Path(path).write_bytes(b"\0" * PAGE)
        self.ring.append(path)
        self.leases[lease := f"lease-{len(self.requests)}"] = path
        return pb.AllocateResponse(
            lease_id=lease, segment_path=path, segment_bytes=PAGE, ring_paths=self.ring, lease_seconds=600, ring_limit=1,
            reserve_at_save=True,
        )  # fmt: skip

    def release(self, lease_id: str) -> None:
        self.leases.pop(lease_id)

    def commit(self, request: pb.CommitRequest, what: str) -> None:
        kept = self.leases.pop(request.lease_id)
        for path in [p for p in self.ring if p != kept]:  # retention drops the step before: its segment leaves the ring
            self.ring.remove(path)
            os.unlink(path)


def test_at_keep_1_under_ec_each_save_maps_a_fresh_segment_reads_no_floor_and_drops_the_old_mapping(tmp_path: Path) -> None:
    # No kept step is retired for a save from a ring of one: the save does not wait for its floor agreement; nothing is
    # reserved ahead (a spare would cost a whole shard); the kept step's mapping goes at the next Allocate.
    from trainer_client.capture.ring import Handover

    store = KeepOneStore(tmp_path)
    ring = CaptureRing(store.allocate, store.release, commit=store.commit)
    read: list[int] = []
    for step in range(1, 5):
        key = pb.ShardKey(job_id="j", step=step, rank=0)
        slot = ring.take(key, 1, PAGE, floor=lambda step=step: read.append(step) or (step - 1, ""))  # type: ignore[misc]
        # mapped: the kept step's and this save's fresh segment; the one before them (gone with its step) was dropped
        assert ring.mapped_paths == sorted(store.ring) and slot.path == store.ring[-1] and len(store.ring) <= 2
        ring.commit(slot, Handover(key, 1, pb.CommitRequest(), time.perf_counter()))
    ring.wait_ahead(timeout=10)
    assert read == [] and not any(r.HasField("restorable_floor") for r in store.requests)
    assert [r.ahead for r in store.requests] == [False] * 4 and ring.ahead_path() == ""
    ring.close()


def test_a_ring_that_reserves_ahead_never_reads_the_floor(store: FakeStore) -> None:
    ring = make_ring(store)
    read: list[int] = []
    slot = ring.slot(KEY, 1, PAGE, floor=lambda: read.append(1) or (0, ""))  # type: ignore[func-returns-value]
    assert not slot.ahead and read == [] and not store.requests[0].HasField("restorable_floor")  # replicas: no wait
    ring.close()
