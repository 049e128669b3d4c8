"""The Drainer alone: what only this store holds is handed to a member that takes copies, before the store leaves."""

from __future__ import annotations

import threading

import pytest

from memstore.core.model import ShardKey
from memstore.server.engine.drain import Drainer
from tests.unit.engine_fakes import FakePeer, FakePeers, config, make_catalog, manifest_of, membership, settled

pytestmark = pytest.mark.unit
DATA = bytes(range(256)) * 32  # 8 KiB


def drainer(*peers: FakePeer, replicas: int = 2):  # type: ignore[no-untyped-def]
    hosts = ("h0", *(p.host_id for p in peers))
    cfg = config(replicas=str(replicas))
    catalog, pool, _ = make_catalog(cfg)
    draining = threading.Event()
    return Drainer(catalog, cfg, membership("h0", hosts, replicas), FakePeers(*peers), draining), catalog, pool, draining  # type: ignore[arg-type]


def test_lone_shards_go_to_a_member_and_shards_held_elsewhere_stay() -> None:
    lone, shared = ShardKey("job", 2, 0), ShardKey("job", 1, 0)
    h1 = FakePeer("h1")
    h1.held[shared] = (manifest_of(shared, DATA), DATA)
    d, catalog, _, draining = drainer(h1)
    for key in (shared, lone):
        settled(catalog, key, DATA)
    assert d.drain(grace=30) == []
    assert draining.is_set() and h1.pushes == [lone] and h1.held[lone][1] == DATA
    assert d.progress == "copied 1 of 1 lone shard(s) to peers"
    assert not any(catalog.get(k).pins for k in (lone, shared))  # type: ignore[union-attr]


def test_draining_or_dead_members_take_nothing_and_a_refusal_moves_to_the_next() -> None:
    key = ShardKey("job", 2, 0)
    leaving, dead = FakePeer("h1", draining=True), FakePeer("h2", refuse="down")
    refusing, taker = FakePeer("h3", refuse_push="full"), FakePeer("h4")
    d, catalog, _, _ = drainer(leaving, dead, refusing, taker, replicas=2)
    settled(catalog, key, DATA)
    assert d.drain(grace=30) == []
    assert taker.pushes == [key] and leaving.pushes == [] and dead.pushes == [] and refusing.pushes == []


def test_what_no_member_takes_is_reported() -> None:
    key = ShardKey("job", 2, 0)
    d, catalog, _, _ = drainer(FakePeer("h1", draining=True))
    settled(catalog, key, DATA)
    assert d.drain(grace=30) == [f"{key}: no member took a copy"]
    assert d.progress == "copied 0 of 1 lone shard(s) to peers"


def test_with_no_grace_left_nothing_is_pushed() -> None:
    key = ShardKey("job", 2, 0)
    h1 = FakePeer("h1")
    d, catalog, _, _ = drainer(h1)
    settled(catalog, key, DATA)
    assert d.drain(grace=0) == [f"{key}: drain grace of 0s ran out"] and h1.pushes == []


def test_a_shard_only_cached_elsewhere_is_still_lone_and_goes_to_a_member() -> None:
    key = ShardKey("job", 2, 0)
    h1 = FakePeer("h1")
    h1.held[key] = (manifest_of(key, DATA), DATA)
    h1.cached.add(key)  # h1 pulled it ahead of a restore: spare room it may give up at any time
    d, catalog, _, _ = drainer(h1)
    settled(catalog, key, DATA)
    assert d.drain(grace=30) == []
    assert h1.pushes == [key]  # a real copy replaces the cached one
