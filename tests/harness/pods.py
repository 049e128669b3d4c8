"""Store "pods" for Kubernetes-lifecycle tests: processes on loopback IPs behind a real DNS server, each node with a
stable address forwarding to its current pod (the hostPort), probed like the kubelet does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc

from memstore.children import child_env, thread_dump
from memstore.testing import free_ports, wait_for
from memstore.v1 import store_pb2 as pb
from memstore.v1.channel import store_stub
from tests.harness.health import probe
from tools.dns_server import DnsServer
from tools.faultproxy import FaultProxy

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

    def start_all(self, timeout: float = 30.0) -> None:
        """A pod on every node, each listed in DNS at once; returns when every one is Ready."""
        for node in self.proxies:
            self.start(node)
        for node in self.proxies:
            wait_for(lambda node=node: self.probe(node) == "SERVING", timeout=timeout, what=f"node {node} ready")

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
        return probe(f"{self.ips[node]}:{self.health_port}", service)

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

    def thread_dumps(self) -> str:
        """Every current pod's log tail and thread stacks now, for a test that timed out waiting on them."""
        out = []
        for node, ip in sorted(self.ips.items()):
            tail = self.log(ip)
            out.append(f"--- node {node} ({ip}): log ends\n{tail}\n--- its threads\n{thread_dump(self.procs[ip], self.tmp / f'{ip}.log')}")
        return "\n".join(out)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
        for proxy in self.proxies.values():
            proxy.close()
