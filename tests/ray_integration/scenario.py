"""The scenario of memstore on a Ray cluster, shared by the tests that run its steps: a store actor per node, saves
from tasks, a node lost, a node added, a node drained, every store stopped (``Scenario``), with the tasks and checks
they use.

Each step needs the state the ones before it leave, so a test asks its module's ``Scenario`` to reach its step: the
steps not yet run run first, in order, with their assertions. Any test passes alone and in any order (the ones
reached earlier are not run twice).
"""

from __future__ import annotations

import glob
import time
from typing import Any

import grpc
import pytest
import ray
from ray.core.generated import autoscaler_pb2
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import memstore.ray as mray
from memstore.errors import ConfigError
from memstore.ray import gcs
from memstore.ray.actor import store_config
from memstore.ray.records import host_id_for
from memstore.ray.stores import DEFAULT_NAMESPACE
from memstore.testing import wait_for
from memstore.v1 import store_pb2 as pb
from memstore.v1.channel import store_stub
from memstore.v1.security import Credentials
from tests.ray_integration.conftest import RayCluster
from tests.states import assert_same, rank_state
from trainer_client import CheckpointClient, Connection

JOB = "ray-job"
SETTINGS: dict[str, Any] = {"discovery_interval": 0.5, "repair_interval": 0.5, "keep": 3}
TOKEN_DIRS = "/dev/shm/memstore-ray-token-*"  # where a store actor keeps the cluster token until its store read it


def on(node_id: str) -> dict[str, Any]:
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


@ray.remote(num_cpus=0)
def store_here() -> tuple[str, str]:
    return gcs.current_node_id(), mray.local_store_address()


@ray.remote(num_cpus=0)
def save_rank(rank: int, world: int, steps: list[int]) -> str:
    connection = mray.local_store_connection(Connection(timeout=20))  # the node's store and the cluster token
    with CheckpointClient(JOB, rank, world, connection=connection, run_id="run1") as client:
        for step in steps:
            assert client.save(step, rank_state(rank, step)).wait(timeout=30).copies == 2
        return str(client.stats().store_host)


@ray.remote(num_cpus=0)
def load_rank(rank: int, world: int, step: int) -> str:
    with CheckpointClient(JOB, rank, world, connection=mray.local_store_connection(Connection(timeout=20)), run_id="reader") as client:
        assert_same(client.load(step, zero_copy=False), rank_state(rank, step))
        return client.stats().last_load_source


def health(address: str, credentials: Credentials | None = None) -> pb.HealthResponse | None:
    channel, stub = store_stub(address, credentials or mray.store_credentials())
    with channel:
        try:
            return stub.Health(pb.HealthRequest(), timeout=2)
        except Exception:
            return None


def refusal(address: str, credentials: Credentials) -> grpc.StatusCode | None:
    """The status a Health call with ``credentials`` gets (None: answered)."""
    channel, stub = store_stub(address, credentials)
    with channel:
        try:
            stub.Health(pb.HealthRequest(), timeout=5)
        except grpc.RpcError as exc:
            return exc.code()
    return None


def slot_holders(address: str) -> list[str]:
    h = health(address)
    return [s.host_id for s in h.slots.slots] if h is not None else []


def converged(addresses: dict[str, str], expected: set[str]) -> bool:
    """Every store's slot table holds exactly ``expected`` (vacant slots are "")."""
    return all(set(slot_holders(a)) - {""} == expected for a in addresses.values())


def held(address: str, step: int) -> set[int]:
    """The ranks of ``step`` the store at ``address`` holds a verified copy of."""
    channel, stub = store_stub(address, mray.store_credentials())
    with channel:
        resp = stub.List(pb.ListRequest(job_id=JOB), timeout=5)
    return {s.manifest.key.rank for s in resp.shards if s.manifest.key.step == step and s.verified}


def copies(addresses: dict[str, str], step: int) -> dict[int, int]:
    """Per rank of ``step``: how many of the stores hold a verified copy."""
    out: dict[int, int] = {}
    for address in addresses.values():
        for rank in held(address, step):
            out[rank] = out.get(rank, 0) + 1
    return out


def start_stores(ray_cluster: RayCluster) -> dict[str, str]:
    return mray.ensure_stores(replicas=2, capacity="128MiB", config={**SETTINGS, "shm_dir": ray_cluster.shm_dir}, timeout=60)


class Scenario:
    """The module's one scenario on its Ray cluster; each method is a step, asserting what it did."""

    STEPS = ("started", "lost", "replaced", "drained", "stopped")

    def __init__(self, ray_cluster: RayCluster) -> None:
        self.ray_cluster = ray_cluster
        self.done: list[str] = []
        self.failed = ""
        self.addresses: dict[str, str] = {}  # node id -> store address of the stores started
        self.survivors: dict[str, str] = {}  # the same, after the lost node
        self.world = 0

    def reach(self, step: str) -> None:
        """Run every step up to ``step`` that has not run yet; a step that failed fails every later request."""
        if self.failed:
            pytest.fail(f"the scenario failed earlier, at step {self.failed!r}")
        for name in self.STEPS[: self.STEPS.index(step) + 1]:
            if name in self.done:
                continue
            try:
                getattr(self, name)()
            except BaseException:
                self.failed = name
                raise
            self.done.append(name)

    def started(self) -> None:
        """One store per node, found from tasks on that node, each with authentication on and no token configured."""
        ray_cluster = self.ray_cluster
        others = set(glob.glob(TOKEN_DIRS))  # left by another run on this machine (a killed one, another worker's)
        addresses = start_stores(ray_cluster)
        assert set(glob.glob(TOKEN_DIRS)) - others == set()  # each actor's token file is gone once its store read it
        token = gcs.Registry(DEFAULT_NAMESPACE).cluster_token()
        assert token and mray.store_credentials().token == token
        assert token.encode() not in (gcs.Registry(DEFAULT_NAMESPACE).settings() or b"")
        for address in addresses.values():
            assert refusal(address, Credentials()) == grpc.StatusCode.UNAUTHENTICATED
            assert refusal(address, Credentials(token="x" * 32)) == grpc.StatusCode.UNAUTHENTICATED
            assert refusal(address, mray.store_credentials()) is None
        with pytest.raises(ConfigError, match="reachable from other machines but no --auth-token-file"):  # what the token avoids
            store_config({"replicas": 2}, "ray-check", "127.0.0.1", "", token_file="")
        alive = set(gcs.alive_nodes())
        assert set(addresses) == alive and len(alive) == 1 + len(ray_cluster.workers)  # the head and the workers
        assert start_stores(ray_cluster) == addresses  # idempotent: the same actors, nothing restarted
        for node_id in alive:
            assert ray.get(store_here.options(**on(node_id)).remote()) == (node_id, addresses[node_id])
        wait_for(lambda: converged(addresses, {host_id_for(n) for n in alive}), 30, what="every store to list all four")
        self.addresses = addresses

    def lost(self) -> None:
        """A lost node's shards restore bit-exact from the survivors, which vacate its slot."""
        ray_cluster, addresses = self.ray_cluster, self.addresses
        nodes = [n.node_id for n in ray_cluster.workers]
        world = len(nodes)
        hosts = ray.get([save_rank.options(**on(n)).remote(rank, world, [1, 2]) for rank, n in enumerate(nodes)])
        assert hosts == [host_id_for(n) for n in nodes]
        lost = ray_cluster.workers[-1]
        lost_id = lost.node_id
        ray_cluster.kill(lost)
        survivors = {n: a for n, a in addresses.items() if n != lost_id}
        wait_for(lambda: lost_id not in gcs.alive_nodes(), 30, what="Ray to declare the killed node dead")
        for rank in range(world):  # every rank, the lost node's included, from a survivor's store
            reader = nodes[(rank + 1) % (world - 1)]
            assert ray.get(load_rank.options(**on(reader)).remote(rank, world, 2)) != host_id_for(lost_id)
        wait_for(lambda: converged(survivors, {host_id_for(n) for n in survivors}), 30, what="the survivors to vacate the lost slot")
        self.world, self.survivors = world, survivors

    def replaced(self) -> None:
        """A new node takes the vacant slot, and only it, and repairs the shards of that slot."""
        ray_cluster, world = self.ray_cluster, self.world
        lost_slot = slot_holders(next(iter(self.survivors.values())))
        new = ray_cluster.add_node()
        ray_cluster.cluster.wait_for_nodes()
        addresses = start_stores(ray_cluster)  # starts only the missing store
        assert {n: a for n, a in addresses.items() if n in self.survivors} == self.survivors
        new_host = host_id_for(new.node_id)
        expected = [new_host if h == "" else h for h in lost_slot]  # the vacant slot, and no other, is taken
        wait_for(lambda: all(slot_holders(a) == expected for a in addresses.values()), 30, what=f"{new_host} to take the vacant slot")
        # At least R copies of every rank (a stand-in copy made while the slot was vacant may stay until retention drops the step).
        wait_for(lambda: all(copies(addresses, 2).get(r, 0) >= 2 for r in range(world)), 60, what="every rank of step 2 to have 2 copies")
        # The lost rank's shard lives on the node of its slot again.
        wait_for(lambda: world - 1 in held(addresses[new.node_id], 2), 60, what=f"{new_host} to repair its slot's shards")
        ray.get(load_rank.options(**on(new.node_id)).remote(world - 1, world, 2))  # the lost rank restores there, bit-exact
        self.addresses = addresses

    def drained(self) -> None:
        """A node drained by Ray's autoscaler call leaves the registry and the slot table, and no shard is lost."""
        ray_cluster, addresses, world = self.ray_cluster, self.addresses, self.world
        victim = ray_cluster.workers[0]
        gcs_client = ray._private.worker.global_worker.gcs_client  # what the autoscaler calls before it scales a node down

        accepted, why = gcs_client.drain_node(
            victim.node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"), "test", int(time.time() * 1000) + 60_000
        )
        assert accepted, why
        wait_for(lambda: victim.node_id not in mray.store_addresses(), 30, what="the drained store to leave the registry")
        assert health(addresses[victim.node_id]).draining  # it says so to readiness probes and `memstore status`
        rest = {n: a for n, a in addresses.items() if n != victim.node_id}
        wait_for(lambda: converged(rest, {host_id_for(n) for n in rest}), 30, what="the others to vacate the drained slot")
        ray_cluster.kill(victim)
        wait_for(lambda: victim.node_id not in gcs.alive_nodes(), 30, what="Ray to declare the drained node dead")
        readers = [n.node_id for n in ray_cluster.workers]
        for rank in range(world):
            ray.get(load_rank.options(**on(readers[rank % len(readers)])).remote(rank, world, 2))

    def stopped(self) -> None:
        """stop_stores stops the store actor of every live node."""
        assert mray.stop_stores() == len(gcs.alive_nodes())
        assert mray.store_addresses() == {}
