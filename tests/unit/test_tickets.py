"""The data channel's tickets: each taken out once, by a connection or by expiry, and what an expired one held released
(``Tickets`` alone, then ``DataPath.expire_tickets`` over a fake pool)."""

from __future__ import annotations

import threading
import time

import pytest

from memstore.core.floors import Floors
from memstore.core.model import PutOrigin, ShardKey, TransferHeader
from memstore.server.engine.datapath import DataPath
from memstore.server.engine.replication import Replicator
from memstore.server.engine.saving import Saver
from memstore.server.engine.tickets import Ticket, Tickets
from memstore.v1.datachannel import split_tickets
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
DATA = bytes(range(256)) * 32  # 8 KiB: two chunks of 4 KiB
KEY = ShardKey("job", 1, 0)


def test_a_ticket_is_taken_once() -> None:
    tickets = Tickets()
    issued = Ticket(time.monotonic() + 60)
    tickets.add(b"a" * 16, issued)
    assert tickets.take(b"b" * 16) is None  # unknown
    assert tickets.take(b"a" * 16) is issued
    assert tickets.take(b"a" * 16) is None and len(tickets) == 0  # used: gone


def test_expiry_takes_out_only_the_tickets_past_their_deadline() -> None:
    tickets = Tickets()
    now = time.monotonic()
    stale, fresh = Ticket(now - 1), Ticket(now + 60)
    tickets.add(b"s" * 16, stale)
    tickets.add(b"f" * 16, fresh)
    assert tickets.expired(now) == [stale]
    assert tickets.expired(now) == [] and tickets.take(b"s" * 16) is None and tickets.take(b"f" * 16) is fresh


def test_a_ticket_is_taken_by_one_of_many_racing_takers() -> None:
    tickets = Tickets()
    tickets.add(b"t" * 16, Ticket(time.monotonic() - 1))
    got: list[object] = []
    start = threading.Barrier(8)

    def take(expire: bool) -> None:
        start.wait()
        got.extend(tickets.expired(time.monotonic()) if expire else [t for t in [tickets.take(b"t" * 16)] if t is not None])

    threads = [threading.Thread(target=take, args=(i % 2 == 0,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert len(got) == 1  # whoever took it releases what it holds, once


def datapath():  # type: ignore[no-untyped-def]
    cfg = config(transfer_streams="2")  # a shard of two chunks moves on two streams, a ticket each
    catalog, pool, _ = make_catalog(cfg)
    events, due = RecordingEvents(), threading.Event()
    rep = Replicator(catalog, cfg, membership(), FakePeers(), events, due, Floors())  # type: ignore[arg-type]
    saver = Saver(
        catalog, arrivals_of(catalog), room_of(catalog), admission_of(cfg), rep, cfg, pool, events, threading.Event(), due, Floors()
    )  # type: ignore[arg-type]
    return DataPath(catalog, saver, cfg), catalog, pool


def test_an_expired_receive_ticket_gives_back_its_memory_and_its_senders_slot() -> None:
    path, catalog, pool = datapath()
    tickets = split_tickets(path.prepare_receive(TransferHeader(manifest_of(KEY, DATA, owner="h1"), PutOrigin.REPLICA, "h1"), streams=2))
    assert len(tickets) == 2 and pool.used == len(DATA) and path.saver.admission.open_streams() == {"peer:h1": 1}
    assert not path.saver.arrivals.begin_repair(KEY, restore_first=0.0)  # arriving: repair leaves it alone
    path.expire_tickets(time.monotonic())  # not yet
    assert len(path.tickets) == 2
    path.expire_tickets(time.monotonic() + 3600)  # as the janitor does once the deadline passed
    assert len(path.tickets) == 0 and pool.used == 0 and path.saver.admission.open_streams() == {} and catalog.get(KEY) is None
    assert path.saver.arrivals.begin_repair(KEY, restore_first=0.0)  # no longer arriving: repair may pull it
    path.saver.arrivals.end_repair()


def test_an_expired_send_ticket_unpins_its_copy() -> None:
    path, catalog, pool = datapath()
    entry = settled(catalog, KEY, DATA)
    path.prepare_send(KEY, streams=2)
    assert entry.pins == 2
    catalog.drop(entry, "deleted")
    assert entry.segment not in pool.released  # the tickets still pin it
    path.expire_tickets(time.monotonic() + 3600)
    assert entry.pins == 0 and entry.segment in pool.released
