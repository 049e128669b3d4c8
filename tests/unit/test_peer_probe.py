"""A starting store's probe of its group (``Peer.list(retrying=False)``) asks once and leaves no mark on a peer that
does not serve yet, so the first repair pass still retries it in full (a fresh cluster's stores start together)."""

from __future__ import annotations

import socket
import time

import pytest

from memstore.errors import StoreError
from memstore.server.peers import Peer

pytestmark = pytest.mark.unit


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_probe_of_a_peer_not_serving_yet_asks_once_and_leaves_it_unsuspected() -> None:
    peer = Peer("h1", f"127.0.0.1:{closed_port()}")
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreError):
            peer.list("", timeout=2.0, retrying=False)
        assert time.monotonic() - t0 < 2.5  # one try, within its timeout: no retry budget spent
        assert peer._suspect_until == 0.0  # the repair pass after it retries in full
        with pytest.raises(StoreError):
            peer.list("", timeout=0.5)  # a retried call that fails marks it suspect, as before
        assert peer._suspect_until > time.monotonic()
    finally:
        peer.close()
