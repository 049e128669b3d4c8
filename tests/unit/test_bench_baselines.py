"""The bench's baselines measured in this process: a raw TCP transfer's rate, the store's verification of the same bytes."""

from __future__ import annotations

import socket

from memstore.bench.baselines import _receive, baseline_hash


def test_a_tcp_transfer_taken_by_one_recv_still_has_a_rate() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"x" * 4096)  # already in the receive buffer: the first recv takes every byte
        rate = _receive(b, memoryview(bytearray(4096)), 4096)
    assert 0 < rate < float("inf")


def test_the_verification_baseline_hashes_every_byte_on_the_stores_threads() -> None:
    from memstore.server.engine.local_reads import VERIFY_WORKERS

    baseline = baseline_hash(8 << 20, reps=2)
    assert baseline["bytes"] == 8 << 20 and baseline["workers"] == VERIFY_WORKERS and len(baseline["seconds"]) == 2
    assert baseline["p50"] > 0
