"""The network of one recovery-matrix row through fault proxies (:class:`tools.faultproxy.FaultProxy`):
each store-to-store link, and each rank's link to its store, a proxy pair of its own that a network fault cuts,
stalls, slows or corrupts.

A link is a loopback alias of its own: store ``h<i>`` dials its peer ``h<j>`` at ``127.77.<i+1>.<j+1>``, rank ``r``
dials its store ``h<j>`` at ``127.78.<r+1>.<j+1>``. On the alias, one proxy listens on the peer's gRPC port and one
on its data channel port: the peer hands out its data port in tickets and the dialler connects to that port on the
host it dialled, so the bulk bytes cross the link too (the stores' data ports are chosen before they start:
``LocalCluster(data_ports=True)``).
"""

from __future__ import annotations

import socket
import threading
import time

from tools.faultproxy import FaultProxy


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


class Link:
    """One directed link: the gRPC proxy and the data channel proxy that stand in for one peer on one alias."""

    def __init__(self, alias: str, address: str, data_port: int) -> None:
        host, port = _host_port(address)
        self.target = (address, data_port)
        self.grpc = FaultProxy((host, port), listen=(alias, port)).start()
        self.data = FaultProxy((host, data_port), listen=(alias, data_port)).start() if data_port else None
        self.address = f"{alias}:{port}"

    @property
    def proxies(self) -> list[FaultProxy]:
        return [self.grpc] + ([self.data] if self.data else [])

    def close(self) -> None:
        for p in self.proxies:
            p.close()


class Links:
    """Every proxied link of a row, by (dialler, peer): stores' links through :meth:`dial` (``LocalCluster.dial``),
    ranks' through :meth:`client`."""

    def __init__(self) -> None:
        self.stores: dict[tuple[str, str], Link] = {}
        self.clients: dict[int, Link] = {}

    def dial(self, host: str, peer: str, address: str, data_port: int) -> str:
        """Where store ``host`` dials ``peer`` (at ``address``, data channel on ``data_port``): the link's alias."""
        self.stores[(host, peer)] = self._link(self.stores.get((host, peer)), f"127.77.{_index(host)}.{_index(peer)}", address, data_port)
        return self.stores[(host, peer)].address

    def client(self, rank: int, host: str, address: str, data_port: int) -> str:
        """Where rank ``rank`` dials its store ``host``: the link's alias."""
        self.clients[rank] = self._link(self.clients.get(rank), f"127.78.{rank + 1}.{_index(host)}", address, data_port)
        return self.clients[rank].address

    @staticmethod
    def _link(old: Link | None, alias: str, address: str, data_port: int) -> Link:
        if old is not None and old.target == (address, data_port):
            return old
        if old is not None:
            old.close()
        return Link(alias, address, data_port)

    def of_host(self, host: str) -> list[Link]:
        """The links between store ``host`` and its peers, both ways."""
        return [link for (a, b), link in self.stores.items() if host in (a, b)]

    def close(self) -> None:
        for link in [*self.stores.values(), *self.clients.values()]:
            link.close()
        self.stores.clear()
        self.clients.clear()


def set_links(links: list[Link], mode: str, rate: int = 0, every: int = 0, direction: str = "up", data_only: bool = False) -> None:
    """Put every proxy of ``links`` (only the data channel's with ``data_only``) in ``mode`` (FaultProxy.set)."""
    for link in links:
        for p in [link.data] if data_only else link.proxies:
            if p is not None:
                p.set(mode, rate=rate, every=every, direction=direction)


def _index(host: str) -> int:
    """1 + the number in a host id ``h<n>`` (an alias's octet; 250 for any other id, e.g. a replacement's)."""
    return int(host[1:]) + 1 if host[1:].isdigit() and int(host[1:]) < 250 else 250


def unthrottled_rate(probes: int = 3) -> int:
    """Bytes per second one proxied link carries on this machine with nothing throttling it: the best of ``probes``
    runs of 16 MiB through a FaultProxy on a loopback alias into a sink (a busy machine slows some runs)."""
    return max(_probe_rate(16 << 20) for _ in range(probes))


def _probe_rate(nbytes: int) -> int:
    with socket.create_server(("127.0.0.1", 0)) as server:
        received = threading.Event()

        def sink() -> None:
            conn, _ = server.accept()
            with conn:
                got = 0
                while got < nbytes and (piece := conn.recv(1 << 20)):
                    got += len(piece)
            received.set()

        threading.Thread(target=sink, daemon=True).start()
        with FaultProxy(server.getsockname(), listen=("127.77.254.254", 0)) as proxy:
            piece = b"\0" * (1 << 20)
            t0 = time.monotonic()
            with socket.create_connection(_host_port(proxy.address)) as conn:
                for _ in range(nbytes // len(piece)):
                    conn.sendall(piece)
                if not received.wait(timeout=30):
                    raise TimeoutError("the rate probe's bytes did not arrive through the proxy within 30 s")
            return int(nbytes / (time.monotonic() - t0))
