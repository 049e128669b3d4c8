"""The stores a scenario runs on: an embedded :class:`~memstore.devtools.cluster.LocalCluster`, or an already running
cluster (``--endpoints``); and what the bench reads from the stores' logs.

This is the one module of the bench that imports :mod:`memstore.devtools.cluster` (the others, and
``spill_impact``, take ``LocalCluster`` and ``free_ports`` from here).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memstore.bench import rpc
from memstore.bench.options import BenchConfig
from memstore.bench.scenario_results import Endpoints, PullNote
from memstore.bench.sysinfo import listening_pid
from memstore.bench.units import MiB, round_page
from memstore.devtools.cluster import LocalCluster, free_ports, wait_for
from memstore.errors import BenchSetupError

__all__ = ["LocalCluster", "Stores", "free_ports", "load_endpoints", "start_stores", "wait"]

JOB_ID = "bench"
CAPACITY_SLACK = 64 * MiB


def wait(predicate: Callable[[], Any], timeout: float, interval: float, what: str) -> Any:
    return wait_for(predicate, timeout, interval=interval, what=what)


class Stores:
    """The stores a scenario runs on. ``local``: this bench started them and may kill and restart them."""

    local = False
    hosts: list[str]
    job: str

    def address(self, host: str) -> str:
        raise NotImplementedError

    def addresses(self) -> list[str]:
        return [self.address(h) for h in self.hosts]

    def pid(self, host: str) -> int | None:
        raise NotImplementedError

    def kill(self, host: str) -> None:
        raise NotImplementedError

    def restart(self, host: str) -> None:
        raise NotImplementedError

    def log_text(self, host: str) -> str:
        return ""

    def dump_logs(self) -> None:
        pass

    def stop(self) -> None:
        raise NotImplementedError


class LocalStores(Stores):
    local = True

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.hosts = list(cluster.stores)
        self.job = JOB_ID

    def address(self, host: str) -> str:
        return self.cluster.address(host)

    def pid(self, host: str) -> int | None:
        proc = self.cluster.stores[host].proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def kill(self, host: str) -> None:
        self.cluster.kill(host)

    def restart(self, host: str) -> None:
        self.cluster.restart(host, timeout=60)

    def log_text(self, host: str) -> str:
        with contextlib.suppress(OSError):
            return self.cluster.stores[host].log_path.read_text(errors="replace")
        return ""

    def dump_logs(self) -> None:
        for h in self.hosts:
            tail = self.cluster.log_tail(h, lines=30)
            if tail:
                print(f"--- log of store {h} ---\n{tail}", file=sys.stderr)

    def stop(self) -> None:
        self.cluster.stop()


class RemoteStores(Stores):
    """An already running cluster; the bench's shards go to a job of its own, deleted at the end."""

    def __init__(self, endpoints: dict[str, str], job: str) -> None:
        self.endpoints = dict(endpoints)
        self.hosts = list(endpoints)
        self.job = job
        self._pids = {h: listening_pid(a) for h, a in endpoints.items()}

    def address(self, host: str) -> str:
        return self.endpoints[host]

    def pid(self, host: str) -> int | None:
        return self._pids.get(host)

    def stop(self) -> None:
        for a in self.addresses():
            with contextlib.suppress(Exception):
                rpc.delete(a, self.job)


def load_endpoints(path: str) -> Endpoints:
    """Read an endpoints file and ask its first store for R and the capacity."""
    try:
        data = json.loads(Path(path).read_text())
        hosts = {str(k): str(v) for k, v in data["hosts"].items()}
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
        raise BenchSetupError(f'--endpoints {path}: expected JSON {{"hosts": {{"<id>": "HOST:PORT", ...}}}}: {exc}') from None
    if not hosts:
        raise BenchSetupError(f"--endpoints {path} lists no hosts")
    first = next(iter(hosts.values()))
    hello = rpc.hello(first)
    if hello is None:
        raise BenchSetupError(f"--endpoints {path}: the store at {first} does not answer")
    unreachable = [h for h, a in hosts.items() if rpc.health(a) is None]
    if unreachable:
        raise BenchSetupError(f"--endpoints {path}: stores {', '.join(unreachable)} do not answer")
    return Endpoints(
        path=path,
        hosts=hosts,
        replicas=int(hello.replicas),
        capacity_bytes=int(hello.capacity_bytes),
        version=hello.version,
        placement=hello.placement,
        data_port=int(hello.data_port),
        local_pids={h: listening_pid(a) for h, a in hosts.items()},
    )


def start_stores(config: BenchConfig, hosts: int, replicas: int, shard_bytes: int, endpoints: Endpoints | None) -> Stores:
    if endpoints is not None:
        return RemoteStores(endpoints.hosts, job=f"bench-{os.getpid()}-{int(time.time())}")
    capacity = (config.keep + 1) * round_page(shard_bytes) + CAPACITY_SLACK
    # --repair-interval 3600: after the startup pass (when the stores are still empty) no anti-entropy pass runs during
    # the measurements, so the peer restore of a deleted copy is the Fetch path and nothing else. A replacement store
    # still runs its startup pass (that is how it gets back to R copies after a host loss).
    extra = ["--repair-interval", "3600"]
    if config.data_plane:
        extra += ["--data-plane", config.data_plane]
    cluster = LocalCluster(
        hosts=hosts, replicas=replicas, capacity=str(capacity), keep=config.keep, extra_args=extra, env=dict(config.store_env) or None
    )
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return LocalStores(cluster)


def caught_up(stores: Stores, host: str, keep: int) -> bool:
    """``host`` holds the newest ``keep`` steps of the job that any store holds, and runs no repair."""
    union: set[int] = set()
    for h in stores.hosts:
        steps = rpc.job_steps(stores.address(h), stores.job)
        if steps is None:
            return False
        union |= steps
    mine = rpc.job_steps(stores.address(host), stores.job)
    health = rpc.health(stores.address(host))
    return mine is not None and health is not None and mine >= set(sorted(union)[-keep:]) and health.repairs_in_flight == 0


_PULLED = re.compile(r"(fetch|repair): pulled (\S+) from (\S+)")
_SERVING = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*store \S+ serving on", re.MULTILINE)


def pull_notes(log_text: str) -> list[PullNote]:
    """The store's 'fetch: pulled' / 'repair: pulled' log lines since its last start."""
    start = log_text.rfind("serving on")
    tail = log_text[start:] if start >= 0 else log_text
    return [PullNote(by=m.group(1), key=m.group(2), source=m.group(3)) for m in _PULLED.finditer(tail)]


def serving_unix(log_text: str) -> float | None:
    """Wall-clock time of the store's last 'serving on' log line (logging's asctime, local time, ms)."""
    matches = list(_SERVING.finditer(log_text))
    if not matches:
        return None
    m = matches[-1]
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000.0
