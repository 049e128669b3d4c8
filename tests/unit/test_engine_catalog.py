"""The Catalog alone, over a fake segment pool: newest wins, lease binding, pins, pressure, streams, tickets, retention."""

from __future__ import annotations

import time

import pytest

from memstore.core.model import PutOrigin, ShardKey, ShardState
from memstore.errors import AlreadySaved, CapacityExceeded, InvalidArgument, LeaseError, ShardNotFound, TooManyStreams, UnknownJob
from memstore.server.convert import sidecar_bytes
from memstore.server.entries import Inbound, Ticket
from tests.unit.engine_fakes import KiB, captured, commit, config, make_catalog, manifest_of, settled

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
        catalog.commit_lease("nope", None, 0, {}, 1, "", None)
    lease = catalog.lease_allocation(captured(catalog, key(0, rank=3), DATA), ahead=True)
    with pytest.raises(InvalidArgument, match="needs the shard's key"):
        catalog.commit_lease(lease, None, 0, {}, 1, "", None)
    with pytest.raises(InvalidArgument, match="ahead lease is rank 3"):
        catalog.commit_lease(lease, key(5, rank=4), len(DATA), {}, 1, "", None)
    with pytest.raises(InvalidArgument, match="segment holds"):
        catalog.commit_lease(lease, key(5, rank=3), len(DATA) + 1, {}, 1, "", None)
    entry = catalog.commit_lease(lease, key(5, rank=3), 100, {"loss": 1.0}, 1, "", None)  # names its step now, and a smaller size
    assert entry.key == key(5, rank=3) and entry.nbytes == 100 and catalog.get(key(5, rank=3)) is entry
    plain = catalog.lease_allocation(captured(catalog, key(6), DATA), ahead=False)
    with pytest.raises(InvalidArgument, match="lease holds"):
        catalog.commit_lease(plain, key(7), 0, {}, 1, "", None)
    twin = catalog.lease_allocation(captured(catalog, key(6), DATA), ahead=False)
    catalog.commit_lease(plain, None, 0, {}, 1, "", None)
    used = pool.used
    with pytest.raises(AlreadySaved):  # two captures of one shard: the second commit loses and frees its memory
        catalog.commit_lease(twin, None, 0, {}, 1, "", None)
    assert pool.used == used - len(DATA)


def test_a_dropped_entry_keeps_its_segment_until_the_last_pin_goes() -> None:
    catalog, pool, _ = make_catalog()
    entry = settled(catalog, key(1), DATA)
    lease = catalog.lease_reader(entry) if catalog.pin(entry) else ""
    assert catalog.delete("job", -1, -1) == 1
    assert entry.dropped and entry.segment not in pool.released and not catalog.pin(entry)
    catalog.release_lease(lease)
    assert entry.segment in pool.released
    with pytest.raises(UnknownJob):
        catalog.readable(key(1))


def test_pressure_drops_older_copies_of_the_job_but_never_its_newest_settled_step() -> None:
    catalog, pool, _ = make_catalog(config(capacity="32KiB"))
    old = settled(catalog, key(1), DATA, created=1.0)
    settled(catalog, key(2), DATA, created=2.0)
    settled(catalog, key(3), DATA, created=3.0)
    seg = catalog.acquire(key(4), 10 * KiB)  # needs two of the older steps gone
    assert old.dropped and catalog.get(key(3)) is not None and seg.size == 10 * KiB
    with pytest.raises(CapacityExceeded):
        catalog.acquire(key(5), 30 * KiB)  # only by dropping step 3, the newest settled: refused, nothing dropped
    assert catalog.get(key(3)) is not None
    with pytest.raises(CapacityExceeded):
        catalog.acquire(key(5), 20 * KiB, evict=False)  # memory reserved ahead never drops a step
    assert pool.used <= pool.capacity


def test_inbound_transfers_count_against_their_sender_and_give_their_slot_back() -> None:
    catalog, pool, _ = make_catalog(config(max_streams_per_peer="2"))
    inbound = []
    for rank in (0, 1):
        catalog.admit_inbound(key(1, rank), "peer:h1", client=False)
        m = manifest_of(key(1, rank), DATA, owner="h1")
        inbound.append(Inbound(key(1, rank), m, PutOrigin.REPLICA, pool.acquire(8 * KiB, "job"), "peer:h1"))
    with pytest.raises(TooManyStreams) as err:
        catalog.admit_inbound(key(1, 2), "peer:h1", client=False)
    assert (err.value.active, err.value.max_streams) == (2, 2)
    catalog.admit_inbound(key(1, 2), "peer:h2", client=False)  # another sender has its own
    catalog.cancel_inbound("peer:h2")
    catalog.abort_inbound(inbound[0])
    assert catalog.open_streams() == {"peer:h1": 1} and inbound[0].segment in pool.released
    # A ticket nobody used: its memory goes back when it expires.
    catalog.add_ticket(b"t" * 16, Ticket(time.monotonic() - 1, inbound=inbound[1]))
    catalog.expire_tickets(time.monotonic())
    assert catalog.open_streams() == {} and catalog.take_ticket(b"t" * 16) is None and pool.used == 0


def test_a_client_transfer_of_a_shard_held_is_refused_before_it_counts() -> None:
    catalog, _, _ = make_catalog()
    settled(catalog, key(1), DATA)
    with pytest.raises(AlreadySaved):
        catalog.admit_inbound(key(1), "job:job", client=True)
    assert catalog.open_streams() == {}
    catalog.admit_inbound(key(1), "peer:h1", client=False)  # a peer's copy replaces ours (the same bytes)


def test_an_expired_send_ticket_unpins_its_copy() -> None:
    catalog, pool, _ = make_catalog()
    entry = settled(catalog, key(1), DATA)
    assert catalog.pin(entry)
    catalog.add_ticket(b"s" * 16, Ticket(time.monotonic() - 1, outbound=entry))
    catalog.drop(entry, "deleted")
    assert entry.segment not in pool.released
    catalog.expire_tickets(time.monotonic())
    assert entry.segment in pool.released


def test_retire_drops_superseded_versions_then_keeps_k_but_never_a_protected_step() -> None:
    catalog, _, _ = make_catalog()  # keep 2
    for step in (1, 2, 3, 4):
        settled(catalog, key(step), DATA, created=float(step))
    catalog.retire("job", dead={(4, "")}, latest=3, protected=[1])
    assert sorted(k.step for k, _, _ in catalog.held("job")) == [1, 2, 3]  # 4 superseded; the newest 2, and 1 protected
    catalog.retire("job", dead=set(), latest=3, protected=[])
    assert sorted(k.step for k, _, _ in catalog.held("job")) == [2, 3]


def test_waits_end_at_their_deadline_or_when_the_store_stops() -> None:
    catalog, _, stop = make_catalog()
    entry = commit(catalog, key(1), DATA)
    info, done = catalog.wait_settled(key(1), time.monotonic() + 0.01)
    assert not done and info.state is ShardState.CAPTURED
    with pytest.raises(ShardNotFound, match="still being captured"):
        catalog.readable(key(1), wait=0.01)
    stop.set()
    assert catalog.wait_settled(key(1), time.monotonic() + 60) == (catalog.info(entry), False)
    with pytest.raises(ShardNotFound):
        catalog.wait_settled(key(9), time.monotonic())


def test_adoption_keeps_settled_copies_that_verify_and_deletes_the_rest() -> None:
    catalog, pool, _ = make_catalog()
    good = settled(catalog, key(1), DATA)
    meta = sidecar_bytes(catalog.info(good))
    assert pool.described[id(good.segment)] == meta  # a settled copy is described next to its segment
    fresh, fresh_pool, _ = make_catalog()
    corrupt = fresh_pool.acquire(len(DATA), "job")
    fresh_pool.used = 0
    intact = fresh_pool.acquire(len(DATA), "job")
    fresh_pool.used = 0
    intact.view(len(DATA))[:] = DATA
    corrupt.view(len(DATA))[:] = DATA[::-1]
    fresh_pool.adoptable = [(corrupt, meta), (intact, meta)]
    assert fresh.adopt_segments() == 1
    adopted = fresh.get(key(1))
    assert adopted is not None and adopted.segment is intact and adopted.state is ShardState.COMMITTED and adopted.verified


def test_a_deleted_shard_is_not_pulled_back_by_repair_for_a_while() -> None:
    catalog, _, _ = make_catalog(config())
    for step in (1, 2):
        settled(catalog, ShardKey("job", step, 0), bytes(4 * KiB))
    assert catalog.delete("job", 1, -1) == 1
    assert catalog.recently_deleted(ShardKey("job", 1, 0)) and catalog.recently_deleted(ShardKey("job", 1, 3))
    assert not catalog.recently_deleted(ShardKey("job", 2, 0)) and not catalog.recently_deleted(ShardKey("other", 1, 0))


def test_the_foreground_is_busy_while_bytes_move_in_or_out_for_a_save_a_restore_or_a_repair() -> None:
    """What the spill tier and the reserve's faulting yield to: an open allocation, a replication, an inbound transfer,
    a restore's pull and a repair, each alone."""
    catalog, _, _ = make_catalog()
    assert not catalog.foreground_busy()
    catalog.add_in_flight(1)
    assert catalog.foreground_busy()
    catalog.add_in_flight(-1)
    catalog.admit_inbound(key(1), "h1", client=False)
    assert catalog.foreground_busy()
    catalog.cancel_inbound("h1")
    assert not catalog.foreground_busy()
    catalog.fetch_started()
    assert catalog.foreground_busy()
    catalog.fetch_ended()
    assert catalog.begin_repair(key(2), restore_first=0.0) and catalog.foreground_busy()
    catalog.end_repair()
    assert not catalog.foreground_busy()
