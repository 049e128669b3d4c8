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
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memstore.bench import rpc
from memstore.bench.options import PREFAULT_ENV, BenchConfig
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

    def command(self) -> str:
        """How the first store runs (its command line, with the environment the bench gave it): recorded with each figure."""
        return ""

    def dump_logs(self) -> None:
        pass

    def stop(self) -> None:
        raise NotImplementedError


class LocalStores(Stores):
    local = True

    def __init__(self, cluster: LocalCluster, job: str = JOB_ID) -> None:
        self.cluster = cluster
        self.hosts = list(cluster.stores)
        self.job = job

    def command(self) -> str:
        sp = self.cluster.stores[self.hosts[0]]
        env = {**(self.cluster.env or {}), **sp.env}
        args = ["memstore", *sp.args[sp.args.index("serve") :]] if "serve" in sp.args else list(sp.args)
        return shlex.join([*(f"{k}={v}" for k, v in sorted(env.items())), *args])

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

    def command(self) -> str:
        return f"already running stores: {', '.join(f'{h}={a}' for h, a in self.endpoints.items())}"

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


def store_env(config: BenchConfig, prefault: str | None = None) -> dict[str, str]:
    """The environment the bench gives its stores: --store-env, then --prefault (or ``prefault``) as MEMSTORE_PREFAULT.
    A store that does not know the setting ignores the variable (environment variables of unknown fields are not read)."""
    env = dict(config.store_env)
    value = prefault if prefault is not None else config.prefault
    if value is not None:
        env[PREFAULT_ENV] = value
    return env


def _prefault_bytes(env: dict[str, str]) -> int:
    """The bytes a store is told to pre-fault (its reserve is part of --capacity, so the capacity must hold it); 0 for auto."""
    from memstore.core.sizes import parse_size

    value = env.get(PREFAULT_ENV, "auto")
    try:
        return 0 if value.strip().lower() == "auto" else parse_size(value.strip())
    except ValueError:
        return 0  # the store says what is wrong with it


def start_stores(
    config: BenchConfig, hosts: int, replicas: int, shard_bytes: int, endpoints: Endpoints | None, *, job: str = JOB_ID,
    prefault: str | None = None, extra_args: list[str] | None = None, capacity_shards: int = 0,
) -> Stores:  # fmt: skip
    """Freshly started local stores (or the --endpoints cluster with a job of its own); ``prefault`` overrides --prefault,
    ``extra_args`` go on every store's command line, ``capacity_shards`` (default keep+3) shards of ``shard_bytes`` fit."""
    if endpoints is not None:
        return RemoteStores(endpoints.hosts, job=f"{job}-{os.getpid()}-{int(time.time() * 1000) % 10**9}")
    # keep+1 shards in use, plus the two segments the automatic reserve (--prefault auto) keeps ready.
    capacity = max((capacity_shards or config.keep + 3) * round_page(shard_bytes), _prefault_bytes(store_env(config, prefault)))
    capacity += CAPACITY_SLACK
    # --repair-interval 3600: after the startup pass (when the stores are still empty) no anti-entropy pass runs during
    # the measurements, so the peer restore of a deleted copy is the Fetch path and nothing else. A replacement store
    # still runs its startup pass (that is how it gets back to R copies after a host loss).
    extra = ["--repair-interval", "3600"]
    if config.data_plane:
        extra += ["--data-plane", config.data_plane]
    extra += extra_args or []
    cluster = LocalCluster(
        hosts=hosts, replicas=replicas, capacity=str(capacity), keep=config.keep, extra_args=extra,
        env=store_env(config, prefault) or None,
    )  # fmt: skip
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return LocalStores(cluster, job)


def wait_stores_idle(stores: Stores, timeout: float = 30.0, step_bytes: int = 8 * MiB) -> float:
    """Wait until every local store's RSS stopped growing and none says it is filling its --prefault reserve (a store
    pre-faulting memory at start-up has done so), as a job's first save comes well after its hosts' stores started; the
    seconds waited (0.0 for stores that are not ours). Nothing is saved or copied meanwhile."""
    from memstore.bench.sysinfo import proc_memory

    pids = [p for p in (stores.pid(h) for h in stores.hosts) if p]
    if not stores.local or not pids:
        return 0.0
    t0 = time.perf_counter()
    last: list[int] | None = None
    while time.perf_counter() - t0 < timeout:
        now = [(m.rss or 0) if (m := proc_memory(p)) else 0 for p in pids]
        steady = last is not None and all(abs(a - b) < step_bytes for a, b in zip(now, last, strict=True))
        if steady and not any(rpc.reserve_filling(a) for a in stores.addresses()):
            break
        last = now
        time.sleep(0.3)
    return time.perf_counter() - t0


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
