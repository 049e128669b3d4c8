"""Ray clusters for the ray tests: ``ray.cluster_utils.Cluster`` nodes on 127.0.0.1, one module each, shut down after it.

Every node is a real raylet with its own worker processes; ``remove_node(..., allow_graceful=False)`` kills
it like a crashed machine. Ray is kept on loopback (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` makes it use
127.0.0.1 instead of the machine's routable address) and the GCS declares a node dead after ~2 s.

The stores are tested as on a cluster whose nodes have routable IPs: while a module's cluster runs,
``MEMSTORE_TEST_LOOPBACK_IS_REMOTE=1`` (a test-only switch of ``memstore.config``) makes every store, and the
checks ``ensure_stores`` runs in the caller, treat 127.0.0.1 as reachable from other machines, so a store
without a token refuses to start. The nodes inherit it from this process when they start.

A head starts once per module, given ``START_TIMEOUT_S`` to come up on a loaded 2-core machine; a start that
fails is torn down and retried once, with the cause logged. Only the start is retried, never a test.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.retry import start_with_one_retry

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only (read when ray is imported)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # no token written to ~/.ray for a throwaway cluster
# How long Ray waits for the head's GCS to write its port file (Ray's default, 30 s, is too short on a loaded 2-core
# machine: a fresh-clone run timed out there at "Timed out waiting for file .../gcs_server_port_...").
os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")]))

import ray
from ray.cluster_utils import Cluster

from memstore.config import FORCE_REMOTE_ENV

START_TIMEOUT_S = 120  # for the nodes to register, as for the GCS above
NODE_MEMORY = 80 << 20  # object store per node: the tests pass tensors through memstore, not Ray's object store
SYSTEM_CONFIG = {"health_check_period_ms": 500, "health_check_failure_threshold": 4, "health_check_initial_delay_ms": 0}


class RayCluster:
    """A head node without CPUs (the driver's) plus worker nodes of one CPU each."""

    def __init__(self, workers: int) -> None:
        self._force_remote = os.environ.get(FORCE_REMOTE_ENV)
        os.environ[FORCE_REMOTE_ENV] = "1"  # before any node starts: its raylet and workers inherit it
        self.shm_dir = f"/dev/shm/memstore-raytest-{uuid.uuid4().hex[:8]}"
        self.cluster = Cluster(initialize_head=False)  # nodes added below, so shutdown() stops what a failed start left
        self.workers: list[Any] = []
        try:
            self.cluster.add_node(num_cpus=0, node_ip_address="127.0.0.1", include_dashboard=False,
                                  object_store_memory=NODE_MEMORY, _system_config=SYSTEM_CONFIG)  # fmt: skip
            for _ in range(workers):
                self.add_node()
            ray.init(address=self.cluster.address, _node_ip_address="127.0.0.1", logging_level=logging.WARNING, log_to_driver=False)
            self.cluster.wait_for_nodes(timeout=START_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise

    def add_node(self) -> Any:
        node = self.cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=NODE_MEMORY)
        self.workers.append(node)
        return node

    def kill(self, node: Any) -> None:
        """Kill a worker node's raylet and every process on it (the store actor included), as a crash does."""
        self.cluster.remove_node(node, allow_graceful=False)
        self.workers.remove(node)

    def shutdown(self) -> None:
        try:
            ray.shutdown()
        finally:
            self.cluster.shutdown()
            shutil.rmtree(self.shm_dir, ignore_errors=True)
            if self._force_remote is None:  # the next module's tests (stores on 127.0.0.1 without tokens) run as before
                os.environ.pop(FORCE_REMOTE_ENV, None)
            else:
                os.environ[FORCE_REMOTE_ENV] = self._force_remote


@pytest.fixture(scope="module")
def ray_cluster(request: pytest.FixtureRequest) -> Iterator[RayCluster]:
    workers = getattr(request.module, "RAY_WORKER_NODES", 3)
    cluster = start_with_one_retry(lambda: RayCluster(workers), "Ray cluster")
    try:
        yield cluster
    finally:
        cluster.shutdown()
