"""The processes of one row of the recovery matrix, and what a row measures.

A :class:`Scenario` starts a ``LocalCluster`` (one store per host on 127.0.0.1, port 0) and one trainer process
per host (:mod:`.worker`, rank ``r`` on host ``h<r>``) that saves the deterministic state of every step. Once every
rank has committed ``steps`` steps, :func:`.runner.run_row` injects the fault while the saves go on; the job is then
stopped (a lost rank stops a data-parallel job), the fault's recovery runs (the restarts it says) and every rank
restores (``latest_step`` + ``load``, agreed over one gloo group) through its own store, retrying until a deadline as
a restarted trainer would. A row measures:

- RPO: the newest step every rank had committed when the fault hit, minus the step restored (0 = nothing lost;
  a step committed while the fault unfolded and restored counts as 0);
- RTO: seconds from the fault until every rank holds its restored state (restarting trainer processes, i.e.
  importing torch, not included);
- exact: every rank restored the same step, and each state equals the saved one byte for byte.

Every wait has a deadline; every process is reaped, whatever happens.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from memstore.children import forkserver, start_forked
from memstore.core.redundancy import Redundancy
from memstore.testing import LocalCluster, wait_for
from tools.dns_server import DnsServer
from tools.recovery_matrix import worker
from tools.recovery_matrix.links import Links
from tools.recovery_matrix.state import difference, make_state
from tools.recovery_matrix.worker import committed

JOB = "matrix"
KIB = 64  # state per rank; small so that a row takes seconds
STEP_SECONDS = 0.25  # each rank's compute between two saves


@dataclass(frozen=True)
class Config:
    replicas: int
    spill: bool
    erasure: str = ""  # "ec:K+M": the stores erasure-code instead of copying (``replicas`` is then 1, the owner's copy)

    @property
    def scheme(self) -> Redundancy:
        return Redundancy.parse(self.erasure) if self.erasure else Redundancy.of_replicas(self.replicas)

    @property
    def label(self) -> str:
        return f"{self.erasure or f'R={self.replicas}'}, spill {'on' if self.spill else 'off'}"


@dataclass
class RowResult:
    fault: str
    config: str
    committed: int  # newest step every rank had committed when the fault hit
    restored: int  # the step every rank restored (0: nothing was restorable)
    rpo: int
    rto: float
    exact: bool
    rpo_bound: int | None  # what the catalogue promises for this configuration (None: the steps may all be lost)
    note: str = ""
    sources: list[str] = field(default_factory=list)  # where each rank's bytes came from (its load source)

    @property
    def ok(self) -> bool:
        """Exact, and within the bound; a bounded configuration must restore some step (nothing is not within any bound)."""
        return self.exact and (self.rpo_bound is None or (self.restored > 0 and self.rpo <= self.rpo_bound))


class Scenario:
    """The processes of one row: what a fault's ``inject`` and ``recover`` act on."""

    def __init__(
        self,
        config: Config,
        hosts: int,
        workdir: Path,
        store_env: dict[str, dict[str, str]] | None = None,
        discovery: str = "peers",
        proxied: tuple[str, ...] = (),
        kib: int = 0,
    ) -> None:
        self.config = config
        self.workdir = workdir
        self.durable = workdir / "durable"
        args = ["--repair-interval", "0.5"]
        if config.spill:
            args += ["--spill", f"file://{self.durable}", "--spill-every-steps", "1", "--spill-keep-last", "3"]
        self.kib = kib or KIB  # each rank's state
        self.links = Links()  # the proxied links (Fault.proxied); see the network section below
        self.remote_ranks = "clients" in proxied
        # The row's own DNS server (discovery "dns"), which a fault silences; the cluster stops it with the stores.
        dns = self.dns = DnsServer() if discovery == "dns" else None
        self.cluster = LocalCluster(hosts=hosts, replicas=config.replicas, redundancy=config.erasure or None, capacity="256MiB",
                                    workdir=workdir / "cluster", extra_args=args, discovery=discovery,
                                    dns_server=None if dns is None else (lambda: dns), data_ports=bool(proxied),
                                    dial=self.links.dial if "stores" in proxied else None)  # fmt: skip
        for host, env in (store_env or {}).items():
            self.cluster.stores[host].env = dict(env)  # kept by restarts
        self.hosts = [f"h{i}" for i in range(hosts)]  # rank r's host (a fault that replaces a host id changes it)
        self.world = hosts
        self.workers: list[BaseProcess] = []
        self.run_id = f"matrix-{os.getpid()}-{workdir.name}"[:100]
        self.cleanups: list[Callable[[], None]] = []  # run by close() once every process is gone, last added first
        self.services: dict[str, Any] = {}  # what a fault's setup started for the row (an S3 server, a proxy), by name

    # -- processes ------------------------------------------------------------------------
    def start(self) -> None:
        self.cluster.start()
        for rank in range(self.world):
            argv = ["--job", JOB, "--rank", str(rank), "--world", str(self.world), "--store", self.store_of(rank),
                    "--progress", str(self.progress(rank)), "--kib", str(self.kib), "--interval", str(STEP_SECONDS)]  # fmt: skip
            argv += ["--remote"] if self.remote_ranks else []
            env = {"MEMSTORE_RUN_ID": self.run_id}  # one timeline, as a launcher gives its ranks
            ctx = forkserver(["tools.recovery_matrix.worker"])
            self.workers.append(start_forked(ctx, worker.main, argv, self.workdir / f"rank{rank}.log", env, f"matrix-rank{rank}"))

    def store_of(self, rank: int) -> str:
        host = self.hosts[rank % len(self.hosts)]
        if self.remote_ranks:
            return self.client_link(rank, host)
        return self.cluster.address(host)

    def progress(self, rank: int) -> Path:
        return self.workdir / f"rank{rank}.progress"

    def kill_worker(self, rank: int) -> None:
        """SIGKILL the trainer process of ``rank`` and reap it."""
        proc = self.workers[rank]
        if proc.exitcode is None:
            proc.kill()
            proc.join(timeout=10)

    def stop_workers(self) -> None:
        for rank in range(len(self.workers)):
            self.kill_worker(rank)

    def close(self) -> None:
        self.stop_workers()
        for h in self.cluster.stores:
            self.cluster.kill(h)
        self.cluster.stop()
        self.links.close()
        for cleanup in reversed(self.cleanups):
            try:
                cleanup()
            except Exception as exc:  # the row's result stands; what was left behind is said
                print(f"recovery matrix: cleanup {getattr(cleanup, '__name__', cleanup)} failed: {type(exc).__name__}: {exc}",
                      file=sys.stderr)  # fmt: skip
        self.cleanups.clear()

    # -- the machine's services (faults_environment) ------------------------------------------
    def on_close(self, cleanup: Callable[[], None]) -> None:
        """Run ``cleanup`` when the row ends (after every process is gone): unmount, stop a server, remove a cgroup."""
        self.cleanups.append(cleanup)

    def use_spill(self, url: str, env: dict[str, str] | None = None) -> None:
        """Before ``start()``: every store spills to ``url`` (instead of the row's file:// directory), with ``env``
        added to its environment (e.g. an S3 endpoint and credentials). Needs spill on."""
        if not self.config.spill:
            raise ValueError("use_spill needs a configuration with spill on")
        for sp in self.cluster.stores.values():
            sp.args[sp.args.index("--spill") + 1] = url
            sp.env.update(env or {})
        self.cluster.extra_args[self.cluster.extra_args.index("--spill") + 1] = url

    # -- network (Fault.proxied) ---------------------------------------------------------------
    def client_link(self, rank: int, host: str) -> str:
        """The address rank ``rank`` dials its store ``host`` at: its own proxied link (``self.links.clients``)."""
        sp = self.cluster.stores[host]
        return self.links.client(rank, host, sp.address, sp.data_port)

    # -- progress -------------------------------------------------------------------------
    def committed(self) -> int:
        """The newest step every rank has committed (0: none yet)."""
        return min(committed(self.progress(r)) for r in range(self.world))

    def wait_committed(self, step: int, timeout: float = 120.0) -> None:
        def reached() -> bool:
            dead = [r for r, p in enumerate(self.workers) if p.exitcode is not None]
            if dead:
                raise RuntimeError(f"trainer rank {dead[0]} exited early: {self.tail(self.workdir / f'rank{dead[0]}.log')}")
            return self.committed() >= step

        wait_for(reached, timeout, interval=0.05, what=f"every rank to commit step {step}")

    @staticmethod
    def tail(path: Path, lines: int = 5) -> str:
        try:
            return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    # -- restore --------------------------------------------------------------------------
    def restore(self, timeout: float = 60.0) -> list[tuple[int, str | None, str]]:
        """Every rank at once, agreeing on the step over one gloo group as a restarted job does: each rank's
        (step restored or 0, the first difference from the saved state or an error, where its bytes came from).

        A rank whose load fails (a copy that fails its checksum is dropped) fails the attempt for every rank; the
        job agrees again, until the deadline.
        """
        from tools.thread_ranks import on_every_rank

        results, _ = on_every_rank(self.world, lambda rank, group: self._restore_rank(rank, group, time.monotonic() + timeout),
                                   timeout=timeout + 30)  # fmt: skip
        return [r if isinstance(r, tuple) else (0, f"rank {i}: {type(r).__name__}: {r}", "") for i, r in enumerate(results)]

    def _restore_rank(self, rank: int, group: Any, deadline: float) -> tuple[int, str | None, str]:
        import torch
        import torch.distributed as dist

        from trainer_client import CheckpointClient, Connection

        error = ""
        while True:
            outcome: tuple[int, str | None, str] | None = None
            client = None
            try:
                client = CheckpointClient(JOB, rank, self.world, connection=Connection(self.store_of(rank), timeout=10))
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
            # Every rank connected, or none goes on: latest_step and load are collectives, and a rank that could not
            # connect must not leave the others' all-reduces paired with its own flags below.
            connected = torch.tensor([0 if client is None else 1])
            dist.all_reduce(connected, op=dist.ReduceOp.MIN, group=group)
            try:
                if connected.item() == 0:
                    raise ConnectionError("a rank could not connect to its store")
                assert client is not None
                step = client.latest_step(group=group)
                if step is None:
                    outcome = (0, None, "")
                else:
                    diff = difference(client.load(step, group=group), make_state(rank, step, self.kib))
                    outcome = (step, diff, str(client.stats().last_load_source))
            except Exception as exc:
                error = error if isinstance(exc, ConnectionError) and error else f"{type(exc).__name__}: {exc}"
            finally:
                if client is not None:
                    client.close()
            # Did every rank restore, and is every rank still within its deadline? Decided together.
            flags = torch.tensor([0 if outcome is None else 1, 1 if time.monotonic() < deadline else 0])
            dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
            if flags[0].item() == 1 and outcome is not None:
                return outcome
            if flags[1].item() == 0:
                return 0, f"rank {rank}: no restore before the deadline; last error {error[:300] or 'on another rank'}", ""
            time.sleep(0.2)


def flip_every_page(path: str | os.PathLike[str]) -> None:
    """XOR one byte of every 4 KiB page of the file at ``path`` (bit rot in a segment's RAM)."""
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        for offset in range(0, size, 4096):
            f.seek(offset)
            b = f.read(1)
            f.seek(offset)
            f.write(bytes([b[0] ^ 0xFF]) if b else b"")
