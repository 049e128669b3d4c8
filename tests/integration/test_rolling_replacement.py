"""The Kubernetes lifecycle at process level: stores as pods behind a headless Service (a real DNS server on
127.0.0.1), each reached by its node's trainers through a stable node address (a TCP forwarder standing in for
the hostPort), readiness from the standard gRPC health service, and a rolling replacement of every store
while the trainers keep saving (docs/kubernetes.md, "Upgrades")."""

from __future__ import annotations

import threading
import traceback
from pathlib import Path

import pytest

from memstore.testing import wait_for
from tests.harness.pods import Pods
from tests.states import assert_same, rank_state
from tools.dns_server import DnsServer
from trainer_client import CheckpointClient
from trainer_client.errors import MemstoreClientError

pytestmark = pytest.mark.integration


def test_readiness_waits_for_repair(dns_server: DnsServer, tmp_path: Path) -> None:
    """A replacement pod is live at once but ready only once repair has brought what its slot should hold."""
    job, world = "ready-job", 2
    pods = Pods(tmp_path, dns_server, world)
    try:
        pods.start_all()
        for rank in range(world):
            with CheckpointClient(job, rank, world, store=pods.node_address(rank), timeout=20, run_id="run") as c:
                for step in (1, 2):
                    assert c.save(step, rank_state(rank, step)).wait(timeout=30).copies == 2
        pods.drain(1)
        pods.start(1, env={"MEMSTORE_FAULTS": "repair.after_pull=stall:3"})  # the first pulled shard stalls repair 3 s
        new = pods.host_id(1)
        wait_for(lambda: (h := pods.health(1)) is not None and new in [s.host_id for s in h.slots.slots], timeout=30,
                 what="the new pod to take the vacant slot")  # fmt: skip
        assert pods.probe(1, "") == "SERVING"  # live ...
        health = pods.health(1)
        assert health is not None and health.not_ready.startswith("repairing"), health
        assert pods.probe(1) == "NOT_SERVING"  # ... but not ready while repair is stalled
        wait_for(lambda: pods.probe(1) == "SERVING", timeout=30, what="readiness after repair")
        assert pods.held(1, job) >= {(1, 0), (1, 1), (2, 0), (2, 1)}  # R=2 on two nodes: everything, once ready
        assert pods.probe(1, "no.such.Service") == "NOT_FOUND"
    finally:
        pods.close()


def test_first_pod_waits_for_its_dns_records(dns_server: DnsServer, tmp_path: Path) -> None:
    """On a fresh install the headless Service lists nobody for a moment: the store waits instead of exiting."""
    pods = Pods(tmp_path, dns_server, 1, extra=("--replicas", "1"))
    try:
        pods.start(0, publish=False)
        ip = pods.ips[0]
        wait_for(lambda: "waiting for --discovery" in pods.log(ip), timeout=30, what="the store to wait for DNS")
        assert pods.procs[ip].poll() is None, pods.log(ip)
        pods._publish()
        wait_for(lambda: pods.probe(0) == "SERVING", timeout=30, what="readiness once DNS lists the pod")
    finally:
        pods.close()


class Trainer(threading.Thread):
    """One process's save loop for every rank of ``job``: a step counts once every rank's save committed."""

    def __init__(self, pods: Pods, job: str, world: int) -> None:
        super().__init__(name="trainer")
        self.pods, self.job, self.world = pods, job, world
        self.committed: list[int] = []
        self.failed: list[str] = []  # steps refused while a store was replaced (not committed), with why
        self.died: list[str] = []  # what stopped the loop, if anything did (a save hanging past its wait, ...)
        self.stop = threading.Event()

    def run(self) -> None:
        pods, job, world = self.pods, self.job, self.world
        clients = [CheckpointClient(job, r, world, store=pods.node_address(r), timeout=10, run_id="run") for r in range(world)]
        step = 0
        try:
            while not self.stop.is_set():
                step += 1
                try:
                    handles = [c.save(step, rank_state(c.rank, step)) for c in clients]
                    for h in handles:
                        h.wait(timeout=30)
                    self.committed.append(step)
                except MemstoreClientError as exc:  # this rank's store is being replaced: the step is not committed
                    self.failed.append(f"{step}: {exc}")
                self.stop.wait(0.05)
        except Exception:
            self.died.append(f"at step {step}, after {self.failed[-3:]} failed:\n{traceback.format_exc()}")
        finally:
            for c in clients:
                c.close()

    def commits(self, what: str) -> None:
        """Wait for three more committed steps; else fail, saying why (the loop's error, the stores' threads)."""
        seen = len(self.committed)
        try:
            wait_for(lambda: len(self.committed) >= seen + 3 or self.died, timeout=60, what=what)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}; steps that failed lately: {self.failed[-3:]}\n{self.pods.thread_dumps()}") from None
        assert not self.died, f"the trainer stopped {self.died[0]}\n{self.pods.thread_dumps()}"


@pytest.mark.slow  # every store replaced in turn (~27 s on 2 cores); test_readiness_waits_for_repair keeps one replacement
def test_rolling_replacement_loses_no_committed_step(dns_server: DnsServer, tmp_path: Path) -> None:
    """Every store is replaced one at a time (drain, new pod, wait for Ready) while three ranks keep saving."""
    job, world = "rolling-job", 3
    pods = Pods(tmp_path, dns_server, world)
    trainer = Trainer(pods, job, world)
    try:
        pods.start_all()
        first = [pods.host_id(n) for n in range(world)]
        trainer.start()
        for node in range(world):
            trainer.commits(f"the trainer to commit steps before node {node} is replaced")
            before = trainer.committed[-1]
            pods.drain(node)
            pods.start(node)
            wait_for(lambda node=node: pods.probe(node) == "SERVING", timeout=60, what=f"the new pod of node {node} ready")
            with CheckpointClient(job, node, world, store=pods.node_address(node), timeout=20, run_id="run") as c:
                latest = c.latest_step()
                assert latest is not None and latest >= before, (latest, before)
        trainer.commits("the trainer to commit after the last replacement")
        trainer.stop.set()
        trainer.join(timeout=60)
        assert not trainer.is_alive()
        last = trainer.committed[-1]
        for node in range(world):
            with CheckpointClient(job, node, world, store=pods.node_address(node), timeout=20, run_id="run") as c:
                assert c.latest_step() == last
                assert_same(c.load(last), rank_state(node, last))
        health = pods.health(0)
        assert health is not None
        slots = {s.host_id: s.domain for s in health.slots.slots if s.host_id}
        assert slots == {pods.host_id(n): f"zone-{n % 2}" for n in range(world)}  # labels learned over Hello, not DNS
        assert not set(slots) & set(first)  # every store was replaced
    finally:
        trainer.stop.set()
        if trainer.is_alive():
            trainer.join(timeout=60)
        pods.close()
