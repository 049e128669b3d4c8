"""The restore protocol on many real stores: calls per rank and time of ``latest_step()`` and of a full restore.

One scenario, used by ``tests/integration/test_scale.py`` and ``benchmarks/restore_scale.py``:

1. ``hosts`` store processes on 127.0.0.1 (R replicas, small capacity), ``ranks_per_host`` ranks each. Ranks
   are threads of this process, each with its own ``CheckpointClient`` to its own host's store and its own
   member of one gloo process group (a HashStore rendezvous): the real collectives, without one torch
   process per rank. Every rank saves ``steps`` steps of a small state, keeping ``steps - 1``: the last save
   is measured too (``save``), since it is the first that makes every store's retention evict.
2. Every rank calls ``latest_step()`` at once, first without a group (each store lists every store), then
   with ``group=`` (each rank asks its store, which asks its placement group; three all-reduces).
3. A full restore: one host is killed and replaced (same id, empty memory), then every rank restores at once
   with ``load()`` (the no-group path) and again with ``latest_step(group=...)`` + ``load(step, group=...)``.

Calls are counted on the stores' side from their Prometheus counters (``memstore_rpcs_total`` by method), so
they include what the stores ask each other. Repair passes run every 10 minutes here so that they do not blur
the counts (a replacement's first pass at start-up is counted: a user pays it).
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from memstore.devtools.cluster import LocalCluster, wait_for
from memstore.devtools.ranks import on_every_rank

_SAMPLE = re.compile(r'^memstore_rpcs_total\{method="([A-Za-z]+)"\} ([0-9.e+]+)$', re.M)
JOB = "scale"


@dataclass
class Phase:
    """One phase: every rank did the same thing at once."""

    seconds: float  # from the barrier until the last rank finished
    calls: dict[str, int]  # method -> calls the stores served during the phase for it
    ranks: int
    background: dict[str, int]  # calls that run whatever the ranks do (gossip's Hello, health checks) in the same time

    @property
    def calls_per_rank(self) -> float:
        return sum(self.calls.values()) / self.ranks

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "calls_per_rank": round(self.calls_per_rank, 2)}


def rpc_counts(cluster: LocalCluster) -> dict[str, int]:
    """Calls served by every live store of ``cluster``, summed per method."""
    total: dict[str, int] = {}
    for host, sp in cluster.stores.items():
        if not sp.alive:
            continue
        with urllib.request.urlopen(cluster.metrics_url(host), timeout=10) as resp:
            for method, value in _SAMPLE.findall(resp.read().decode()):
                total[method] = total.get(method, 0) + int(float(value))
    return total


BACKGROUND = ("Hello", "Health")  # membership gossip (a fixed fan-out per store and interval) and health checks


def _delta(after: dict[str, int], before: dict[str, int], background: bool) -> dict[str, int]:
    return {m: after[m] - before.get(m, 0) for m in sorted(after) if after[m] - before.get(m, 0) and (m in BACKGROUND) == background}


def run(hosts: int = 32, ranks_per_host: int = 1, replicas: int = 2, state_kib: int = 256, steps: int = 3) -> dict[str, Any]:
    """The scenario above; returns its phases (seconds, calls by method, calls per rank) and the setup."""
    from trainer_client import CheckpointClient, Connection

    world = hosts * ranks_per_host

    def host(rank: int) -> str:
        return f"h{rank // ranks_per_host}"

    def state(rank: int, step: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(rank * 1000 + step)
        return {"w": torch.randn(state_kib * 256, generator=g), "step": step}

    out: dict[str, Any] = {"hosts": hosts, "ranks": world, "replicas": replicas, "state_kib": state_kib}
    cluster = LocalCluster(hosts=hosts, replicas=replicas, capacity="64MiB", keep=steps - 1, metrics=True,
                           extra_args=["--repair-interval", "600"])  # fmt: skip
    try:
        cluster.start(timeout=60 + 2 * hosts)

        def clients(run_id: str) -> list[CheckpointClient]:
            connections = [Connection(cluster.address(host(r)), timeout=60) for r in range(world)]
            return [CheckpointClient(JOB, r, world, connection=connections[r], run_id=run_id) for r in range(world)]

        def phase(name: str, fn: Callable[[int, Any], Any]) -> list[Any]:
            before = rpc_counts(cluster)
            results, seconds = on_every_rank(world, fn)
            failed = next((r for r in results if isinstance(r, BaseException)), None)
            if failed is not None:
                raise failed
            after = rpc_counts(cluster)
            out[name] = Phase(seconds, _delta(after, before, False), world, _delta(after, before, True)).to_dict()
            return results

        cs = clients("scale-run")
        try:
            for step in range(1, steps):
                for h in [c.save(step, state(c.rank, step)) for c in cs]:
                    h.wait(timeout=120)
            # The last save is measured: it is the first beyond --keep, so retention runs on every store.
            phase("save", lambda r, g: cs[r].save(steps, state(r, steps)).wait(timeout=120))
            assert phase("latest_step", lambda r, g: cs[r].latest_step()) == [steps] * world
            assert phase("latest_step_group", lambda r, g: cs[r].latest_step(group=g)) == [steps] * world
        finally:
            for c in cs:
                c.close()
        for name, agreed in (("restore", False), ("restore_group", True)):
            cluster.kill("h1")
            cluster.restart("h1")  # a replacement: same id, empty memory
            wait_for(lambda: cluster.stores["h1"].alive, timeout=30, what="h1 restarted")
            cs = clients(f"scale-{name}")
            try:

                def restore(r: int, g: Any, agreed: bool = agreed, cs: list[CheckpointClient] = cs) -> bool:
                    c = cs[r]
                    loaded = c.load(c.latest_step(group=g), group=g) if agreed else c.load()
                    return bool(torch.equal(loaded["w"], state(r, steps)["w"]))

                assert all(phase(name, restore))
                out[name]["replaced_host_sources"] = sorted({cs[r].last_load_source for r in range(world) if host(r) == "h1"})
            finally:
                for c in cs:
                    c.close()
    finally:
        cluster.stop()
    return out
