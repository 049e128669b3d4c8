"""N store processes on 127.0.0.1: for development, the demo, benchmarks and integration tests.

Each store is a real ``python -m memstore serve`` child. ``kill()`` SIGKILLs and reaps one;
``restart()`` starts its replacement (same host id and address, empty RAM). Shipped in the wheel for users' own
tests, as Ray ships ``ray.cluster_utils``; ``memstore local-cluster``, ``memstore demo`` and ``memstore bench`` run on it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import grpc

from memstore.children import child_env, thread_dump
from memstore.core.redundancy import Redundancy
from memstore.v1 import store_pb2 as pb
from memstore.v1.channel import store_stub
from memstore.v1.security import Credentials

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LISTEN_PORTS_BELOW = 32768  # where the kernel's range for outgoing connections starts when it cannot be read
LISTEN_PORTS_SPAN = 16384  # how many ports below that range the picks come from


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that are free now, for a child process to bind a moment later.

    They lie below the kernel's range for outgoing connections (``ip_local_port_range``), which is also where port 0
    binds come from: a cluster of many stores opens hundreds of connections while it starts, and one of them taking a
    port picked from that range made a store exit with "Address already in use" (32 stores: 3 starts in a row). Below
    it, only another process picking the same port in the same moment can take it."""
    top = _ephemeral_low()
    bottom = max(1024, top - LISTEN_PORTS_SPAN)
    picked: list[int] = []
    rng = random.SystemRandom()
    for _ in range(50 * n):
        if len(picked) == n:
            break
        port = rng.randrange(bottom, top)
        if port not in picked and _bindable(host, port):
            picked.append(port)
    if len(picked) < n:
        raise RuntimeError(f"no {n} free ports on {host} in [{bottom}, {top})")
    return picked


def _ephemeral_low() -> int:
    try:
        low = int(Path(EPHEMERAL_RANGE_FILE).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return LISTEN_PORTS_BELOW
    return low if low > 1024 + 1024 else LISTEN_PORTS_BELOW


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def wait_for(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):  # type: ignore[no-untyped-def]
    """Poll ``predicate`` on a monotonic clock until it returns a truthy value or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(interval)


class DnsZone(Protocol):
    """The records of a DNS server, which a test changes while it runs."""

    def set(self, name: str, rtype: str, *values: str) -> None: ...

    def drop(self, name: str) -> None: ...


class ClusterDns(Protocol):
    """A DNS server on 127.0.0.1 for ``LocalCluster(discovery="dns")``; the repository's ``tools.dns_server.DnsServer`` is one."""

    @property
    def zone(self) -> DnsZone: ...

    def url(self, name: str, port: int) -> str:
        """The ``--discovery dns://`` URL of ``name`` on ``port``, answered by this server."""
        ...

    def stop(self) -> None: ...


@dataclass
class StoreProcess:
    host_id: str
    address: str
    args: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    env: dict[str, str] = field(default_factory=dict)  # extra environment of this store only (e.g. MEMSTORE_FAULTS)
    metrics_port: int = 0  # its --metrics-port (0 = off)
    data_port: int = 0  # its --data-port, chosen before it starts (LocalCluster(data_ports=True); 0 = its own choice)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class LocalCluster:
    hosts: int = 4
    replicas: int = 2
    capacity: str = "2GiB"
    base_port: int = 0
    keep: int = 2
    extra_args: list[str] = field(default_factory=list)
    workdir: Path | None = None
    env: dict[str, str] | None = None

    credentials: Credentials | None = None  # what health checks present (default: from the environment)
    discovery: str = "peers"  # "peers": a fixed --peers list; "file": every store follows peers.json (add_host/remove_host edit it);
    # "files": each store follows a file of its own, peers-<host>.json (written alike; a test edits one to see gossip carry it);
    # "dns": every store follows a real DNS server of the cluster's own (``dns``), which ``dns_server()`` starts
    metrics: bool = False  # every store serves Prometheus metrics on a free port of its own (metrics_url)
    data_ports: bool = False  # every store's data channel on a port chosen here (--data-port), known before it starts
    shm_root: str = "/dev/shm"  # the tmpfs the stores' --shm-dir is made in (e.g. one mounted with huge pages)
    # How store ``a`` dials its peer ``b`` (discovery "peers"): dial(a, b, b's address, b's data port) -> the address
    # in a's --peers (e.g. a fault proxy's); None: directly. Called again whenever ports are assigned anew.
    dial: Callable[[str, str, str, int], str] | None = None
    # Starts the DNS server of discovery "dns" (e.g. ``tools.dns_server.DnsServer``, which needs the dev extra's dnslib).
    dns_server: Callable[[], ClusterDns] | None = None
    # The stores' --redundancy (replicas:R or ec:K+M); when given it decides and ``replicas`` becomes what it means
    # (R, or 1 for ec: the owner's copy). None: --replicas ``replicas``.
    redundancy: str | None = None
    stores: dict[str, StoreProcess] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if self.hosts < 1:
            raise ValueError(f"hosts must be >= 1, got {self.hosts}")
        if self.redundancy is not None:
            scheme = Redundancy.parse(self.redundancy)
            if scheme.group_size > self.hosts:
                raise ValueError(f"redundancy {scheme} needs at least {scheme.group_size} hosts, got {self.hosts}")
            self.redundancy, self.replicas = str(scheme), scheme.replicas
        if not 1 <= self.replicas <= self.hosts:
            raise ValueError(f"replicas must be in 1..{self.hosts}, got {self.replicas}")
        if self.discovery not in ("peers", "file", "files", "dns"):
            raise ValueError(f"discovery must be 'peers', 'file', 'files' or 'dns', got {self.discovery!r}")
        if self.discovery == "dns" and self.dns_server is None:
            raise ValueError("discovery='dns' needs dns_server: a factory of the DNS server the stores follow")
        self._own_workdir = self.workdir is None
        self.workdir = Path(self.workdir or tempfile.mkdtemp(prefix="memstore-cluster-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.shm_dir = os.path.join(self.shm_root, f"memstore-{os.getpid()}-{self.workdir.name}")
        self.peers_file = self.workdir / "peers.json"
        self.members: list[str] = [f"h{i}" for i in range(self.hosts)]  # the hosts peers.json lists, in order
        self.dns = self.dns_server() if self.dns_server is not None and self.discovery == "dns" else None
        self._assign_ports()

    def _assign_ports(self) -> None:
        """Give every host a listen port (and a metrics port, a data port), and list them in --peers or peers.json."""
        ids = [f"h{i}" for i in range(self.hosts)]
        if self.discovery == "dns":  # one port, an IP per host, as the pods behind a headless Service
            ports = [self.base_port or free_ports(1)[0]] * self.hosts
        else:
            ports = [self.base_port + i for i in range(self.hosts)] if self.base_port else free_ports(self.hosts)
        data = dict(zip(ids, free_ports(self.hosts) if self.data_ports else [0] * self.hosts, strict=True))
        addresses = {h: f"127.0.0.1:{p}" for h, p in zip(ids, ports, strict=True)}
        for h, p in zip(ids, ports, strict=True):
            peers = ",".join(f"{o}={self._dialled(h, o, a, data[o])}" for o, a in addresses.items())
            env = self.stores[h].env if h in self.stores else {}
            self.stores[h] = self._store_process(h, p, peers, data[h])
            self.stores[h].env = env
        self._write_peers_files()
        if self.discovery == "dns":
            self.publish_dns()

    def peers_file_of(self, host_id: str) -> Path:
        """The peers file the store of ``host_id`` follows (discovery "file" or "files")."""
        assert self.workdir is not None
        return self.workdir / f"peers-{host_id}.json" if self.discovery == "files" else self.peers_file

    def _write_peers_files(self) -> None:
        """Write the members to every peers file a store follows (none unless discovery is "file" or "files")."""
        if self.discovery in ("file", "files"):
            for path in {self.peers_file_of(h) for h in self.stores}:
                self.write_endpoints(path)

    def _dialled(self, host_id: str, peer: str, address: str, data_port: int) -> str:
        return address if self.dial is None or peer == host_id else self.dial(host_id, peer, address, data_port)

    def _store_process(self, host_id: str, port: int, peers: str, data_port: int = 0) -> StoreProcess:
        assert self.workdir is not None
        metrics_port = free_ports(1)[0] if self.metrics else 0
        data_port = data_port or (free_ports(1)[0] if self.data_ports else 0)
        args = self._args(host_id, port, peers) + (["--metrics-port", str(metrics_port)] if metrics_port else [])
        args += ["--data-port", str(data_port)] if data_port else []
        ip = self.dns_ip(host_id) if self.dns is not None else "127.0.0.1"
        return StoreProcess(host_id, f"{ip}:{port}", args, self.workdir / f"{host_id}.log", metrics_port=metrics_port,
                            data_port=data_port)  # fmt: skip

    def _args(self, host_id: str, port: int, peers: str) -> list[str]:
        from_file = ["--peers-file", str(self.peers_file_of(host_id)), "--discovery-interval", "0.5"]
        membership = ["--peers", peers] if self.discovery == "peers" else from_file
        ip = "127.0.0.1"
        if self.dns is not None:
            ip = self.dns_ip(host_id)
            membership = ["--discovery", self.dns.url(self.DNS_NAME, port), "--discovery-interval", "0.5"]
        return [
            sys.executable,
            "-m",
            "memstore",
            "serve",
            "--host-id",
            host_id,
            "--listen",
            f"{ip}:{port}",
            *membership,
            *(["--redundancy", self.redundancy] if self.redundancy is not None else ["--replicas", str(self.replicas)]),
            "--capacity",
            str(self.capacity),
            "--keep",
            str(self.keep),
            "--shm-dir",
            self.shm_dir,
            *self.extra_args,
        ]

    def add_host(self, host_id: str, replacing: str | None = None, timeout: float = 30.0, wait: bool = True) -> str:
        """Start a new store ``host_id`` on a new port and list it in peers.json (in place of ``replacing``,
        which leaves the file). Needs ``discovery="file"``. Returns its address."""
        if self.discovery != "file":
            raise ValueError("add_host needs LocalCluster(discovery='file')")
        if host_id in self.stores:
            raise ValueError(f"host {host_id!r} exists already")
        (port,) = free_ports(1)
        self.stores[host_id] = self._store_process(host_id, port, "")
        if replacing is not None:
            self.members[self.members.index(replacing)] = host_id
        else:
            self.members.append(host_id)
        self._write_peers_files()
        self._spawn(host_id)
        if wait:
            self.wait_healthy(host_id, timeout)
        return self.stores[host_id].address

    def remove_host(self, host_id: str) -> None:
        """Take ``host_id`` out of peers.json (its process, if any, is left alone)."""
        self.members.remove(host_id)
        self._write_peers_files()

    # -- lifecycle ----------------------------------------------------------------
    PORT_CLASH_RETRIES = 2  # fresh ports for a start that lost one of its ports to another process (see start)

    def start(self, timeout: float = 30.0) -> LocalCluster:
        """Start every store and wait until each serves.

        The ports are picked free (``free_ports``) but bound by the stores a moment later; in between, another process
        may take one: the store then exits with "Address already in use". Every store is then stopped and the whole
        cluster starts again on fresh ports."""
        for attempt in range(self.PORT_CLASH_RETRIES + 1):
            for h in self.stores:
                self._spawn(h)
            try:
                for h in self.stores:
                    self.wait_healthy(h, timeout)
                return self
            except RuntimeError as exc:
                if self.base_port or attempt == self.PORT_CLASH_RETRIES or "Address already in use" not in str(exc):
                    raise
                self._kill_all()
                self._assign_ports()
        return self

    def _kill_all(self) -> None:
        for sp in self.stores.values():
            if sp.alive:
                assert sp.proc is not None
                sp.proc.kill()
                sp.proc.wait(timeout=10)

    def _spawn(self, host_id: str) -> None:
        sp = self.stores[host_id]
        log = open(sp.log_path, "ab")  # noqa: SIM115 - owned by the child's lifetime
        env = {**os.environ, **(self.env or {}), **sp.env, **child_env()}
        sp.proc = subprocess.Popen(sp.args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()

    def health(self, host_id: str, timeout: float = 1.0) -> pb.HealthResponse | None:
        channel, stub = store_stub(self.stores[host_id].address, self.credentials)
        with channel:
            try:
                return stub.Health(pb.HealthRequest(), timeout=timeout)
            except grpc.RpcError:
                return None

    def wait_healthy(self, host_id: str, timeout: float = 30.0) -> None:
        sp = self.stores[host_id]

        def ready() -> bool:
            if not sp.alive:
                raise RuntimeError(f"store {host_id} exited with {sp.proc.returncode if sp.proc else None}:\n{self.log_tail(host_id)}")
            h = self.health(host_id)
            return h is not None and h.serving

        wait_for(ready, timeout, what=f"store {host_id} to serve")

    def route(self, from_host: str, to_host: str, address: str) -> None:
        """Make ``from_host`` reach ``to_host`` at ``address`` (e.g. through a fault proxy); applies at its next (re)start."""
        args = self.stores[from_host].args
        if "--peers" not in args:
            raise ValueError("route() needs LocalCluster(discovery='peers')")
        i = args.index("--peers") + 1
        peers = dict(item.split("=", 1) for item in args[i].split(","))
        peers[to_host] = address
        args[i] = ",".join(f"{h}={a}" for h, a in peers.items())

    def kill(self, host_id: str, keep_memory: bool = False) -> None:
        """SIGKILL the store and reap it: the host is lost, and its shared memory with it.

        ``keep_memory=True`` is a crash of the store process alone: its segments stay in shared memory and
        its restart adopts the ones that verify (GEMINI's software failure) instead of repairing from peers.
        """
        sp = self.stores[host_id]
        if sp.proc is not None and sp.proc.poll() is None:
            sp.proc.send_signal(signal.SIGKILL)
            sp.proc.wait(timeout=10)
            if not keep_memory:
                shutil.rmtree(self.segment_dir(host_id), ignore_errors=True)

    def segment_dir(self, host_id: str) -> str:
        """Where the store of ``host_id`` keeps its shared-memory segments."""
        from memstore.server.memory.shm_dirs import segment_dir

        return segment_dir(self.shm_dir, host_id, self.stores[host_id].address)

    def restart(self, host_id: str, timeout: float = 30.0, env: dict[str, str] | None = None, wait: bool = True) -> None:
        """Start ``host_id`` again with the same id and address (``env``: its extra environment).

        A store still running is killed first as a lost host (empty RAM); after ``kill(keep_memory=True)``
        the restart adopts what the crashed process left in shared memory.
        """
        self.kill(host_id)
        self.stores[host_id].restarts += 1
        if env is not None:
            self.stores[host_id].env = dict(env)
        self._spawn(host_id)
        if wait:
            self.wait_healthy(host_id, timeout)

    def stop(self, timeout: float = 10.0) -> None:
        for sp in self.stores.values():
            if sp.alive:
                assert sp.proc is not None
                sp.proc.send_signal(signal.SIGTERM)
        for sp in self.stores.values():
            if sp.proc is not None:
                try:
                    sp.proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    sp.proc.kill()
                    sp.proc.wait(timeout=5)
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        if self.dns is not None:
            self.dns.stop()
        if self._own_workdir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- info -----------------------------------------------------------------------
    @property
    def endpoints(self) -> dict[str, str]:
        return {h: sp.address for h, sp in self.stores.items()}

    def address(self, host_id: str) -> str:
        return self.stores[host_id].address

    def metrics_url(self, host_id: str) -> str:
        """Where the store of ``host_id`` serves Prometheus metrics (``LocalCluster(metrics=True)``)."""
        port = self.stores[host_id].metrics_port
        if not port:
            raise ValueError("metrics_url needs LocalCluster(metrics=True)")
        return f"http://127.0.0.1:{port}/metrics"

    def write_endpoints(self, path: str | Path) -> None:
        """Write ``{"hosts": {id: address}}`` of the member hosts atomically (what --peers-file reads)."""
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json.dumps({"hosts": {h: self.stores[h].address for h in self.members}}, indent=2) + "\n")
        tmp.replace(path)

    # -- discovery through DNS (discovery="dns") ---------------------------------------------------
    DNS_NAME = "stores.memstore.test."

    def dns_ip(self, host_id: str) -> str:
        """The loopback IP of ``host_id`` (``h<i>``) with discovery="dns": 127.0.77.<i+1>."""
        return f"127.0.77.{int(host_id.removeprefix('h')) + 1}"

    def publish_dns(self, hosts: list[str] | None = None) -> None:
        """Make the cluster's DNS name list ``hosts`` (default: every member): their A records, and a PTR record
        each naming the host id (``h0.stores.memstore.test.``), as a headless Service of named pods does."""
        from dns.reversename import from_address  # dnspython: a dependency of the store (--discovery dns://)

        assert self.dns is not None, "publish_dns needs LocalCluster(discovery='dns')"
        ips = {h: self.dns_ip(h) for h in (self.members if hosts is None else hosts)}
        for h, ip in ips.items():
            self.dns.zone.set(str(from_address(ip)), "PTR", f"{h}.{self.DNS_NAME}")
        if ips:
            self.dns.zone.set(self.DNS_NAME, "A", *sorted(ips.values()))
        else:
            self.dns.zone.drop(self.DNS_NAME)

    def thread_dump(self, host_id: str) -> str:
        """Every thread's stack of store ``host_id`` now (``children.thread_dump``), for a test that timed out on it."""
        sp = self.stores[host_id]
        return thread_dump(sp.proc, sp.log_path)

    def log_tail(self, host_id: str, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.stores[host_id].log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""
