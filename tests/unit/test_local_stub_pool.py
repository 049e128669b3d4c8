"""``LocalStub``'s connections, against a fake control socket: concurrent calls on their own connections, idle ones
reused, a failed one dropped, a bound on calls in flight, and ``close()``."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from memstore.v1 import store_pb2 as pb
from memstore.v1.local_control import NUMBERS, OK, FrameError, recv_request, send_response
from trainer_client.transport.local_control_client import LocalStub, RpcFailure

pytestmark = pytest.mark.unit

WAIT = NUMBERS["WaitCommitted"]
RELEASE = NUMBERS["Release"]


class FakeStore:
    """A Unix socket answering each connection on its own thread: ``WaitCommitted`` once ``release`` is set,
    ``Release`` by hanging up (a store that dies mid-call), anything else at once with an empty message."""

    def __init__(self, path: str) -> None:
        self.release = threading.Event()
        self.waiting = threading.Event()  # a WaitCommitted arrived
        self.accepted = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(16)
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.accepted += 1
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    method, _, _ = recv_request(conn)
                except (OSError, FrameError):
                    return
                if method == RELEASE:
                    return
                if method == WAIT:
                    self.waiting.set()
                    self.release.wait(30)
                send_response(conn, OK, b"")

    def close(self) -> None:
        self.release.set()
        self._sock.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[FakeStore]:
    fake = FakeStore(str(tmp_path / "s.sock"))
    try:
        yield fake
    finally:
        fake.close()


def wait_call(store: FakeStore, stub: LocalStub, out: dict[str, Any]) -> threading.Thread:
    """A ``WaitCommitted`` on a thread, blocked in the fake store once this returns."""

    def run() -> None:
        try:
            out["response"] = stub.WaitCommitted(pb.WaitCommittedRequest(), timeout=20)
        except RpcFailure as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert store.waiting.wait(10), "the WaitCommitted never reached the fake store"
    return thread


def test_a_blocked_call_does_not_hold_up_the_next_and_idle_connections_are_reused(store: FakeStore, tmp_path: Path) -> None:
    stub = LocalStub(str(tmp_path / "s.sock"))
    stub.connect(5)
    for _ in range(3):
        stub.Allocate(pb.AllocateRequest(), timeout=5)
    assert store.accepted == 1 and stub.connections == 1  # one after the other: the one connection, reused
    out: dict[str, Any] = {}
    waiter = wait_call(store, stub, out)
    stub.Commit(pb.CommitRequest(), timeout=5)  # returns while the wait is blocked: on a second connection
    assert waiter.is_alive() and not out
    assert stub.connections == 2
    store.release.set()
    waiter.join(10)
    assert "response" in out
    stub.Commit(pb.CommitRequest(), timeout=5)
    assert store.accepted == 2  # both kept: no new connection
    stub.close()
    assert stub.connections == 0


def test_a_connection_whose_call_failed_is_dropped(store: FakeStore, tmp_path: Path) -> None:
    stub = LocalStub(str(tmp_path / "s.sock"))
    with pytest.raises(RpcFailure) as err:
        stub.Release(pb.ReleaseRequest(), timeout=5)  # the fake store hangs up mid-call
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and err.value.sent
    assert stub.connections == 0
    stub.Allocate(pb.AllocateRequest(), timeout=5)  # a new connection, not the broken one
    assert store.accepted == 2 and stub.connections == 1
    stub.close()


def test_calls_beyond_the_bound_wait_for_a_connection(store: FakeStore, tmp_path: Path) -> None:
    stub = LocalStub(str(tmp_path / "s.sock"), max_connections=1)
    out: dict[str, Any] = {}
    waiter = wait_call(store, stub, out)
    with pytest.raises(RpcFailure) as err:  # the one connection is taken; this call gives up at its timeout
        stub.Allocate(pb.AllocateRequest(), timeout=0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not err.value.sent
    store.release.set()
    waiter.join(10)
    stub.Allocate(pb.AllocateRequest(), timeout=5)
    assert store.accepted == 1
    with pytest.raises(ValueError, match="max_connections"):
        LocalStub("x", max_connections=0)


def test_close_closes_idle_connections_now_and_busy_ones_when_their_call_ends(store: FakeStore, tmp_path: Path) -> None:
    stub = LocalStub(str(tmp_path / "s.sock"))
    out: dict[str, Any] = {}
    waiter = wait_call(store, stub, out)
    stub.Allocate(pb.AllocateRequest(), timeout=5)
    assert stub.connections == 2
    stub.close()
    assert stub.connections == 0 and waiter.is_alive()  # the call in flight is not cut short
    store.release.set()
    waiter.join(10)
    assert "response" in out and stub.connections == 0  # ... and its connection is not kept
    stub.Allocate(pb.AllocateRequest(), timeout=5)  # a later call opens a new one
    assert store.accepted == 3 and stub.connections == 1
    stub.close()


def test_an_unreachable_socket_is_unavailable_and_not_sent(tmp_path: Path) -> None:
    stub = LocalStub(str(tmp_path / "none.sock"))
    with pytest.raises(RpcFailure) as err:
        stub.Commit(pb.CommitRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and not err.value.sent
