"""The test harness's subprocess cluster (``memstore.testing.LocalCluster``) survives a port taken under it,
and shows a store's threads on demand."""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator

import pytest

from memstore.testing import LocalCluster

pytestmark = pytest.mark.integration


@contextlib.contextmanager
def started_with_a_port_taken(cluster: LocalCluster, host: str) -> Iterator[str]:
    """Another process's socket holds ``host``'s port when the cluster starts (it must restart on fresh ports); yields
    the address taken. Stops the cluster afterwards."""
    taken = cluster.stores[host].address
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        squatter.bind(("127.0.0.1", int(taken.rpartition(":")[2])))
        squatter.listen()
        cluster.start(timeout=60)
        yield taken
    finally:
        squatter.close()
        cluster.stop()


def test_a_port_taken_before_the_stores_bind_it_restarts_the_cluster_on_fresh_ports() -> None:
    cluster = LocalCluster(hosts=2, replicas=2, capacity="16MiB")
    with started_with_a_port_taken(cluster, "h0") as taken:
        assert cluster.stores["h0"].address != taken and all(sp.alive for sp in cluster.stores.values())
        assert cluster.health("h1") is not None
        # A store asked for its threads (SIGUSR1) writes their stacks to its log and goes on serving.
        dump = cluster.thread_dump("h1")
        assert "most recent call first" in dump and "in serve" in dump, dump
        assert cluster.health("h1") is not None and cluster.stores["h1"].alive
        # It said at start-up which pages its segments get (memstore.server.memory.shm_pages).
        assert f"segments in {cluster.segment_dir('h1')}: " in cluster.log_tail("h1", lines=400)


def test_a_restart_on_fresh_ports_keeps_each_store_on_its_own_peers_file() -> None:
    """discovery="files": after a port clash restarts the cluster, each store still follows peers-<host>.json (a
    test that edits one store's file must reach that store), and every file lists the new addresses."""
    cluster = LocalCluster(hosts=2, replicas=2, capacity="16MiB", discovery="files")
    with started_with_a_port_taken(cluster, "h1") as taken:
        assert cluster.stores["h1"].address != taken
        for h, sp in cluster.stores.items():
            own = cluster.peers_file_of(h)
            assert own.name == f"peers-{h}.json" and str(own) in sp.args, sp.args
            listed = json.loads(own.read_text())["hosts"]
            assert listed == {o: cluster.stores[o].address for o in cluster.stores}
