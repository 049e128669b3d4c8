"""The Saver alone, over a fake pool and recorded events: what it takes in goes to the (recorded) replicator."""

from __future__ import annotations

import threading

import pytest

from memstore.core.floors import Floors
from memstore.core.model import PutOrigin, ShardKey, ShardState, TransferHeader
from memstore.errors import Draining, InvalidArgument, LeaseError
from memstore.server.entries import Entry
from memstore.server.saving import Saver
from tests.unit.engine_fakes import RecordingEvents, config, make_catalog, manifest_of

pytestmark = pytest.mark.unit
DATA = bytes(range(256)) * 32  # 8 KiB


class RecordingReplicator:
    """What the Saver uses of the Replicator (``submit``), recorded instead of run."""

    def __init__(self) -> None:
        self.submitted: list[Entry] = []

    def submit(self, entry: Entry) -> None:
        self.submitted.append(entry)


def saver(**flags: str):  # type: ignore[no-untyped-def]
    cfg = config(**flags)
    catalog, pool, _ = make_catalog(cfg)
    events, draining, rep = RecordingEvents(), threading.Event(), RecordingReplicator()
    return Saver(catalog, rep, cfg, pool, events, draining, threading.Event(), Floors()), catalog, pool, events, rep.submitted, draining  # type: ignore[arg-type]


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
    assert catalog.open_streams() == {} and catalog.get(ShardKey("job", 2, 0)) is None and pool.used == len(DATA)


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
