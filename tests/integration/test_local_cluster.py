"""The test harness's subprocess cluster (``memstore.devtools.cluster.LocalCluster``) survives a port taken under it,
and shows a store's threads on demand."""

from __future__ import annotations

import socket

import pytest

from memstore.devtools.cluster import LocalCluster

pytestmark = pytest.mark.integration


def test_a_port_taken_before_the_stores_bind_it_restarts_the_cluster_on_fresh_ports() -> None:
    cluster = LocalCluster(hosts=2, replicas=2, capacity="16MiB")
    taken = cluster.stores["h0"].address
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        squatter.bind(("127.0.0.1", int(taken.rpartition(":")[2])))
        squatter.listen()
        cluster.start(timeout=60)
        assert cluster.stores["h0"].address != taken and all(sp.alive for sp in cluster.stores.values())
        assert cluster.health("h1") is not None
        # A store asked for its threads (SIGUSR1) writes their stacks to its log and goes on serving.
        dump = cluster.thread_dump("h1")
        assert "most recent call first" in dump and "in serve" in dump, dump
        assert cluster.health("h1") is not None and cluster.stores["h1"].alive
    finally:
        squatter.close()
        cluster.stop()
