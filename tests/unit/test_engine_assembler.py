"""Assembly ahead of a restore (memstore.server.engine.assembler) and its cached copies in the Catalog, over fakes."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from memstore.core.model import ShardKey, ShardState, Stripe
from memstore.errors import CapacityExceeded, ShardNotFound
from memstore.server.engine.assembler import GIVE_UP_SECONDS, RETRY_SECONDS, Assembler
from memstore.server.engine.entries import Entry
from tests.unit.engine_fakes import KiB, arrivals_of, commit, config, make_catalog, manifest_of, room_of

pytestmark = pytest.mark.unit
DATA = bytes(range(256)) * 16  # 4 KiB


def key(step: int, rank: int, job: str = "job", timeline: str = "t.0") -> ShardKey:
    return ShardKey(job, step, rank, timeline)


def stripe_saved(catalog, k: ShardKey, group: tuple[int, ...], created: float = 1.0) -> Entry:  # type: ignore[no-untyped-def]
    """``k`` saved here by its member as a stripe of ``group``, committed and settled."""
    entry = commit(catalog, k, DATA)
    entry.created_unix = created
    catalog.take_up(entry)
    stripe = Stripe(group, group.index(k.rank), len(DATA) * len(group), len(DATA))
    catalog.checksummed(entry, replace(manifest_of(k, DATA, created=created, world_size=4), stripe=stripe))
    catalog.settle(entry, copies=catalog.config.replicas, errors=[])
    return entry


def pulled(catalog, k: ShardKey, cached: bool) -> Entry:  # type: ignore[no-untyped-def]
    """A copy of ``k`` pulled from a peer (``cached``: ahead of a restore)."""
    seg = room_of(catalog).acquire(k, len(DATA), evict=not cached)
    entry = Entry(k, 4, len(DATA), seg, "h1", ShardState.REPLICA, manifest=manifest_of(k, DATA, owner="h1", world_size=4),
                  copies=0, cached=cached)  # fmt: skip
    assert catalog.register_pulled(entry)
    return entry


def test_the_newest_stripe_of_each_member_here_wants_its_groups_other_stripes() -> None:
    catalog, _, _ = make_catalog(config(capacity="1MiB"))
    stripe_saved(catalog, key(1, 0), (0, 1, 2), created=1.0)
    stripe_saved(catalog, key(2, 0), (0, 1, 2), created=2.0)
    commit(catalog, key(2, 3), DATA)  # an ordinary shard (and not settled): wants nothing
    pulled(catalog, key(2, 2), cached=False)  # held already (a replica)
    arrivals = arrivals_of(catalog)
    assert arrivals.stripes_wanted() == [(key(2, 1), len(DATA))]
    assert arrivals.claim_pull(key(2, 1)) is None and arrivals.stripes_wanted() == []  # on its way: not wanted twice
    arrivals.end_pull(key(2, 1))
    arrivals.mark_receiving(key(2, 1))
    assert arrivals.stripes_wanted() == []
    arrivals.end_receiving(key(2, 1))
    pulled(catalog, key(2, 1), cached=True)
    assert arrivals.stripes_wanted() == []
    assert [i.cached for i in catalog.list_shards("job") if i.manifest.key == key(2, 1)] == [True]


def test_memory_pressure_drops_cached_copies_first_and_keeps_every_real_one() -> None:
    catalog, pool, _ = make_catalog(config(capacity="16KiB"))
    mine = stripe_saved(catalog, key(1, 0), (0, 1, 2, 3))
    replica = pulled(catalog, key(1, 3), cached=False)
    cache = pulled(catalog, key(1, 1), cached=True)
    pulled(catalog, key(1, 2), cached=True)
    assert pool.capacity - pool.in_use_bytes == 0
    with pytest.raises(CapacityExceeded):
        room_of(catalog).acquire(key(1, 5), len(DATA), evict=False)  # an ahead reservation or pull evicts nothing
    seg = room_of(catalog).acquire(key(2, 0), 4 * KiB)  # a save: one cached copy goes (the oldest), nothing else
    assert sum(1 for i in catalog.list_shards("job") if i.cached) == 1
    assert not mine.dropped and not replica.dropped
    room_of(catalog).release(seg)
    assert cache.dropped and catalog.get(key(1, 2)) is not None  # the older cached copy went


class Pulls:
    """A fake ``Recovery.pull_ahead``: which keys it was asked for; raises ShardNotFound for those in ``missing``."""

    def __init__(self, catalog, missing: set[ShardKey] = frozenset()) -> None:  # type: ignore[no-untyped-def,assignment]
        self.catalog, self.missing, self.asked = catalog, set(missing), []

    def __call__(self, k: ShardKey) -> str:
        self.asked.append(k)
        if k in self.missing:
            raise ShardNotFound(f"{k} not committed by its member yet")
        pulled(self.catalog, k, cached=True)
        return "h1"


def test_the_assembler_pulls_what_is_wanted_retries_with_backoff_and_gives_up() -> None:
    catalog, pool, _ = make_catalog(config(capacity="64KiB"))
    stripe_saved(catalog, key(1, 0), (0, 1, 2))
    pulls = Pulls(catalog, missing={key(1, 2)})
    assembler = Assembler(catalog, arrivals_of(catalog), pool, pulls, threading.Event(), threading.Event())  # type: ignore[arg-type]
    assert assembler.pass_once(now=100.0) == 1 and pulls.asked == [key(1, 1), key(1, 2)]
    assert assembler.pass_once(now=100.0 + RETRY_SECONDS[0] / 2) == 0 and len(pulls.asked) == 2  # backing off
    pulls.missing.clear()
    assert assembler.pass_once(now=100.0 + RETRY_SECONDS[0]) == 1 and pulls.asked[-1] == key(1, 2)
    assert assembler.arrivals.stripes_wanted() == [] and assembler.pulled == 2

    stripe_saved(catalog, key(2, 0), (0, 1, 2), created=5.0)  # a newer save: its own stripes are wanted now
    pulls.missing = {key(2, 1), key(2, 2)}
    assembler.pass_once(now=200.0)
    assembler.pass_once(now=200.0 + GIVE_UP_SECONDS + 1)
    asked = len(pulls.asked)
    assembler.pass_once(now=200.0 + GIVE_UP_SECONDS + 100)
    assert len(pulls.asked) == asked  # given up: the restore pulls them itself if it needs them


def test_the_assembler_only_uses_spare_room_and_stops_while_draining() -> None:
    catalog, pool, _ = make_catalog(config(capacity="16KiB"))
    stripe_saved(catalog, key(1, 0), (0, 1, 2, 3))  # 4 of 16 KiB used
    draining = threading.Event()
    pulls = Pulls(catalog)
    assembler = Assembler(catalog, arrivals_of(catalog), pool, pulls, threading.Event(), draining)  # type: ignore[arg-type]
    draining.set()
    assert assembler.pass_once(now=1.0) == 0 and pulls.asked == []
    draining.clear()
    assert assembler.pass_once(now=1.0) == 2  # 4 + 4 + 4 KiB: the third would leave less than a quarter (4 KiB) free
    assert assembler.skipped_for_room == 1 and len(pulls.asked) == 2


def test_a_restore_fetching_another_members_stripe_keeps_a_cached_copy_and_the_assembler_pulls_ahead() -> None:
    from memstore.server.engine.eviction import Eviction
    from memstore.server.engine.recovery import Recovery
    from tests.unit.engine_fakes import FakePeer, FakePeers, RecordingEvents, membership

    mine, theirs = key(1, 0), key(1, 1)
    peer = FakePeer("h1")
    peer.held[theirs] = (manifest_of(theirs, DATA, owner="h1", world_size=4), DATA)
    cfg = config(replicas="2", capacity="64KiB")
    catalog, pool, stop = make_catalog(cfg)
    group = membership("h0", ("h0", "h1"), 2)
    arrivals = arrivals_of(catalog, stop)
    rec = Recovery(
        catalog,
        arrivals,
        Eviction(catalog),
        room_of(catalog),
        cfg,
        group,
        FakePeers(peer),
        RecordingEvents(),
        threading.Event(),
        stop,
        threading.Event(),
    )  # type: ignore[arg-type]
    rec.fetch(theirs, discard_local=False, cached=True)
    entry = catalog.get(theirs)
    assert entry is not None and entry.cached and entry.source == "h1"
    catalog.drop(entry, reason="test")
    stripe_saved(catalog, mine, (0, 1))
    assembler = Assembler(catalog, arrivals, pool, rec.pull_ahead, stop, threading.Event())  # type: ignore[arg-type]
    assert assembler.pass_once(now=1.0) == 1
    pulled_ahead = catalog.get(theirs)
    assert pulled_ahead is not None and pulled_ahead.cached and pulled_ahead.verified
