"""The Catalog alone, over a fake segment pool: newest wins, lease binding, pins, sidecars, waits (deletes and retention:
test_eviction.py; pulls and arrivals: test_arrivals.py)."""

from __future__ import annotations

import time

import pytest

from memstore.core.model import ShardKey, ShardState
from memstore.errors import AlreadySaved, InvalidArgument, LeaseError, ShardNotFound, UnknownJob
from memstore.server.convert import sidecar_info
from tests.unit.engine_fakes import captured, commit, make_catalog, settled

pytestmark = pytest.mark.unit
DATA = bytes(range(256)) * 32  # 8 KiB: two chunks


def key(step: int, rank: int = 0, job: str = "job") -> ShardKey:
    return ShardKey(job, step, rank)


def test_a_newer_save_supersedes_older_captures_replication_has_not_taken_up() -> None:
    catalog, pool, _ = make_catalog()
    first = commit(catalog, key(1), DATA)
    other_rank = commit(catalog, key(1, rank=1), DATA)
    commit(catalog, key(2), DATA)
    assert first.dropped and first.superseded and first.copies == 0 and catalog.saves_superseded == 1
    assert first.segment in pool.released and not other_rank.dropped  # newest wins per rank only
    info, done = catalog.wait_settled(key(1), time.monotonic())  # its client's wait() learns how it ended
    assert done and info.superseded and "newest wins" in info.error and info.state is ShardState.UNDER_REPLICATED


def test_a_capture_replication_took_up_is_never_superseded() -> None:
    catalog, _, _ = make_catalog()
    first = commit(catalog, key(1), DATA)
    assert catalog.take_up(first)
    commit(catalog, key(2), DATA)
    assert not first.dropped and catalog.saves_superseded == 0
    late = commit(catalog, key(3), DATA)
    commit(catalog, key(4), DATA)
    assert not catalog.take_up(late)  # superseded before replication came to it: it is skipped


def test_leases_bind_to_their_shard_at_commit() -> None:
    catalog, pool, _ = make_catalog()
    with pytest.raises(LeaseError):
        catalog.commit_lease("nope", None, 0, {}, 1, "")
    lease = catalog.lease_allocation(captured(catalog, key(0, rank=3), DATA), ahead=True)
    with pytest.raises(InvalidArgument, match="needs the shard's key"):
        catalog.commit_lease(lease, None, 0, {}, 1, "")
    with pytest.raises(InvalidArgument, match="ahead lease is rank 3"):
        catalog.commit_lease(lease, key(5, rank=4), len(DATA), {}, 1, "")
    with pytest.raises(InvalidArgument, match="segment holds"):
        catalog.commit_lease(lease, key(5, rank=3), len(DATA) + 1, {}, 1, "")
    entry = catalog.commit_lease(lease, key(5, rank=3), 100, {"loss": 1.0}, 1, "")  # names its step now, and a smaller size
    assert entry.key == key(5, rank=3) and entry.nbytes == 100 and catalog.get(key(5, rank=3)) is entry
    plain = catalog.lease_allocation(captured(catalog, key(6), DATA), ahead=False)
    with pytest.raises(InvalidArgument, match="lease holds"):
        catalog.commit_lease(plain, key(7), 0, {}, 1, "")
    twin = catalog.lease_allocation(captured(catalog, key(6), DATA), ahead=False)
    catalog.commit_lease(plain, None, 0, {}, 1, "")
    used = pool.used
    with pytest.raises(AlreadySaved):  # two captures of one shard: the second commit loses and frees its memory
        catalog.commit_lease(twin, None, 0, {}, 1, "")
    assert pool.used == used - len(DATA)


def test_a_dropped_entry_keeps_its_segment_until_the_last_pin_goes() -> None:
    catalog, pool, _ = make_catalog()
    entry = settled(catalog, key(1), DATA)
    lease = catalog.lease_reader(entry) if catalog.pin(entry) else ""
    catalog.drop(entry, "deleted")
    assert entry.dropped and entry.segment not in pool.released and not catalog.pin(entry)
    catalog.release_lease(lease)
    assert entry.segment in pool.released
    with pytest.raises(UnknownJob):
        catalog.readable(key(1))


def test_waits_end_at_their_deadline_or_when_the_store_stops() -> None:
    catalog, _, stop = make_catalog()
    entry = commit(catalog, key(1), DATA)
    info, done = catalog.wait_settled(key(1), time.monotonic() + 0.01)
    assert not done and info.state is ShardState.CAPTURED
    with pytest.raises(ShardNotFound, match="still being captured"):
        catalog.readable(key(1), wait=0.01)
    stop.set()
    assert catalog.wait_settled(key(1), time.monotonic() + 60) == (entry.info(), False)
    with pytest.raises(ShardNotFound):
        catalog.wait_settled(key(9), time.monotonic())


def test_a_settled_copy_is_described_next_to_its_segment_and_a_capture_is_not() -> None:
    catalog, pool, _ = make_catalog()
    capture = commit(catalog, key(1), DATA)
    assert id(capture.segment) not in pool.described  # not verified: a restart must not adopt it
    good = settled(catalog, key(2), DATA)
    assert sidecar_info(pool.described[id(good.segment)]) == good.info()


def test_the_catalog_is_busy_while_a_save_is_copied_in_or_a_shard_replicated() -> None:
    """Its part of what the spill tier, the reserve's faulting and the scrub yield to (``Store.foreground_busy``): an
    open allocation and a replication, each alone (pulls: test_arrivals.py; open transfers: test_admission.py)."""
    catalog, _, _ = make_catalog()
    assert not catalog.busy()
    lease = catalog.lease_allocation(captured(catalog, key(1), DATA), ahead=False)
    assert catalog.busy()
    catalog.release_lease(lease)
    assert not catalog.busy()
    catalog.lease_allocation(captured(catalog, key(2), DATA), ahead=True)  # memory reserved ahead: nothing moves yet
    assert not catalog.busy()
    catalog.add_in_flight(1)
    assert catalog.busy()
    catalog.add_in_flight(-1)
    assert not catalog.busy()
