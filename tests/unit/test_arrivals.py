"""Arrivals alone, under a catalog over a fake pool: pulls claimed once, repair deferring to restores and leaving alone
what is held or on its way, inbound transfers joining the catalog as they stop arriving, and its part of busy."""

from __future__ import annotations

import threading

import pytest

from memstore.core.model import PutOrigin, ShardKey, ShardState
from memstore.server.engine.entries import Entry, Inbound
from tests.unit.engine_fakes import arrivals_of, make_catalog, manifest_of, room_of, settled

pytestmark = pytest.mark.unit
DATA = bytes(range(256)) * 32  # 8 KiB: two chunks


def key(step: int, rank: int = 0) -> ShardKey:
    return ShardKey("job", step, rank)


def test_it_shares_the_catalogs_one_lock_which_a_holder_may_take_again() -> None:
    catalog, _, stop = make_catalog()
    arrivals = arrivals_of(catalog, stop)
    with catalog.cond:  # a part holding the engine's lock may call what takes it (an RLock): no deadlock
        arrivals.mark_receiving(key(1))
        assert catalog.get(key(1)) is None and not arrivals.begin_repair(key(1), restore_first=0.0)


def test_a_pull_is_claimed_once_and_its_end_wakes_whoever_waits_for_it() -> None:
    catalog, _, stop = make_catalog()
    arrivals = arrivals_of(catalog, stop)
    assert arrivals.claim_pull(key(1)) is None  # ours: end_pull must follow
    pending = arrivals.claim_pull(key(1))
    assert pending is not None and not pending.is_set()  # another caller waits for ours
    arrivals.end_pull(key(1))
    assert pending.is_set() and arrivals.claim_pull(key(1)) is None  # over: the next pull claims it afresh
    arrivals.end_pull(key(1))


def test_repair_leaves_alone_what_is_held_arriving_or_being_pulled() -> None:
    catalog, _, stop = make_catalog()
    arrivals = arrivals_of(catalog, stop)
    settled(catalog, key(1), DATA)
    arrivals.mark_receiving(key(2))
    arrivals.claim_pull(key(3))
    assert [arrivals.begin_repair(key(s), restore_first=0.0) for s in (1, 2, 3)] == [False, False, False]
    assert arrivals.repairs_in_flight == 0
    assert arrivals.begin_repair(key(4), restore_first=0.0) and arrivals.repairs_in_flight == 1
    arrivals.end_repair()
    arrivals.end_receiving(key(2))  # the transfer failed: repair may pull it now
    arrivals.end_pull(key(3))
    assert arrivals.begin_repair(key(2), restore_first=0.0) and arrivals.begin_repair(key(3), restore_first=0.0)
    stop.set()
    assert not arrivals.begin_repair(key(5), restore_first=0.0)  # the store stops: nothing more


def test_a_received_shard_joins_the_catalog_as_it_stops_arriving() -> None:
    catalog, _, stop = make_catalog()
    arrivals = arrivals_of(catalog, stop)
    manifest = manifest_of(key(1), DATA, owner="h1")
    inbound = Inbound(key(1), manifest, PutOrigin.REPLICA, room_of(catalog).acquire(key(1), len(DATA)), "peer:h1")
    arrivals.mark_receiving(key(1))
    entry = Entry(key(1), 1, len(DATA), inbound.segment, "h1", ShardState.REPLICA, manifest=manifest, copies=0)
    arrivals.register_inbound(inbound, entry)
    assert catalog.get(key(1)) is entry and not arrivals.begin_repair(key(1), restore_first=0.0)  # held now
    catalog.drop(entry, "test")
    assert arrivals.begin_repair(key(1), restore_first=0.0)  # neither held nor arriving any more


def test_repair_waits_for_the_restores_in_flight_until_they_end_or_the_store_stops() -> None:
    catalog, _, stop = make_catalog()
    arrivals = arrivals_of(catalog, stop)
    results: list[bool] = []

    def repair(k: ShardKey) -> threading.Thread:
        t = threading.Thread(target=lambda: results.append(arrivals.begin_repair(k, restore_first=60.0)))
        t.start()
        return t

    arrivals.fetch_started()
    waiting = repair(key(1))
    waiting.join(0.05)
    assert waiting.is_alive() and results == []  # a trainer's restore pulls first
    arrivals.fetch_ended()
    waiting.join(5)
    assert results == [True]
    arrivals.end_repair()
    arrivals.fetch_started()
    waiting = repair(key(2))
    stop.set()
    catalog.wake()  # what Store.close does: the catalog's condition is this one's too
    waiting.join(5)
    assert not waiting.is_alive() and results == [True, False]


def test_it_is_busy_while_a_restore_or_a_repair_pulls() -> None:
    """Its part of what the spill tier, the reserve's faulting and the scrub yield to (``Store.foreground_busy``)."""
    catalog, _, stop = make_catalog()
    arrivals = arrivals_of(catalog, stop)
    assert not arrivals.busy()
    arrivals.fetch_started()
    assert arrivals.busy()
    arrivals.fetch_ended()
    assert not arrivals.busy()
    assert arrivals.begin_repair(key(3), restore_first=0.0) and arrivals.busy()
    arrivals.end_repair()
    assert not arrivals.busy()
    arrivals.mark_receiving(key(4))  # an inbound transfer counts through Admission.busy, not here
    assert not arrivals.busy()
