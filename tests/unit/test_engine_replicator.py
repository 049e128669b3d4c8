"""The Replicator and the Saver alone, over a fake pool, fake peers and recorded events."""

from __future__ import annotations

import threading

import pytest

from memstore.core.floors import Floor, Floors
from memstore.core.model import ShardKey, ShardState
from memstore.server.engine.replication import Replicator
from memstore.v1.integrity import ChunkChecksums
from tests.unit.engine_fakes import FakePeer, FakePeers, RecordingEvents, captured, commit, config, make_catalog, membership

pytestmark = pytest.mark.unit
DATA = bytes(range(256)) * 32  # 8 KiB


def replicator(*peers: FakePeer, replicas: int = 2, hosts: tuple[str, ...] = ("h0", "h1"), **flags: str):  # type: ignore[no-untyped-def]
    cfg = config(replicas=str(replicas), **flags)
    catalog, pool, _ = make_catalog(cfg)
    events, due = RecordingEvents(), threading.Event()
    rep = Replicator(catalog, cfg, membership("h0", hosts, replicas), FakePeers(*peers), events, due, Floors())  # type: ignore[arg-type]
    return rep, catalog, pool, events, due


def replicate(rep: Replicator, key: ShardKey) -> None:
    entry = commit(rep.catalog, key, DATA)
    rep.catalog.add_in_flight(1)  # what submit() does before the executor runs it
    rep.capture_and_replicate(entry)


def test_a_capture_is_checksummed_pushed_to_its_group_peer_and_committed() -> None:
    peer = FakePeer("h1")
    rep, catalog, _, events, due = replicator(peer)
    replicate(rep, ShardKey("job", 1, 0))
    (info,) = catalog.list_shards("job")
    assert info.state is ShardState.COMMITTED and info.copies == 2 and info.verified and len(info.manifest.checksums) == 2
    assert peer.pushes == [ShardKey("job", 1, 0)] and peer.held[ShardKey("job", 1, 0)][1] == DATA
    assert events.named("pushed") == [(len(DATA),)] and events.named("settled") == [("committed",)] and len(events.named("replicated")) == 1
    assert catalog.in_flight == 0 and due.is_set()


def test_a_push_carries_the_jobs_floor_with_its_timeline_when_it_is_another_saves() -> None:
    peer = FakePeer("h1")
    rep, _, _, _, _ = replicator(peer)
    rep.floors.note("job", Floor(4, "dcp-a"))  # a DCP save's floor: the save before it, of its own timeline
    replicate(rep, ShardKey("job", 5, 0, "dcp-b"))
    rep.floors.note("job", Floor(5, "r.0"))  # a client's floor: a step of the pushed shard's own timeline, sent as a step
    replicate(rep, ShardKey("job", 6, 0, "r.0"))
    replicate(rep, ShardKey("job", 2, 1, "r.0"))  # an older step of the floor's timeline cannot carry a newer floor
    assert peer.floors == [(4, "dcp-a"), (5, ""), (None, "")]


def test_a_peer_that_refuses_leaves_the_shard_under_replicated_with_its_reason() -> None:
    rep, catalog, _, events, _ = replicator(FakePeer("h1", refuse="disk on fire"))
    replicate(rep, ShardKey("job", 1, 0))
    (info,) = catalog.list_shards("job")
    assert info.state is ShardState.UNDER_REPLICATED and info.copies == 1 and "1 of 2 copies: disk on fire" in info.error
    assert events.named("settled") == [("under_replicated",)] and not events.named("replicated")


def test_alone_in_the_slot_table_a_shard_settles_with_one_copy_and_says_why() -> None:
    rep, catalog, _, _, _ = replicator(hosts=("h0",))
    replicate(rep, ShardKey("job", 1, 0))
    (info,) = catalog.list_shards("job")
    assert info.state is ShardState.UNDER_REPLICATED and "no group peer to copy to yet" in info.error
    rep1, catalog1, _, _, _ = replicator(hosts=("h0",), replicas=1)
    replicate(rep1, ShardKey("job", 1, 0))
    assert catalog1.list_shards("job")[0].state is ShardState.COMMITTED  # R=1: nothing to copy


def test_a_push_skipped_for_a_newer_capture_of_the_rank_reports_the_save_superseded() -> None:
    peer = FakePeer("h1")
    rep, catalog, _, _, _ = replicator(peer)
    old = commit(catalog, ShardKey("job", 1, 0), DATA)
    catalog.take_up(old)  # replication has it: the newer commit does not drop it ...
    newer = commit(catalog, ShardKey("job", 2, 0), DATA)
    newer.created_unix = old.created_unix + 1
    rep.capture_and_replicate(old)  # ... but pushing it is pointless now
    info = old.info()
    assert peer.pushes == [] and info.superseded and catalog.saves_superseded == 1 and "superseded by step 2" in info.error


def test_tcp_data_plane_falls_back_to_streams_for_a_peer_without_a_data_channel() -> None:
    plain, fast = FakePeer("h1"), FakePeer("h2", data_channel=True)
    rep, catalog, _, _, _ = replicator(plain, fast, replicas=3, hosts=("h0", "h1", "h2"), data_plane="tcp")
    replicate(rep, ShardKey("job", 1, 0))
    assert catalog.list_shards("job")[0].copies == 3 and plain.pushes and fast.pushes


@pytest.mark.parametrize("plane", ["tcp", "grpc"])
def test_a_capture_still_being_written_is_pushed_only_once_its_client_finished_it(plane: str) -> None:
    from memstore.server.engine.progress import CaptureProgress

    peer = FakePeer("h1", data_channel=plane == "tcp")
    rep, catalog, _, _, _ = replicator(peer, data_plane=plane)
    entry = commit(rep.catalog, ShardKey("job", 1, 0), DATA)
    entry.progress = CaptureProgress(len(DATA), stall=30)
    entry.progress.advance(4096)
    rep.catalog.add_in_flight(1)
    worker = threading.Thread(target=rep.capture_and_replicate, args=(entry,))
    worker.start()
    worker.join(0.1)
    assert worker.is_alive() and peer.pushes == []  # the peer never gets a shard its client has not finished
    entry.progress.finish()
    worker.join(10)
    (info,) = catalog.list_shards("job")
    assert info.state is ShardState.COMMITTED and info.copies == 2 and peer.held[ShardKey("job", 1, 0)][1] == DATA


def test_a_capture_whose_client_stops_is_dropped_and_pushed_nowhere() -> None:
    from memstore.server.engine.progress import CaptureProgress

    peer = FakePeer("h1")
    rep, catalog, pool, _, _ = replicator(peer)
    entry = commit(rep.catalog, ShardKey("job", 1, 0), DATA)
    entry.progress = CaptureProgress(len(DATA), stall=0.05)
    rep.catalog.add_in_flight(1)
    rep.capture_and_replicate(entry)
    assert catalog.list_shards("job") == [] and peer.pushes == [] and entry.segment in pool.released
    assert "abandoned" in entry.error and catalog.in_flight == 0


@pytest.mark.parametrize("plane", ["tcp", "grpc"])
def test_a_capture_its_client_hashed_is_pushed_with_those_checksums_and_never_read_back(plane: str, monkeypatch) -> None:
    from memstore.server.engine import replication

    def no_hashing(*args: object, **kwargs: object) -> None:
        raise AssertionError("the store hashed a shard its client had hashed")

    monkeypatch.setattr(replication, "StreamedChecksums", no_hashing)
    monkeypatch.setattr(replication, "compute_checksums", no_hashing)
    peer = FakePeer("h1", data_channel=plane == "tcp")
    rep, catalog, _, _, _ = replicator(peer, data_plane=plane)
    key = ShardKey("job", 1, 0)
    sums = ChunkChecksums(4096, (11, 22))  # not DATA's: the store takes them as they are, its peers verify them
    lease = catalog.lease_allocation(captured(catalog, key, DATA), ahead=False)
    entry = catalog.commit_lease(lease, None, 0, {}, 1, "", checksums=sums)
    rep.catalog.add_in_flight(1)
    rep.capture_and_replicate(entry)
    (info,) = catalog.list_shards("job")
    assert info.state is ShardState.COMMITTED and info.manifest.checksums == (11, 22)
    assert peer.held[key][0].checksums == (11, 22) and peer.held[key][1] == DATA


def test_a_rank_is_announced_to_its_group_peers_once_per_shard_size() -> None:
    peer = FakePeer("h1")
    rep, *_ = replicator(peer)
    MiB = 1 << 20
    rep.announce("job", 0, MiB - 1)  # too small for a reserve of its own: not worth a call
    rep.announce("job", 0, 8 * MiB)
    rep.announce("job", 0, 8 * MiB)  # known: no call
    rep.announce("job", 0, 4 * MiB)  # smaller than told: the peer's reserve already covers it
    rep.announce("job", 0, 16 * MiB)  # its shards grew: told again
    rep.announce("job", 1, 8 * MiB)
    assert peer.expected == [("job", 0, 8 * MiB), ("job", 0, 16 * MiB), ("job", 1, 8 * MiB)]
    replicate_submitted = commit(rep.catalog, ShardKey("job", 1, 2), DATA)
    rep.submit(replicate_submitted)  # rank 2's first save taken in: its replicas teach the peer from now on
    rep.announce("job", 2, 8 * MiB)
    assert peer.expected[-1] == ("job", 1, 8 * MiB)
