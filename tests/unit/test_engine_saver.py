"""The Saver alone, over a fake pool and recorded events: what it takes in goes to the (recorded) replicator."""

from __future__ import annotations

import threading

import pytest

from memstore.core.floors import Floors
from memstore.core.model import PutOrigin, ShardKey, ShardState, TransferHeader
from memstore.core.status import CaptureReport
from memstore.errors import AlreadySaved, CapacityExceeded, Draining, InvalidArgument, LeaseError
from memstore.server.engine.entries import Entry
from memstore.server.engine.saving import Saver
from memstore.v1.integrity import ChunkChecksums, compute_checksums
from tests.unit.engine_fakes import RecordingEvents, admission_of, arrivals_of, config, make_catalog, manifest_of, room_of

pytestmark = pytest.mark.unit
DATA = bytes(range(256)) * 32  # 8 KiB


class RecordingReplicator:
    """What the Saver uses of the Replicator (``submit``, ``announce``), recorded instead of run."""

    def __init__(self) -> None:
        self.submitted: list[Entry] = []
        self.announced: list[tuple[str, int, int]] = []  # (job, rank, nbytes) the peers were told to expect

    def submit(self, entry: Entry) -> None:
        self.submitted.append(entry)

    def announce(self, job_id: str, rank: int, nbytes: int) -> None:
        self.announced.append((job_id, rank, nbytes))


def saver(**flags: str):  # type: ignore[no-untyped-def]
    cfg = config(**flags)
    catalog, pool, _ = make_catalog(cfg)
    events, draining, rep = RecordingEvents(), threading.Event(), RecordingReplicator()
    s = Saver(
        catalog, arrivals_of(catalog), room_of(catalog), admission_of(cfg), rep, cfg, pool, events, draining, threading.Event(), Floors()
    )  # type: ignore[arg-type]
    return s, catalog, pool, events, rep.submitted, draining


def test_the_saver_hands_a_commit_to_replication_and_counts_the_save() -> None:
    s, catalog, _, events, submitted, _ = saver()
    lease, seg = s.allocate(ShardKey("job", 1, 0), 1, len(DATA))
    seg.view(len(DATA))[:] = DATA
    key = s.commit(lease, {"loss": 0.5}, 1, capture_seconds=0.25)
    assert key == ShardKey("job", 1, 0) and [e.key for e in submitted] == [key]
    assert events.named("saved") == [("shm", 0.25)] and catalog.get(key) is submitted[0]
    info, done = s.wait_committed(key, 0.0)
    assert not done and info.state is ShardState.CAPTURED


def test_the_saver_refuses_while_draining_and_checks_sizes() -> None:
    s, _, pool, _, _, draining = saver()
    with pytest.raises(InvalidArgument, match="nbytes 0"):
        s.allocate(ShardKey("job", 1, 0), 1, 0)
    with pytest.raises(InvalidArgument, match="grow needs ahead"):
        s.allocate(ShardKey("job", 1, 0), 1, 10, grow=True)
    draining.set()
    with pytest.raises(Draining):
        s.allocate(ShardKey("job", 1, 0), 1, 10)
    assert pool.used == 0


def test_a_stream_from_a_client_is_verified_registered_and_replicated() -> None:
    s, catalog, pool, events, submitted, _ = saver()
    key = ShardKey("job", 1, 0)
    m = manifest_of(key, DATA, owner="")
    got = s.receive(TransferHeader(m, PutOrigin.CLIENT, ""), [DATA[:4096], DATA[4096:]])
    assert got.owner_host == "h0" and [e.key for e in submitted] == [key] and events.named("saved")[0][0] == "stream"
    bad = manifest_of(ShardKey("job", 2, 0), DATA, owner="")
    with pytest.raises(Exception, match="checksum"):
        s.receive(TransferHeader(bad, PutOrigin.CLIENT, ""), [DATA[:4096], DATA[::-1][4096:]])
    assert s.admission.open_streams() == {} and catalog.get(ShardKey("job", 2, 0)) is None and pool.used == len(DATA)


def test_a_client_stream_of_a_shard_held_is_refused_before_it_counts_and_a_peers_copy_is_not() -> None:
    s, catalog, pool, _, _, _ = saver()
    key = ShardKey("job", 1, 0)
    s.receive(TransferHeader(manifest_of(key, DATA, owner=""), PutOrigin.CLIENT, ""), [DATA[:4096], DATA[4096:]])
    with pytest.raises(AlreadySaved):
        s.begin_receive(TransferHeader(manifest_of(key, DATA, owner=""), PutOrigin.CLIENT, ""))
    assert s.admission.open_streams() == {} and pool.used == len(DATA)  # nothing counted, nothing reserved
    inbound = s.begin_receive(TransferHeader(manifest_of(key, DATA, owner="h1"), PutOrigin.REPLICA, "h1"))  # the same bytes
    assert s.admission.open_streams() == {"peer:h1": 1}
    s.abort_receive(inbound)
    assert s.admission.open_streams() == {} and pool.used == len(DATA) and catalog.get(key) is not None


def test_a_stream_that_gets_no_memory_gives_its_slot_back() -> None:
    s, _, pool, _, _, _ = saver(capacity="4KiB")
    with pytest.raises(CapacityExceeded):
        s.begin_receive(TransferHeader(manifest_of(ShardKey("job", 1, 0), DATA, owner="h1"), PutOrigin.REPLICA, "h1"))
    assert s.admission.open_streams() == {} and pool.used == 0


def test_closing_gives_up_the_captures_still_being_written() -> None:
    s, _, _, _, submitted, _ = saver()
    lease, _ = s.allocate(ShardKey("job", 1, 0), 1, len(DATA))
    s.commit(lease, {}, 1, captured_bytes=len(DATA) // 2)  # the first mark: taken in, pushed while it is copied
    (entry,) = submitted
    assert entry.progress is not None and not entry.progress.abandoned
    s.close()
    assert entry.progress.abandoned == "the store is closing"
    with pytest.raises(LeaseError):
        s.commit(lease, {}, 1)  # the end of a capture given up: the client saves again


def test_a_commit_takes_its_clients_chunk_checksums_and_refuses_wrong_ones_keeping_the_lease() -> None:
    s, catalog, pool, _, submitted, _ = saver()
    key = ShardKey("job", 1, 0)
    lease, seg = s.allocate(key, 1, len(DATA))
    seg.view(len(DATA))[:] = DATA
    right = compute_checksums(memoryview(DATA), len(DATA), 4096)
    wrong = {
        "'crc32'": ChunkChecksums(4096, tuple(right), "crc32"),
        "2048-byte chunks; this store cuts 4096": ChunkChecksums(2048, tuple(right)),
        "1 chunk checksums for a shard of 8192 bytes, which has 2": ChunkChecksums(4096, tuple(right[:1])),
    }
    for why, sums in wrong.items():
        with pytest.raises(InvalidArgument, match=why):
            s.commit(lease, {}, 1, checksums=sums)
    with pytest.raises(InvalidArgument, match="captured_bytes"):
        s.commit(lease, {}, 1, captured_bytes=100, checksums=ChunkChecksums(4096, tuple(right)))
    assert not submitted and pool.used == len(DATA)  # every refusal kept the lease and its bytes
    s.commit(lease, {}, 1, checksums=ChunkChecksums(4096, tuple(right)))
    assert [e.key for e in submitted] == [key] and catalog.get(key).client_checksums == tuple(right)


def test_the_final_commit_of_a_marked_capture_carries_no_checksums() -> None:
    s, _, _, _, submitted, _ = saver()
    lease, seg = s.allocate(ShardKey("job", 1, 0), 1, len(DATA))
    seg.view(len(DATA))[:] = DATA
    s.commit(lease, {}, 1, captured_bytes=4096)
    sums = ChunkChecksums(4096, tuple(compute_checksums(memoryview(DATA), len(DATA), 4096)))
    with pytest.raises(InvalidArgument, match="marks"):
        s.commit(lease, {}, 1, checksums=sums)
    (entry,) = submitted
    assert entry.client_checksums is None and entry.progress is not None and not entry.progress.finished


def test_a_reservation_ahead_has_the_replicator_announce_its_rank_to_the_peers() -> None:
    cfg = config()
    catalog, pool, _ = make_catalog(cfg)
    rep = RecordingReplicator()
    events, due = RecordingEvents(), threading.Event()
    s = Saver(catalog, arrivals_of(catalog), room_of(catalog), admission_of(cfg), rep, cfg, pool, events, threading.Event(), due, Floors())  # type: ignore[arg-type]
    s.allocate(ShardKey("job", 1, 1), 2, len(DATA))  # a save's own allocation: its replicas teach the peers
    assert rep.announced == []
    s.allocate(ShardKey("job", 0, 1), 2, len(DATA), ahead=True)  # prepare(), or the ring reserving ahead
    assert rep.announced == [("job", 1, len(DATA))]  # whether the rank saved already is the Replicator's business


def test_the_capture_report_sums_the_commits_taken_in_and_not_a_refused_one() -> None:
    s, _, _, _, _, _ = saver()
    key = ShardKey("job", 1, 0)
    first, _ = s.allocate(key, 1, len(DATA))
    second, _ = s.allocate(key, 1, len(DATA))  # a reused run id: two captures of one shard
    s.commit(first, {}, 1, capture=CaptureReport(3, 1, "invalid argument"))
    with pytest.raises(AlreadySaved):
        s.commit(second, {}, 1, capture=CaptureReport(5, 0, ""))
    assert (s.capture.registrations, s.capture.fallbacks, s.capture.fallback_cause) == (3, 1, "invalid argument")
