"""The ports a local cluster hands its stores: free, distinct, and outside the range outgoing connections take."""

from __future__ import annotations

import socket

import pytest

from memstore import testing as cluster
from memstore.testing import free_ports


def test_ports_are_distinct_bindable_and_below_the_outgoing_range() -> None:
    ports = free_ports(64)
    assert len(set(ports)) == 64
    low = cluster._ephemeral_low()
    assert all(1024 <= p < low for p in ports)
    for p in ports[:8]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_never_handed_out(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(cluster, "_ephemeral_low", lambda: taken + 1)
        monkeypatch.setattr(cluster, "LISTEN_PORTS_SPAN", 1)  # the one port to pick from is in use
        with pytest.raises(RuntimeError, match="no 1 free ports"):
            free_ports(1)
