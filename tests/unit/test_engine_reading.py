"""The Reader and the DataPath alone: read leases over verified copies, and transfers on the data channel."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from memstore.core.floors import Floors
from memstore.core.model import PutOrigin, ShardKey, TransferHeader
from memstore.errors import ChecksumMismatch, InvalidArgument, ShardNotFound
from memstore.server.engine.datapath import DataPath
from memstore.server.engine.local_reads import Reader
from memstore.server.engine.replication import Replicator
from memstore.server.engine.saving import Saver
from memstore.v1.datachannel import recv_exact
from tests.unit.engine_fakes import (
    FakePeers,
    RecordingEvents,
    admission_of,
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
KEY = ShardKey("job", 1, 0)


def test_open_verifies_pins_and_leases_a_copy_until_release() -> None:
    catalog, pool, _ = make_catalog()
    entry = settled(catalog, KEY, DATA)
    reader = Reader(catalog)
    lease, opened = reader.open(KEY, transient=True)
    assert opened is entry and entry.pins == 1 and not entry.segment.exported
    catalog.drop(entry, "deleted")
    assert entry.segment not in pool.released  # the reader still maps it
    reader.release(lease)
    assert entry.pins == 0 and entry.segment in pool.released


def test_a_copy_that_fails_verification_when_opened_is_dropped() -> None:
    catalog, pool, _ = make_catalog()
    entry = settled(catalog, KEY, DATA)
    entry.segment.view()[5] ^= 0xFF  # a bit flipped in RAM
    with pytest.raises(ChecksumMismatch, match="ask again"):
        Reader(catalog).open(KEY)
    assert catalog.get(KEY) is None and entry.segment in pool.released


def test_a_copy_pulled_in_verified_is_lent_once_without_hashing_again_then_hashed() -> None:
    catalog, _, _ = make_catalog()
    entry = settled(catalog, KEY, DATA)
    entry.segment.view()[5] ^= 0xFF  # stands for the bytes: only hashing them would notice
    entry.arrived_verified = time.monotonic()  # as a pull registers it: every chunk verified as it landed
    reader = Reader(catalog)
    lease, _ = reader.open(KEY)  # its first reader right after the pull: no second pass over the bytes
    reader.release(lease)
    with pytest.raises(ChecksumMismatch):
        reader.open(KEY)  # every later reader hashes it
    stale = settled(catalog, ShardKey("job", 2, 0), DATA)
    stale.segment.view()[5] ^= 0xFF
    stale.arrived_verified = time.monotonic() - 60  # pulled a minute ago: hashed again
    with pytest.raises(ChecksumMismatch):
        reader.open(ShardKey("job", 2, 0))


def test_open_many_lends_the_others_it_holds_and_skips_missing_or_corrupt_ones() -> None:
    catalog, _, _ = make_catalog()
    own, held, corrupt = (settled(catalog, ShardKey("job", 1, r), DATA) for r in (0, 1, 3))
    corrupt.segment.view()[5] ^= 0xFF
    reader = Reader(catalog)
    also = [ShardKey("job", 1, r) for r in (1, 2, 3)]  # rank 2's stripe is not held here
    opened = reader.open_many(KEY, also)
    assert [o[1] if o else None for o in opened] == [own, held, None, None]
    assert own.pins == held.pins == 1 and catalog.get(ShardKey("job", 1, 3)) is None  # the corrupt copy was dropped
    for o in opened:
        if o:
            reader.release(o[0])
    assert own.pins == held.pins == 0
    with pytest.raises(InvalidArgument, match="job 'other'"):
        reader.open_many(KEY, [ShardKey("other", 1, 1)])
    assert own.pins == 0  # refused before anything was opened
    with pytest.raises(ShardNotFound):
        reader.open_many(ShardKey("job", 1, 2), [KEY])  # the first key raises as open does
    assert own.pins == 0


def test_a_mapping_reader_marks_the_segment_never_to_be_reused_and_read_streams_pinned_bytes() -> None:
    catalog, _, _ = make_catalog()
    entry = settled(catalog, KEY, DATA)
    reader = Reader(catalog)
    reader.open(KEY)
    assert entry.segment.exported
    for manifest, view in reader.read(KEY):
        assert entry.pins == 2 and bytes(view) == DATA and manifest.nbytes == len(DATA)
    assert entry.pins == 1


def datapath():  # type: ignore[no-untyped-def]
    cfg = config()
    catalog, pool, _ = make_catalog(cfg)
    events, due = RecordingEvents(), threading.Event()
    rep = Replicator(catalog, cfg, membership(), FakePeers(), events, due, Floors())  # type: ignore[arg-type]
    saver = Saver(
        catalog, arrivals_of(catalog), room_of(catalog), admission_of(cfg), rep, cfg, pool, events, threading.Event(), due, Floors()
    )  # type: ignore[arg-type]
    return DataPath(catalog, saver, cfg), catalog, pool, due


def serve(path: DataPath, ticket: bytes) -> socket.socket:
    ours, theirs = socket.socketpair()
    t = threading.Thread(target=path.serve_ticket, args=(ticket, ours))
    t.start()
    t.join(5)
    ours.close()
    return theirs


def test_a_send_ticket_streams_the_copy_and_unpins_it() -> None:
    path, catalog, _, _ = datapath()
    entry = settled(catalog, KEY, DATA)
    manifest, ticket = path.prepare_send(KEY)
    assert manifest.nbytes == len(DATA) and entry.pins == 1
    with serve(path, ticket) as theirs:
        got = bytearray(len(DATA))
        recv_exact(theirs, memoryview(got), time.monotonic() + 5)
    assert bytes(got) == DATA and entry.pins == 0
    assert path.tickets.take(ticket) is None  # used once
    with pytest.raises(ShardNotFound):
        path.prepare_send(ShardKey("job", 9, 0))


def test_a_receive_ticket_registers_a_verified_replica_and_gives_its_slot_back() -> None:
    path, catalog, pool, due = datapath()
    header = TransferHeader(manifest_of(KEY, DATA, owner="h1"), PutOrigin.REPLICA, "h1")
    ticket = path.prepare_receive(header)
    assert path.saver.admission.open_streams() == {"peer:h1": 1} and pool.used == len(DATA)
    ours, theirs = socket.socketpair()
    t = threading.Thread(target=path.serve_ticket, args=(ticket, ours))
    t.start()
    theirs.sendall(DATA)
    assert theirs.recv(1) == b"\x00"  # stored
    t.join(5)
    ours.close()
    theirs.close()
    entry = catalog.get(KEY)
    assert entry is not None and entry.verified and entry.owner_host == "h1" and path.saver.admission.open_streams() == {} and due.is_set()


def test_open_many_that_fails_past_the_first_lets_no_lease_outlive_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    catalog, _, _ = make_catalog()
    own = settled(catalog, KEY, DATA)
    reader = Reader(catalog)
    open_one = reader.open

    def failing(key: ShardKey, *args: object) -> object:
        if key.rank == 1:
            raise InvalidArgument("no shared-memory dir")
        return open_one(key, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(reader, "open", failing)
    with pytest.raises(InvalidArgument):
        reader.open_many(KEY, [ShardKey("job", 1, 1)])
    assert own.pins == 0
