"""The stores the bench runs on (a :class:`~memstore.testing.LocalCluster` on 127.0.0.1) and the restarted
trainer every restore runs in: a NEW process, this module run as ``python -m memstore.bench.rig``, which imports
torch, says it is ready, then on one JSON line from the bench restores and reports, timed: from a store (connect and
``load()`` the newest step) or, for the baseline, from a file (``torch.load``). Both start from a fresh process's memory.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from memstore.bench.state import MiB, module_env
from memstore.core.sizes import parse_size
from memstore.testing import LocalCluster, wait_for

CAPACITY_SLACK = 64 * MiB
SHM_ROOT = "/dev/shm"  # where the stores' segment directories go unless --shm-dir says otherwise


def start_cluster(
    hosts: int, replicas: int, keep: int, shard_bytes: int, data_plane: str | None, env: dict[str, str], shm_root: str = SHM_ROOT,
    redundancy: str | None = None,
) -> LocalCluster:  # fmt: skip
    """Freshly started stores with room for keep+3 shards (keep steps, one being saved, the automatic reserve's two
    segments) and the small saves, or for an explicit ``--prefault`` if that is more. ``--repair-interval 3600``: no
    anti-entropy pass runs during the measurements (a
    replacement store still runs its start-up pass: that is how it gets back to R copies after a host loss).
    ``shm_root``: the tmpfs their segment directories are made in (``--shm-dir``); ``redundancy``: their
    ``--redundancy`` (e.g. ``ec:4+1``; None: ``--replicas replicas``)."""
    page = os.sysconf("SC_PAGE_SIZE")
    capacity = (keep + 3) * (-(-shard_bytes // page) * page) + CAPACITY_SLACK
    prefault = env.get("MEMSTORE_PREFAULT", "auto")
    if prefault not in ("auto", "0"):  # an explicit reserve is part of the capacity: room for it beside the shards
        capacity = max(capacity, parse_size(prefault) + CAPACITY_SLACK)
    extra = ["--repair-interval", "3600"] + (["--data-plane", data_plane] if data_plane else [])
    cluster = LocalCluster(
        hosts=hosts, replicas=replicas, capacity=str(capacity), keep=keep, extra_args=extra, env=env or None, shm_root=shm_root,
        redundancy=redundancy,
    )  # fmt: skip
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster


@contextmanager
def running(cluster: LocalCluster) -> Iterator[LocalCluster]:
    """``cluster`` while a measurement runs on it: its stores' log tails printed when the measurement fails, the
    stores stopped either way."""
    try:
        yield cluster
    except BaseException:
        for h in cluster.stores:
            print(f"--- log of store {h} ---\n{cluster.log_tail(h, lines=30)}", file=sys.stderr)
        raise
    finally:
        cluster.stop()


def store_rpc(address: str, method: str, request: Any) -> Any:
    """One call to the store at ``address`` on a fresh channel (a replaced store comes back on the same address); None
    when it does not answer."""
    import grpc

    from memstore.v1.channel import store_stub

    ch, stub = store_stub(address)
    with ch:
        try:
            return getattr(stub, method)(request, timeout=5.0)
        except grpc.RpcError:
            return None


def health(address: str) -> Any:
    from memstore.v1 import store_pb2 as pb

    return store_rpc(address, "Health", pb.HealthRequest())


def job_steps(address: str, job: str) -> set[int] | None:
    """The steps of ``job`` the store at ``address`` holds (None: it did not answer)."""
    from memstore.v1 import store_pb2 as pb

    resp = store_rpc(address, "List", pb.ListRequest(job_id=job))
    return None if resp is None else {int(s.manifest.key.step) for s in resp.shards}


def rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return next((int(line.split()[1]) << 10 for line in fh if line.startswith("VmRSS:")), 0)
    except OSError:
        return 0


def wait_idle(cluster: LocalCluster, timeout: float = 30.0, step_bytes: int = 8 * MiB) -> float:
    """Until every store's RSS stopped growing and none is still faulting in its pre-faulted reserve, as a job's first
    save comes well after its hosts' stores started; the seconds waited. Nothing is saved or copied meanwhile."""
    pids = [sp.proc.pid for sp in cluster.stores.values() if sp.proc is not None]
    t0 = time.perf_counter()
    last: list[int] | None = None
    while time.perf_counter() - t0 < timeout:
        now = [rss(p) for p in pids]
        steady = last is not None and all(abs(a - b) < step_bytes for a, b in zip(now, last, strict=True))
        statuses = [health(cluster.address(h)) for h in cluster.stores]
        if steady and not any(x is None or getattr(x, "reserve_filling", False) for x in statuses):
            break
        last = now
        time.sleep(0.3)
    return time.perf_counter() - t0


def wait_settled(cluster: LocalCluster, job: str, keep: int) -> None:
    """Until retention dropped the oldest steps of ``job`` everywhere, so the next save can reuse a pooled segment (as
    a trainer's next save comes a training step later)."""

    def settled() -> bool:
        return all((steps := job_steps(cluster.address(h), job)) is not None and len(steps) <= keep for h in cluster.stores)

    wait_for(settled, 60.0, interval=0.01, what="retention to drop old steps")


def wait_caught_up(cluster: LocalCluster, host: str, job: str, keep: int, timeout: float) -> None:
    """Until ``host`` holds the newest ``keep`` steps of ``job`` that any store holds and runs no repair."""

    def caught_up() -> bool:
        every = [job_steps(cluster.address(h), job) for h in cluster.stores]
        mine = job_steps(cluster.address(host), job)
        union = set().union(*(s for s in every if s is not None))
        status = health(cluster.address(host))
        held = None not in every and mine is not None and mine >= set(sorted(union)[-keep:])
        return held and status is not None and status.repairs_in_flight == 0

    wait_for(caught_up, timeout, interval=0.05, what=f"{host} to hold the newest steps")


class RestoreProcess:
    """A restarted trainer (this module as a child process) that the bench tells when to restore, over JSON lines;
    ``module``: another bench module run so (``memstore.bench.ranks``: a saving rank), ``name`` what errors call it."""

    def __init__(self, module: str = __name__, name: str = "the restore process") -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=module_env()
        )
        self.buf = b""

    def read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.name} did not answer within {timeout:.0f} s")
            if select.select([fd], [], [], min(remaining, 1.0))[0]:
                data = os.read(fd, 1 << 16)
                if not data:
                    err = self.proc.communicate(timeout=10)[1].decode(errors="replace")
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {err[-3000:]}")
                self.buf += data
        line, _, self.buf = self.buf.partition(b"\n")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=30)


def restore_in_new_process(
    source: dict[str, Any], timeout: float, before: Callable[[], object] | None = None, during: Callable[[], object] | None = None
) -> dict[str, Any]:
    """Start a restore process and wait until it has imported torch; run ``before`` (e.g. kill a store), tell it to
    restore from ``source`` (``{"address": ..., "job": ...}``, with ``"world_size"`` when the job has more than one rank:
    it restores rank 0; or ``{"path": ...}``), run ``during`` (e.g. start the
    replacement) and return its report (timings, source host, fingerprint)."""
    child = RestoreProcess()
    try:
        ready = child.read(timeout=120.0)
        if before is not None:
            before()
        child.send({**source, "wait_seconds": timeout})
        if during is not None:
            during()
        return {**child.read(timeout=timeout), "import_seconds": ready["import_seconds"]}
    finally:
        child.close()


def wait_accepting(address: str, timeout: float) -> None:
    """Until ``address`` accepts TCP connections (a replacement store may still be starting)."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.005)


def restore_worker() -> None:
    """The child: stdout carries one JSON line per report (anything else printed goes to stderr)."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    t0 = time.perf_counter()
    import torch  # a trainer has torch loaded before it restores

    from memstore.bench.state import fingerprint
    from trainer_client import CheckpointClient, Connection

    out.write(json.dumps({"ready": True, "import_seconds": time.perf_counter() - t0}) + "\n")
    cmd = json.loads(sys.stdin.readline())
    if "path" in cmd:
        t0 = time.perf_counter()
        state = torch.load(cmd["path"], weights_only=True)
        report = {"seconds": time.perf_counter() - t0, "source_host": "file"}
        out.write(json.dumps({**report, "fingerprint": fingerprint(state)}) + "\n")
        return
    wait_accepting(cmd["address"], float(cmd["wait_seconds"]))
    t_accept = time.perf_counter()
    world_size = int(cmd.get("world_size", 1))  # rank 0 of a job of that many ranks
    client = CheckpointClient(cmd["job"], 0, world_size, connection=Connection(cmd["address"], timeout=60.0))
    t_connected = time.perf_counter()
    state = client.load(zero_copy=True)
    t_loaded = time.perf_counter()
    source = client.stats().last_load_source or ""
    client.close()
    report = {"seconds": t_loaded - t_accept, "connect_seconds": t_connected - t_accept, "load_seconds": t_loaded - t_connected}
    out.write(json.dumps({**report, "source_host": source, "fingerprint": fingerprint(state)}) + "\n")


if __name__ == "__main__":
    restore_worker()


SAMPLE_SECONDS = 0.05  # how often RamSampler asks the stores
IDLE_WAIT_SECONDS = 60.0  # how long idle_ram waits for a job that stopped saving to give its spares back


class RamSampler:
    """The sum of the stores' ``used_bytes``, sampled on a thread every :data:`SAMPLE_SECONDS` while ``sampling()``;
    ``peak``: the largest sum seen."""

    def __init__(self, cluster: LocalCluster) -> None:
        from memstore.v1.channel import store_stub

        self._stubs = [store_stub(cluster.address(h)) for h in cluster.stores]
        self.peak = 0
        self._stop = threading.Event()

    def used(self) -> int | None:
        """The stores' used bytes now (None: one did not answer)."""
        return self._sum("used_bytes")

    def pooled(self) -> int | None:
        """The part of it in free segments kept faulted in (the jobs' spares and the reserve)."""
        return self._sum("pooled_bytes")

    def _sum(self, field: str) -> int | None:
        import grpc

        from memstore.v1 import store_pb2 as pb

        total = 0
        for _, stub in self._stubs:
            try:
                total += int(getattr(stub.Health(pb.HealthRequest(), timeout=5.0), field))
            except grpc.RpcError:
                return None
        return total

    def _sample(self) -> None:
        while True:
            used = self.used()
            if used is not None:
                self.peak = max(self.peak, used)
            if self._stop.wait(SAMPLE_SECONDS):
                return

    @contextmanager
    def sampling(self) -> Iterator[RamSampler]:
        self._stop.clear()
        thread = threading.Thread(target=self._sample, name="bench-ram", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join(timeout=10)

    def close(self) -> None:
        for channel, _ in self._stubs:
            channel.close()


def idle_ram(sampler: RamSampler, timeout: float = IDLE_WAIT_SECONDS) -> int | None:
    """The stores' used bytes once their pooled spares went back to the kernel (a job that stopped saving goes idle
    after three of its cadences, at least 30 s: ``memstore.core.reserve_policy``), or after ``timeout``; None: a store did
    not answer."""
    deadline = time.monotonic() + timeout
    while True:
        pooled = sampler.pooled()
        if pooled == 0 or pooled is None or time.monotonic() > deadline:
            return sampler.used()
        time.sleep(1.0)


def ram_fields(peak: int, settled: int | None, idle: int | None, state_bytes: int) -> dict[str, Any]:
    """The stores' shared memory over the state saved: at its peak across the saves, right after them (``settled``: the
    next saves' memory reserved, the replicas' spares pooled) and once the job went idle (spares given back)."""

    def over(held: int | None) -> float | None:
        return None if held is None else held / state_bytes

    return {
        "ram_peak_bytes": peak, "ram_settled_bytes": settled, "ram_idle_bytes": idle,
        "ram_multiple_peak": over(peak), "ram_multiple_settled": over(settled), "ram_multiple_idle": over(idle),
    }  # fmt: skip
