"""SegmentPool's capture rings: a rank's ring grows to ``ring_limit`` segments, then its saves get back only the segments
its client keeps mapped and registered; replicas, pulls and other ranks never get
them; released segments of a ring over its limit go back to the job's pool; a ring segment is never resized; a
reservation ahead waits for its full ring to free a segment instead of growing it."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from memstore.errors import RingBusy
from memstore.server.memory.pool import NO_RING, PAGE, Segment, SegmentPool, ring_limit
from memstore.server.memory.rings import RING_SLACK

pytestmark = pytest.mark.unit

JOB = "job"
LIMIT = 3  # the ring_limit of the `limited` pool


@pytest.fixture
def full(tmp_path: Path) -> Iterator[SegmentPool]:
    """A pool whose rings are full with one segment: a ring's saves take its own pooled segments from the start."""
    p = SegmentPool(str(tmp_path / "h0-1"), 256 * PAGE, ring_limit=1)
    yield p
    p.close()


@pytest.fixture
def limited(tmp_path: Path) -> Iterator[SegmentPool]:
    p = SegmentPool(str(tmp_path / "h0-2"), 256 * PAGE, ring_limit=LIMIT)
    yield p
    p.close()


def file_size(seg: Segment) -> int:
    assert seg.path is not None
    return os.stat(seg.path).st_size


def paths(segs: list[Segment]) -> list[str]:
    return sorted(s.path for s in segs if s.path)


def test_ring_limit_is_the_kept_steps_and_the_save_in_flight() -> None:
    for keep in (1, 2, 5):
        assert ring_limit(keep) == keep + 1  # the one reserved ahead is the oldest kept step's, once retention frees it


# -- a full ring takes its own back ---------------------------------------------------------------


def test_a_ring_segment_goes_back_to_its_ring_first(full: SegmentPool) -> None:
    ringed = full.acquire(5 * PAGE, JOB, ring=0)
    plain = full.acquire(4 * PAGE, JOB)  # a replica's: smaller, so the better fit by size alone
    assert ringed.ring == 0 and plain.ring == NO_RING
    full.release(plain)
    full.release(ringed)
    assert ringed.ring == 0 and full.ring_paths(JOB, 0) == [ringed.path]  # pooled, still the ring's
    assert full.peek(4 * PAGE, JOB, ring=0) is ringed
    again = full.acquire(4 * PAGE, JOB, ring=0)
    assert again is ringed and again.path == ringed.path and again.ring == 0
    assert full.peek(4 * PAGE, JOB) is plain  # the untagged one is left for the job's replicas


def test_a_ring_short_of_its_limit_reuses_its_own_first_and_grows_only_when_none_is_free(limited: SegmentPool) -> None:
    first = limited.acquire(2 * PAGE, JOB, ring=0)
    limited.release(first)
    again = limited.acquire(2 * PAGE, JOB, ring=0)  # its own pooled segment: no new memory, nothing to register
    assert again is first
    plain = limited.acquire(2 * PAGE, JOB)
    limited.release(plain)
    second = limited.acquire(2 * PAGE, JOB, ring=0)  # none of its own free: the job's untagged segment joins the ring
    assert second is plain and plain.ring == 0
    third = limited.acquire(2 * PAGE, JOB, ring=0)  # nothing pooled: a new segment (the ring is short of its limit)
    assert third not in (first, second) and third.ring == 0
    assert limited.ring_paths(JOB, 0) == paths([first, second, third])
    assert limited.segment_count == LIMIT


def test_a_replica_never_gets_a_pooled_ring_segment(full: SegmentPool) -> None:
    ringed = full.acquire(4 * PAGE, JOB, ring=0)
    full.release(ringed)
    assert full.peek(4 * PAGE, JOB) is None  # NO_RING: nothing pooled it may take
    replica = full.acquire(4 * PAGE, JOB)
    assert replica is not ringed and replica.path != ringed.path and replica.ring == NO_RING  # a fresh one
    full.release(replica)
    again = full.acquire(4 * PAGE, JOB)  # an untagged pooled one is fine for a replica
    assert again is replica and again.ring == NO_RING
    assert full.ring_paths(JOB, 0) == [ringed.path] and ringed.ring == 0  # still the ring's, still pooled
    assert full.acquire(4 * PAGE, JOB, ring=0) is ringed


def test_another_rank_or_job_never_gets_a_ring_segment(full: SegmentPool) -> None:
    ringed = full.acquire(4 * PAGE, JOB, ring=0)
    full.release(ringed)
    other_rank = full.acquire(4 * PAGE, JOB, ring=1)
    other_job = full.acquire(4 * PAGE, "other-job", ring=0)
    assert ringed not in (other_rank, other_job)
    assert ringed.path not in (other_rank.path, other_job.path)
    assert other_rank.ring == 1 and other_job.ring == 0
    assert full.ring_paths(JOB, 1) == [other_rank.path] and full.ring_paths("other-job", 0) == [other_job.path]
    assert full.ring_paths(JOB, 0) == [ringed.path]
    full.release(other_rank)
    assert full.peek(4 * PAGE, JOB, ring=0) is ringed and full.peek(4 * PAGE, JOB, ring=1) is other_rank


def test_ring_paths_lists_in_use_and_pooled_and_drops_a_destroyed_one(limited: SegmentPool) -> None:
    a = limited.acquire(2 * PAGE, JOB, ring=3)
    b = limited.acquire(2 * PAGE, JOB, ring=3)
    limited.acquire(2 * PAGE, JOB)  # no ring
    limited.acquire(2 * PAGE, JOB, ring=4)
    assert limited.ring_paths(JOB, 3) == paths([a, b])
    limited.release(b)  # pooled: still the ring's
    assert limited.ring_paths(JOB, 3) == paths([a, b])
    a.exported = True  # a reader mapped it copy-on-write: released, it is destroyed, not recycled
    limited.release(a)
    assert a.path is not None and not os.path.exists(a.path)
    assert limited.ring_paths(JOB, 3) == [b.path]
    limited.trim()  # the pooled one goes too
    assert limited.ring_paths(JOB, 3) == [] and len(limited.ring_paths(JOB, 4)) == 1
    assert limited.ring_paths("nobody", 3) == []


# -- the ring's size -----------------------------------------------------------------------------------


def test_a_ring_within_its_limit_never_loses_a_segment(limited: SegmentPool) -> None:
    ring = [limited.acquire(2 * PAGE, JOB, ring=0) for _ in range(LIMIT)]
    held = paths(ring)
    for _ in range(3 * LIMIT):  # steady state: the oldest step goes, the next save comes
        oldest = ring.pop(0)
        limited.release(oldest)
        assert oldest.ring == 0
        nxt = limited.acquire(2 * PAGE, JOB, ring=0)
        assert nxt is oldest  # its client has it mapped and registered: nothing new to register
        ring.append(nxt)
    assert limited.ring_paths(JOB, 0) == held and limited.segment_count == LIMIT


def test_a_ring_with_none_of_its_own_free_grows_at_once(limited: SegmentPool) -> None:
    """Retention running late: the ring grows (off the save's path: the client reserves ahead) instead of waiting."""
    ring = [limited.acquire(2 * PAGE, JOB, ring=0) for _ in range(LIMIT)]
    started = time.monotonic()
    grown = limited.acquire(2 * PAGE, JOB, ring=0)
    assert grown not in ring and grown.ring == 0 and time.monotonic() - started < 1.0
    assert limited.ring_paths(JOB, 0) == paths([*ring, grown])


def test_released_segments_of_a_ring_over_its_limit_go_to_the_job(limited: SegmentPool) -> None:
    segs = [limited.acquire(2 * PAGE, JOB, ring=0) for _ in range(LIMIT + 2)]  # a burst: retention fell behind
    assert limited.ring_paths(JOB, 0) == paths(segs)
    for seg in segs:
        limited.release(seg)
    untagged = [s for s in segs if s.ring == NO_RING]
    tagged = [s for s in segs if s.ring == 0]
    assert segs[:2] == untagged  # those released while the rest of the ring held its limit
    assert limited.ring_paths(JOB, 0) == paths(tagged) and len(tagged) == LIMIT
    assert limited.segment_count == len(segs)  # still pooled, for the job's other saves and its replicas
    replica = limited.acquire(2 * PAGE, JOB)  # a replica may take an untagged one; the ring's saves get the ring's own
    assert replica in untagged and replica.ring == NO_RING
    assert limited.acquire(2 * PAGE, JOB, ring=0) in tagged


def test_a_recycling_ring_frees_what_it_grew_by(tmp_path: Path) -> None:
    """ec:K+M rings (pool_past_limit=False) keep no spare: a segment released while the ring is over its limit goes back
    to the kernel, and the ring keeps its limit's segments pooled."""
    pool = SegmentPool(str(tmp_path / "h0-3"), 256 * PAGE, ring_limit=2, pool_past_limit=False)
    try:
        segs = [pool.acquire(2 * PAGE, JOB, ring=0) for _ in range(3)]  # a save came before the oldest kept step could go
        pool.release(segs[0])  # retention drops the oldest kept step: the ring is over its limit without it
        assert segs[0].ring == NO_RING and pool.segment_count == 2 and pool.pooled_bytes == 0
        pool.release(segs[1])  # back within its limit: pooled for the ring's next save
        assert segs[1].ring == 0 and pool.pooled_bytes == segs[1].size
        assert pool.ring_paths(JOB, 0) == paths(segs[1:])
    finally:
        pool.close()


def test_at_keep_1_under_ec_the_kept_steps_segment_goes_back_to_the_kernel_though_its_client_maps_it(tmp_path: Path) -> None:
    """ec:K+M at --keep 1 (ring_limit 1, no spare): a save takes a fresh segment beside the kept step's; once retention
    drops the kept step its segment leaves the ring and its pages are freed at once, although the client still maps the
    file until its next Allocate. A lease given back (or expired, or a shard dropped in flight: its client may still write)
    is only unlinked."""
    pool = SegmentPool(str(tmp_path / "h0-4"), 256 * PAGE, ring_limit=ring_limit(1, at_save=True), pool_past_limit=False)
    try:
        kept = pool.acquire(4 * PAGE, JOB, ring=0)
        assert kept.path is not None
        fd = os.open(kept.path, os.O_RDWR)  # the client's mapping of the kept step's segment
        try:
            newer = pool.acquire(4 * PAGE, JOB, ring=0)  # the next save: nothing free in the ring, which grows beside it
            assert newer is not kept and pool.used_bytes == kept.size + newer.size
            pool.release(kept, written=True)  # retention drops the kept step (settled) once the newer one committed
            assert (kept.ring, newer.ring, pool.used_bytes, pool.pooled_bytes) == (NO_RING, 0, newer.size, 0)
            assert os.fstat(fd).st_size == 0 and os.fstat(fd).st_blocks == 0  # its pages are the kernel's again
            assert pool.ring_paths(JOB, 0) == paths([newer])
        finally:
            os.close(fd)
        lease = pool.acquire(4 * PAGE, JOB, ring=0)  # a save's lease beside the kept step, given back
        assert lease.path is not None
        fd = os.open(lease.path, os.O_RDWR)
        try:
            pool.release(lease)  # (not written: its client might still be writing into it)
            assert os.fstat(fd).st_size == lease.size and pool.used_bytes == newer.size  # unlinked, not emptied
        finally:
            os.close(fd)
    finally:
        pool.close()


def test_ring_full_at_its_limit_with_nothing_free_and_growth_past_the_slack_counted(limited: SegmentPool) -> None:
    ring = [limited.acquire(2 * PAGE, JOB, ring=0) for _ in range(LIMIT - 1)]
    assert limited.ring_full(JOB, 0) == 0  # short of its limit
    ring.append(limited.acquire(2 * PAGE, JOB, ring=0))
    assert limited.ring_full(JOB, 0) == LIMIT and limited.ring_full(JOB, 1) == 0
    limited.release(ring[0])
    assert limited.ring_full(JOB, 0) == 0  # one of its own is free again
    limited.count_growth(JOB, 0, LIMIT)  # within the slack: not an overflow
    assert limited.ring_overflows == 0
    limited.count_growth(JOB, 0, LIMIT + RING_SLACK)
    assert limited.ring_overflows == 1


def test_a_reservation_ahead_waits_for_its_full_ring_to_free_a_segment(limited: SegmentPool) -> None:
    """The peak stays at the kept steps plus the save in flight: the next save's segment is the one retention frees."""
    ring = [limited.acquire(2 * PAGE, JOB, ring=0) for _ in range(LIMIT)]
    freed = threading.Timer(0.2, limited.release, args=(ring[0],))
    freed.start()
    try:
        ahead = limited.acquire(2 * PAGE, JOB, ring=0, wait=20.0)
    finally:
        freed.join()
    assert ahead is ring[0] and limited.segment_count == LIMIT


def test_a_segment_being_made_for_a_ring_counts_as_its_member(limited: SegmentPool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reservation ahead that comes while the ring's fill makes its last segment waits for that one: it makes no
    other beside it (two fresh segments made at once take twice the memory, each at half the speed)."""
    ring = [limited.acquire(2 * PAGE, JOB, ring=0) for _ in range(LIMIT - 1)]  # the kept steps, in use
    create, started, go = limited.maker.create, threading.Event(), threading.Event()

    def slow_create(*args: object, **kw: object) -> Segment:
        started.set()
        assert go.wait(10)
        return create(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(limited.maker, "create", slow_create)
    made: list[Segment] = []
    fill = threading.Thread(target=lambda: made.append(limited.acquire(2 * PAGE, JOB, ring=0, grow=True)))
    fill.start()
    assert started.wait(10)
    monkeypatch.setattr(limited.maker, "create", create)
    with pytest.raises(RingBusy):  # the ring is at its limit with the one being made: the fill may add no other
        limited.acquire(2 * PAGE, JOB, ring=0, grow=True)
    go.set()
    fill.join()
    threading.Timer(0.1, limited.release, args=(made[0],)).start()  # the fill's client maps it and gives it back
    ahead = limited.acquire(2 * PAGE, JOB, ring=0, wait=10.0)
    assert ahead is made[0] and limited.segment_count == LIMIT and ring[0] is not ahead


def test_a_reservation_ahead_that_waits_in_vain_is_refused_and_takes_nothing(limited: SegmentPool) -> None:
    [limited.acquire(2 * PAGE, JOB, ring=0) for _ in range(LIMIT)]
    with pytest.raises(RingBusy, match="capture ring of job 'job' rank 0 holds 3 segments"):
        limited.acquire(2 * PAGE, JOB, ring=0, wait=0.05)
    assert limited.segment_count == LIMIT
    assert limited.acquire(2 * PAGE, JOB, ring=1, wait=0.05).ring == 1  # another rank's ring is not full: no wait


# -- sizes ------------------------------------------------------------------------------------------


def test_a_ring_segment_is_never_resized(full: SegmentPool) -> None:
    seg = full.acquire(8 * PAGE, JOB, ring=0)
    path, size = seg.path, seg.size
    assert size == 8 * PAGE == file_size(seg)
    full.release(seg)

    smaller = full.acquire(7 * PAGE, JOB, ring=0)  # within the 25% reuse slack: the same segment, at its size
    assert smaller is seg and smaller.size == size and file_size(seg) == size
    full.release(smaller)

    bigger = full.acquire(9 * PAGE, JOB, ring=0)  # does not fit: another segment, this one left as it is
    assert bigger.path != path and bigger.size == 9 * PAGE
    assert seg.size == size and file_size(seg) == size

    tiny = full.acquire(2 * PAGE, JOB, ring=0)  # far smaller: it would waste too much, so another one too
    assert tiny.path not in (path, bigger.path) and tiny.size == 2 * PAGE
    assert seg.size == size and file_size(seg) == size
    assert full.ring_paths(JOB, 0) == paths([seg, bigger, tiny])
    assert full.peek(7 * PAGE, JOB, ring=0) is seg  # still pooled, for the next save of its size


def test_filling_a_ring_stops_at_its_limit(limited: SegmentPool) -> None:
    """The client's fill (``grow``) and its reservation ahead run on two threads: whichever comes second past the limit
    is refused, so the ring never holds a segment more than it needs."""
    [limited.acquire(2 * PAGE, JOB, ring=0, grow=True) for _ in range(LIMIT)]
    with pytest.raises(RingBusy, match="already holds its 3 segments"):
        limited.acquire(2 * PAGE, JOB, ring=0, grow=True)
    assert limited.segment_count == LIMIT
