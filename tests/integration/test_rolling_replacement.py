"""The Kubernetes lifecycle at process level: stores as pods behind a headless Service (a real DNS server on
127.0.0.1), each reached by its node's trainers through a stable node address (a TCP forwarder standing in for
the hostPort), readiness from the standard gRPC health service, and a rolling replacement of every store
while the trainers keep saving (docs/kubernetes.md, "Upgrades")."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from memstore.devtools.children import child_env
from memstore.devtools.cluster import free_ports, wait_for
from memstore.v1 import store_pb2 as pb
from memstore.v1.channel import store_stub
from tests.harness.dns import DnsServer
from tests.harness.proxy import FaultProxy
from tests.states import assert_same, rank_state
from trainer_client import CheckpointClient
from trainer_client.errors import MemstoreClientError

pytestmark = pytest.mark.integration

SERVICE = "memstore-peers.memstore.svc.cluster.local."
READINESS = "memstore.v1.Store"


class Pods:
    """Store "pods" on 127.0.<gen>.<node>: one gRPC port, health port and data port for all, as in the DaemonSet.
    Each node has a stable address (``node_address``) forwarding to its current pod, like a hostPort."""

    def __init__(self, tmp: Path, dns: DnsServer, nodes: int, extra: tuple[str, ...] = ()) -> None:
        self.tmp, self.dns, self.extra = tmp, dns, extra
        self.port, self.health_port, self.data_port = free_ports(3)
        self.url = dns.url(SERVICE, self.port)
        self.ips: dict[int, str] = {}  # node -> current pod IP
        self.procs: dict[str, subprocess.Popen[bytes]] = {}  # pod IP -> process
        self.generation = 0
        self.proxies = {n: FaultProxy(("127.0.0.1", 1)).start() for n in range(nodes)}

    def node_address(self, node: int) -> str:
        return self.proxies[node].address

    def address(self, node: int) -> str:
        return f"{self.ips[node]}:{self.port}"

    def host_id(self, node: int) -> str:
        return self.ips[node].replace(".", "-")  # no --host-id: the store is named after its pod IP, as DNS names it

    def _publish(self) -> None:
        self.dns.zone.set(SERVICE, "A", *sorted(self.ips.values()))

    def start(self, node: int, env: dict[str, str] | None = None, publish: bool = True) -> None:
        """A new pod for ``node``: a new IP (a new host id), listed in DNS at once (publishNotReadyAddresses)
        unless ``publish`` is False (the records lag: ``_publish()`` later)."""
        self.generation += 1
        ip = f"127.0.{20 + self.generation}.{10 + node}"
        self.ips[node] = ip
        if publish:
            self._publish()
        args = [sys.executable, "-m", "memstore", "serve", "--listen", f"{ip}:{self.port}", "--discovery", self.url,
                "--health-listen", f"{ip}:{self.health_port}", "--data-port", str(self.data_port),
                "--failure-domain", f"zone-{node % 2}", "--replicas", "2", "--keep", "3", "--capacity", "64MiB",
                "--shm-dir", str(self.tmp / "shm"), "--discovery-interval", "0.3", "--repair-interval", "0.3", *self.extra]  # fmt: skip
        with open(self.tmp / f"{ip}.log", "ab") as log:
            self.procs[ip] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**child_env(), **(env or {})})
        self.proxies[node].target = ("127.0.0.1", 1)  # nothing answers until the pod serves
        self.proxies[node].set("cut")
        self.proxies[node].target = (ip, self.port)
        self.proxies[node].set("pass")

    def drain(self, node: int) -> None:
        """What deleting the pod does: the preStop hook's `memstore drain` (the store leaves and exits), then
        the endpoint goes from DNS."""
        ip = self.ips.pop(node)
        drain = subprocess.run(
            [sys.executable, "-m", "memstore", "drain", "--wait", "60"],
            env={**child_env(), "MEMSTORE_LISTEN": f"{ip}:{self.port}"},  # the store container's own env
            capture_output=True, text=True, timeout=90,
        )  # fmt: skip
        assert drain.returncode == 0, drain.stdout + drain.stderr
        assert self.procs[ip].wait(timeout=30) == 0, self.log(ip)
        self._publish()

    def probe(self, node: int, service: str = READINESS) -> str:
        """What the kubelet's gRPC probe sees: SERVING, NOT_SERVING, or the error code's name."""
        with grpc.insecure_channel(f"{self.ips[node]}:{self.health_port}") as channel:
            try:
                resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
            except grpc.RpcError as err:
                return str(err.code().name)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))

    def health(self, node: int) -> pb.HealthResponse | None:
        channel, stub = store_stub(self.address(node))
        with channel:
            try:
                return stub.Health(pb.HealthRequest(), timeout=2)
            except grpc.RpcError:
                return None

    def held(self, node: int, job: str) -> set[tuple[int, int]]:
        channel, stub = store_stub(self.address(node))
        with channel:
            resp = stub.List(pb.ListRequest(job_id=job), timeout=5)
        return {(s.manifest.key.step, s.manifest.key.rank) for s in resp.shards if s.verified}

    def log(self, ip: str) -> str:
        path = self.tmp / f"{ip}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
        for proxy in self.proxies.values():
            proxy.close()


@pytest.fixture
def dns() -> Iterator[DnsServer]:
    server = DnsServer()
    try:
        yield server
    finally:
        server.stop()


def test_readiness_waits_for_repair(dns: DnsServer, tmp_path: Path) -> None:
    """A replacement pod is live at once but ready only once repair has brought what its slot should hold."""
    job, world = "ready-job", 2
    pods = Pods(tmp_path, dns, world)
    try:
        for node in range(world):
            pods.start(node)
        for node in range(world):
            wait_for(lambda node=node: pods.probe(node) == "SERVING", timeout=30, what=f"node {node} ready")
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


def test_first_pod_waits_for_its_dns_records(dns: DnsServer, tmp_path: Path) -> None:
    """On a fresh install the headless Service lists nobody for a moment: the store waits instead of exiting."""
    pods = Pods(tmp_path, dns, 1, extra=("--replicas", "1"))
    try:
        pods.start(0, publish=False)
        ip = pods.ips[0]
        wait_for(lambda: "waiting for --discovery" in pods.log(ip), timeout=30, what="the store to wait for DNS")
        assert pods.procs[ip].poll() is None, pods.log(ip)
        pods._publish()
        wait_for(lambda: pods.probe(0) == "SERVING", timeout=30, what="readiness once DNS lists the pod")
    finally:
        pods.close()


def test_rolling_replacement_loses_no_committed_step(dns: DnsServer, tmp_path: Path) -> None:
    """Every store is replaced one at a time (drain, new pod, wait for Ready) while three ranks keep saving."""
    job, world = "rolling-job", 3
    pods = Pods(tmp_path, dns, world)
    committed: list[int] = []
    failed: list[str] = []
    stop = threading.Event()

    def train() -> None:  # one process's loop for all ranks; a step counts once every rank's save committed
        clients = [CheckpointClient(job, r, world, store=pods.node_address(r), timeout=10, run_id="run") for r in range(world)]
        try:
            for step in range(1, 10_000):
                if stop.is_set():
                    return
                try:
                    handles = [c.save(step, rank_state(c.rank, step)) for c in clients]
                    for h in handles:
                        h.wait(timeout=30)
                    committed.append(step)
                except MemstoreClientError as exc:  # this rank's store is being replaced: the step is not committed
                    failed.append(f"{step}: {exc}")
                stop.wait(0.05)
        finally:
            for c in clients:
                c.close()

    trainer = threading.Thread(target=train, name="trainer")
    try:
        for node in range(world):
            pods.start(node)
        for node in range(world):
            wait_for(lambda node=node: pods.probe(node) == "SERVING", timeout=30, what=f"node {node} ready")
        first = [pods.host_id(n) for n in range(world)]
        trainer.start()
        for node in range(world):
            seen = len(committed)
            wait_for(lambda seen=seen: len(committed) >= seen + 3, timeout=60, what="the trainer to commit steps")
            before = committed[-1]
            pods.drain(node)
            pods.start(node)
            wait_for(lambda node=node: pods.probe(node) == "SERVING", timeout=60, what=f"the new pod of node {node} ready")
            with CheckpointClient(job, node, world, store=pods.node_address(node), timeout=20, run_id="run") as c:
                latest = c.latest_step()
                assert latest is not None and latest >= before, (latest, before)
        seen = len(committed)
        wait_for(lambda: len(committed) >= seen + 3, timeout=60, what="the trainer to commit after the last replacement")
        stop.set()
        trainer.join(timeout=60)
        assert not trainer.is_alive()
        last = committed[-1]
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
        stop.set()
        if trainer.is_alive():
            trainer.join(timeout=60)
        pods.close()
