"""Recovery (fetch, pulls, repair) and the Janitor alone, over a fake pool, fake peers and recorded events."""

from __future__ import annotations

import threading

import pytest

from memstore.core.model import ShardKey, ShardState
from memstore.errors import ChecksumMismatch, ShardNotFound, UnknownJob
from memstore.server.engine.eviction import Eviction
from memstore.server.engine.recovery import Recovery
from tests.unit.engine_fakes import (
    FakePeer,
    FakePeers,
    RecordingEvents,
    arrivals_of,
    config,
    make_catalog,
    manifest_of,
    membership,
    room_of,
    settled,
)

pytestmark = pytest.mark.unit
DATA = bytes(range(256)) * 32  # 8 KiB


def recovery(*peers: FakePeer, replicas: int = 2, hosts: tuple[str, ...] = ("h0", "h1")):  # type: ignore[no-untyped-def]
    cfg = config(replicas=str(replicas), keep="2")
    catalog, pool, stop = make_catalog(cfg)
    events, draining, due = RecordingEvents(), threading.Event(), threading.Event()
    rec = Recovery(
        catalog,
        arrivals_of(catalog, stop),
        Eviction(catalog),
        room_of(catalog),
        cfg,
        membership("h0", hosts, replicas),
        FakePeers(*peers),
        events,
        draining,
        stop,
        due,
    )  # type: ignore[arg-type]
    return rec, catalog, pool, events, draining


def holding(peer: FakePeer, key: ShardKey, data: bytes = DATA, owner: str = "h0", created: float = 1.0) -> FakePeer:
    peer.held[key] = (manifest_of(key, data, owner=owner, created=created), data)
    return peer


def test_fetch_pulls_a_missing_shard_from_its_group_peer_and_keeps_a_local_one() -> None:
    key = ShardKey("job", 3, 0)
    rec, catalog, _, events, _ = recovery(holding(FakePeer("h1"), key))
    manifest, source = rec.fetch(key, discard_local=False)
    entry = catalog.get(key)
    assert source == "h1" and manifest.nbytes == len(DATA) and entry is not None and entry.state is ShardState.REPLICA
    assert bytes(entry.segment.view(len(DATA))) == DATA and entry.source == "h1"
    assert events.named("pulled") == [("peer", len(DATA))] and events.named("fetched")[0][0] == "peer"
    assert rec.fetch(key, discard_local=False)[1] == "h1"  # held now: no second pull
    assert events.named("fetched")[1][0] == "local" and len(events.named("pulled")) == 1


def test_fetch_skips_a_corrupt_copy_and_says_so_when_every_copy_is_corrupt() -> None:
    key = ShardKey("job", 3, 0)
    bad = FakePeer("h1")
    bad.held[key] = (manifest_of(key, DATA), DATA[::-1])
    rec, _, _, _, _ = recovery(bad, holding(FakePeer("h2"), key), replicas=3, hosts=("h0", "h1", "h2"))
    assert rec.fetch(key, discard_local=False)[1] == "h2"
    rec2, _, pool2, _, _ = recovery(bad)
    with pytest.raises(ChecksumMismatch, match="every copy"):
        rec2.fetch(key, discard_local=False)
    assert pool2.used == 0  # the failed pull's memory went back


def test_fetch_names_unknown_jobs_and_missing_shards() -> None:
    rec, _, _, _, _ = recovery(holding(FakePeer("h1"), ShardKey("job", 1, 0)))
    with pytest.raises(UnknownJob):
        rec.fetch(ShardKey("other", 1, 0), discard_local=False)
    with pytest.raises(ShardNotFound):
        rec.fetch(ShardKey("job", 2, 0), discard_local=False)


def test_repair_pulls_what_this_slot_should_hold_spread_over_every_holder() -> None:
    h1, h2 = FakePeer("h1"), FakePeer("h2")
    keys = [ShardKey("job", step, 0) for step in (4, 5)]
    for k in keys:
        holding(h1, k), holding(h2, k)
    holding(h1, ShardKey("job", 1, 0), created=0.5)  # older than the keep-2 newest versions: not repaired
    rec, catalog, _, events, _ = recovery(h1, h2, replicas=3, hosts=("h0", "h1", "h2"))
    assert rec.repair_once() == 2
    assert {catalog.get(k).source for k in keys} == {"h1", "h2"}  # type: ignore[union-attr]  # one pull from each holder
    assert catalog.get(ShardKey("job", 1, 0)) is None and len(events.named("repaired")) == 2
    assert rec.repaired_table is not None and rec.unreachable_sources == () and rec.under_replicated == 0
    assert rec.repair_once() == 0  # nothing missing any more


def test_repair_with_a_holder_down_is_not_complete_and_counts_the_under_replicated() -> None:
    key = ShardKey("job", 5, 0)
    rec, catalog, _, _, _ = recovery(FakePeer("h1", refuse="gone"))
    settled(catalog, key, DATA)  # our own shard, of which h1 (down) should hold the other copy
    assert rec.repair_once() == 0
    assert rec.unreachable_sources == ("h1",) and rec.repaired_table is None and rec.under_replicated == 1


def test_a_draining_store_repairs_nothing() -> None:
    key = ShardKey("job", 5, 0)
    rec, catalog, _, _, draining = recovery(holding(FakePeer("h1"), key))
    draining.set()
    assert rec.repair_once() == 0 and catalog.get(key) is None


def test_repair_does_not_pull_what_is_arriving_or_already_pulled() -> None:
    key = ShardKey("job", 5, 0)
    rec, catalog, _, _, _ = recovery(holding(FakePeer("h1"), key))
    rec.arrivals.mark_receiving(key)
    assert rec.repair_once() == 0 and catalog.get(key) is None
