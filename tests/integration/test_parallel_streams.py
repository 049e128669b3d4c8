"""One shard moved store to store on P parallel data-channel streams (issue 28): byte-exact, verified per chunk on
every stream, and all or nothing: a corrupt chunk or a stream that dies fails the shard, registers nothing and
frees the receiver's memory."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from memstore import faults
from memstore.config import StoreConfig
from memstore.core.model import Manifest, PutOrigin, ShardKey, TransferHeader
from memstore.errors import ChecksumMismatch, ConfigError, DataChannelError, PeerUnavailable
from memstore.server.convert import transfer_to_pb
from memstore.server.peers import PeerDirectory
from memstore.testing import wait_for
from memstore.v1.datachannel import (
    await_close,
    byte_span,
    connect,
    granted_streams,
    part_spans,
    read_status,
    send_chunks,
    split_tickets,
    stream_count,
)
from memstore.v1.integrity import StreamedChecksums, compute_checksums
from tests.harness.inprocess import store_config

CHUNK = 64 << 10
NBYTES = 16 * CHUNK + 1000  # 17 chunks: 4 streams of 4, 4, 4 and 5 chunks
JOB = "streams"


@pytest.fixture
def pair(make_inprocess_cluster) -> Iterator[Any]:  # type: ignore[no-untyped-def]
    cluster = make_inprocess_cluster(
        hosts=2, replicas=2, capacity="64MiB", extra_args=["--chunk-bytes", str(CHUNK), "--transfer-streams", "4"]
    )
    wait_for(lambda: {"h0", "h1"} <= set(cluster.servers), timeout=10, what="both stores to serve")
    directory = PeerDirectory("h0", [("h0", cluster.address("h0")), ("h1", cluster.address("h1"))])
    yield cluster, directory
    directory.close()


def shard(step: int, data: bytearray) -> TransferHeader:
    m = Manifest(ShardKey(JOB, step, 0), 1, len(data), CHUNK, tuple(compute_checksums(memoryview(data), len(data), CHUNK)), "h0")
    return TransferHeader(m, PutOrigin.REPLICA, "h0")


def held(cluster: Any, host: str) -> set[int]:
    return {e.manifest.key.step for e in cluster.servers[host].store.catalog.list_shards(JOB)}


def used(cluster: Any, host: str) -> int:
    return int(cluster.servers[host].store.catalog.pool.in_use_bytes)


def test_four_streams_round_trip_byte_exact(pair) -> None:  # type: ignore[no-untyped-def]
    cluster, peers = pair
    data = bytearray(os.urandom(NBYTES))
    header = shard(1, data)
    peers["h1"].push_data(header, memoryview(data), 10.0, 5.0, streams=4)
    assert held(cluster, "h1") == {1}
    got = bytearray(NBYTES)
    m = peers["h1"].pull_data(header.manifest.key, lambda _m: memoryview(got), 10.0, 5.0, streams=4)
    assert m.checksums == header.manifest.checksums and got == data


def test_a_corrupt_chunk_on_one_stream_is_refused_and_nothing_is_registered(pair) -> None:  # type: ignore[no-untyped-def]
    cluster, peers = pair
    data = bytearray(os.urandom(NBYTES))
    header = shard(2, data)
    off, _ = byte_span(NBYTES, CHUNK, part_spans(NBYTES, CHUNK, 4)[2])  # the third stream's first chunk
    data[off + 7] ^= 0xFF
    before = used(cluster, "h1")
    with pytest.raises(ChecksumMismatch, match="chunk 8"):
        peers["h1"].push_data(header, memoryview(data), 10.0, 5.0, streams=4)
    assert held(cluster, "h1") == set()
    wait_for(lambda: used(cluster, "h1") == before, timeout=5, what="the refused shard's memory to be freed")


def test_a_stream_that_dies_midway_fails_the_transfer_and_frees_the_memory(pair, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    cluster, peers = pair
    data = bytearray(os.urandom(NBYTES))
    before = used(cluster, "h1")
    monkeypatch.setattr(faults, "_PLAN", {"receive.after_chunk": (6, "error", 0.0)})  # some stream, mid-way
    monkeypatch.setattr(faults, "_HITS", {})
    with pytest.raises(PeerUnavailable):
        peers["h1"].push_data(shard(3, data), memoryview(data), 10.0, 5.0, streams=4)
    assert held(cluster, "h1") == set()
    wait_for(lambda: used(cluster, "h1") == before, timeout=5, what="the failed shard's memory to be freed")
    monkeypatch.setattr(faults, "_PLAN", {})
    peers["h1"].push_data(shard(3, data), memoryview(data), 10.0, 5.0, streams=4)  # nothing half-registered blocks a retry
    assert held(cluster, "h1") == {3}


def test_a_stream_that_never_connects_fails_the_others_once_its_ticket_expires(pair) -> None:  # type: ignore[no-untyped-def]
    cluster, peers = pair
    data = bytearray(os.urandom(NBYTES))
    header = shard(6, data)
    before = used(cluster, "h1")
    wire = transfer_to_pb(header)
    wire.streams = 4
    answer = peers["h1"].stub.PrepareReceive(wire, timeout=5.0)
    tickets = split_tickets(answer.ticket)
    spans = part_spans(NBYTES, CHUNK, len(tickets))
    assert len(tickets) == 4
    deadline = time.monotonic() + 10.0
    socks = []
    for ticket, chunks in list(zip(tickets, spans, strict=True))[:3]:  # the fourth stream never comes
        sock = connect("127.0.0.1", answer.data_port, 5.0)
        sock.sendall(ticket)
        send_chunks(sock, memoryview(data), CHUNK, chunks, deadline)
        socks.append(sock)
    cluster.servers["h1"].store.datapath.expire_tickets(time.monotonic() + 3600)  # as the janitor does once the deadline passed
    for sock in socks:  # each is told the shard failed (or reset, when it closed with bytes still unread)
        with sock, contextlib.suppress(DataChannelError):
            assert "expired" in (read_status(sock, deadline) or "")
    assert held(cluster, "h1") == set()
    wait_for(lambda: used(cluster, "h1") == before, timeout=5, what="the shard's memory to be freed")


def test_streamed_checksums_register_the_true_ones(pair) -> None:  # type: ignore[no-untyped-def]
    cluster, peers = pair
    data = bytearray(os.urandom(NBYTES))
    true = shard(4, data)
    placeholders = replace(true, manifest=replace(true.manifest, checksums=(0,) * len(true.manifest.checksums)))
    sums = StreamedChecksums(NBYTES, CHUNK)
    peers["h1"].push_data(placeholders, memoryview(data), 10.0, 5.0, streams=4, sums=sums)
    assert sums.complete(memoryview(data)) == true.manifest.checksums
    (info,) = cluster.servers["h1"].store.catalog.list_shards(JOB)
    assert info.manifest.checksums == true.manifest.checksums  # the receiver's manifest: what came with the chunks


def test_streamed_checksums_catch_a_capture_that_changed_after_hashing(pair) -> None:  # type: ignore[no-untyped-def]
    cluster, peers = pair
    data = bytearray(os.urandom(NBYTES))
    true = shard(5, data)
    placeholders = replace(true, manifest=replace(true.manifest, checksums=(0,) * len(true.manifest.checksums)))
    sums = StreamedChecksums(NBYTES, CHUNK)
    sums.of(9, memoryview(data))  # chunk 9 hashed, then its bytes change before they are sent
    data[9 * CHUNK + 3] ^= 0x01
    with pytest.raises(ChecksumMismatch, match="chunk 9"):
        peers["h1"].push_data(placeholders, memoryview(data), 10.0, 5.0, streams=4, sums=sums)
    assert held(cluster, "h1") == set()


def test_a_push_from_the_segment_file_sends_the_files_pages(pair, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With the segment's file (``source_fd``) the chunks go by reference (``sendfile``), on every stream: the receiver
    gets the file's bytes. The view given beside it holds zeros, so a push that copied the view would be refused."""
    cluster, peers = pair
    data = bytearray(os.urandom(NBYTES))
    path = tmp_path / "segment"
    path.write_bytes(bytes(data) + bytes(CHUNK))  # a segment is often longer than its shard
    fd = os.open(path, os.O_RDONLY)
    try:
        peers["h1"].push_data(shard(7, data), memoryview(bytearray(NBYTES)), 10.0, 5.0, streams=4, source_fd=fd)
    finally:
        os.close(fd)
    assert 7 in held(cluster, "h1")
    got = bytearray(NBYTES)
    peers["h1"].pull_data(ShardKey(JOB, 7, 0), lambda _m: memoryview(got), 10.0, 5.0, streams=4)  # served from its file
    assert got == data


def test_a_sender_by_reference_waits_for_the_receiver_to_close() -> None:
    """Pages sent by reference must not change until the receiver read them: the holder of a pulled shard keeps it
    pinned until the puller closes (``await_close``), and gives up at the deadline."""
    import socket

    a, b = socket.socketpair()
    with a, b:
        b.close()
        await_close(a, time.monotonic() + 5)  # closed: returns at once
    a, b = socket.socketpair()
    with a, b:
        start = time.monotonic()
        with pytest.raises(DataChannelError, match="did not close"):
            await_close(a, start + 0.3)
        assert time.monotonic() - start >= 0.3


def test_streams_come_from_the_size_and_the_flag() -> None:
    assert stream_count(1 << 30, 4 << 20) == 4 and stream_count(63 << 20, 4 << 20) == 1  # auto
    assert stream_count(1 << 30, 4 << 20, 2) == 2 and stream_count(3 * CHUNK, CHUNK, 8) == 3  # the flag; one chunk per stream at most
    assert granted_streams(0, 1 << 30, 4 << 20) == 1 and granted_streams(16, 1 << 30, 4 << 20, 0) == 4
    spans = part_spans(NBYTES, CHUNK, 4)
    assert spans == [(0, 4), (4, 8), (8, 12), (12, 17)]
    assert sum(byte_span(NBYTES, CHUNK, s)[1] for s in spans) == NBYTES


def test_transfer_streams_flag_is_validated() -> None:
    args = ["--host-id", "h0", "--replicas", "1", "--transfer-streams"]
    assert store_config([*args, "auto"], {}).transfer_streams == 0
    assert store_config([*args, "3"], {}).transfer_streams == 3
    for bad in ("0x", "17", "-1", "many"):
        with pytest.raises(ConfigError, match="--transfer-streams"):
            store_config([*args, bad], {})
    for value in (float("inf"), float("nan"), 2.5):  # a config file's values (the property test found inf)
        with pytest.raises(ConfigError, match="--transfer-streams"):
            StoreConfig.load({"transfer_streams": value, "host_id": "h0"}, env={})
