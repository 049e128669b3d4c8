"""The save path on many real stores: the calls each store serves per saved step once retention evicts.

One scenario, used by ``tests/integration/test_save_scale.py`` and ``benchmarks/save_scale.py``:

1. ``hosts`` store processes on 127.0.0.1 (R replicas, ``--keep`` K), one rank per host. Ranks are processes (forked
   from a server that imported torch once), each started as ``torchrun`` starts one: ``init_process_group("gloo")``,
   then a ``CheckpointClient`` to its own host's store.
2. Every rank saves steps 1..K (warm-up: nothing is evicted yet), then ``measured`` more steps, each beyond
   ``--keep``, so every store's retention evicts at each one. After the last, the scenario waits until every
   store holds at most K + 1 steps (retention ran), then reads the calls the stores served.
3. Twice, each a fresh cluster: the client built as the quick start shows, no ``group=`` (it agrees over the job's
   default process group: the ranks' restorable floor rides on the commits; ``floor``), and with ``group=False``
   (each store lists every store before evicting; ``listing``).
4. With ``dcp=True`` the ranks save through ``dcp.save`` instead, a fresh ``MemStoreWriter`` per save as the DCP guide
   shows (``dcp``): the ranks agree on the floor in DCP's own planning collectives (``trainer_client.dcp.floors``).

Calls are counted on the stores' side from their Prometheus counters (``memstore_rpcs_total`` by method), per
store; ``List`` and ``LatestStep`` are the ones retention could cost. Repair passes run every 10 minutes here so
that they do not blur the counts.
"""

from __future__ import annotations

import multiprocessing
import re
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

import torch

from memstore.testing import LocalCluster, free_ports, wait_for

_SAMPLE = re.compile(
    r'^memstore_(rpcs_total\{method="([A-Za-z]+)"\}|retention_listings_total|steps\{job_id="([^"]+)",tier="ram"\}) ([0-9.e+]+)$', re.M
)
RETENTION_CALLS = ("List", "LatestStep")
JOB = "save-scale"
RANK_TIMEOUT = 300.0  # each phase of the ranks' saves


@dataclass
class StoreCounts:
    """What one store's metrics say: calls served by method, retention passes that listed, steps held per job."""

    calls: dict[str, int]
    listings: int
    steps: dict[str, int]


def store_counts(cluster: LocalCluster, host: str) -> StoreCounts:
    with urllib.request.urlopen(cluster.metrics_url(host), timeout=10) as resp:
        text = resp.read().decode()
    counts = StoreCounts({}, 0, {})
    for _, method, job, value in _SAMPLE.findall(text):
        if method:
            counts.calls[method] = int(float(value))
        elif job:
            counts.steps[job] = int(float(value))
        else:
            counts.listings = int(float(value))
    return counts


def run_once(
    hosts: int, grouped: bool, replicas: int = 2, keep: int = 2, measured: int = 3, state_kib: int = 64, dcp: bool = False
) -> dict[str, Any]:
    """One cluster, one way of saving (``grouped``: the client's default group, else ``group=False``; ``dcp``: through
    ``dcp.save``, whatever ``grouped`` says); the retention calls per store per measured save."""
    cluster = LocalCluster(hosts=hosts, replicas=replicas, capacity="64MiB", keep=keep, metrics=True,
                           extra_args=["--repair-interval", "600"])  # fmt: skip
    names = [f"h{i}" for i in range(hosts)]
    ctx = multiprocessing.get_context("forkserver")
    preload = ["torch", "torch.distributed", "torch.distributed.checkpoint", "trainer_client", "trainer_client.dcp"]
    ctx.set_forkserver_preload(preload)  # each rank forks in well under a second
    warm, go = ctx.Event(), ctx.Event()
    ranks: list[Any] = []
    try:
        cluster.start(timeout=60 + 2 * hosts)
        (master_port,) = free_ports(1)
        addresses = [cluster.address(h) for h in names]
        ranks = [ctx.Process(target=_rank, args=(r, hosts, addresses, master_port, grouped, dcp, keep, measured, state_kib, warm, go),
                             name=f"save-scale-rank-{r}", daemon=True) for r in range(hosts)]  # fmt: skip
        for p in ranks:
            p.start()
        _wait(lambda: warm.is_set(), ranks, RANK_TIMEOUT, "every rank's warm-up saves")
        started, before = time.perf_counter(), {h: store_counts(cluster, h) for h in names}  # what the stores served so far
        go.set()
        _wait(lambda: all(p.exitcode is not None for p in ranks), ranks, RANK_TIMEOUT, "every rank's measured saves")
        seconds = time.perf_counter() - started
        wait_for(lambda: all(store_counts(cluster, h).steps.get(JOB, 0) <= keep + 2 for h in names), 120, what="retention on every store")
        after = {h: store_counts(cluster, h) for h in names}
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
            p.join(10)
        cluster.stop()
    per_store = {
        h: {m: (after[h].calls.get(m, 0) - before[h].calls.get(m, 0)) / measured for m in RETENTION_CALLS} for h in names
    }  # fmt: skip
    return {
        "hosts": hosts, "replicas": replicas, "keep": keep, "measured_saves": measured, "grouped": grouped, "dcp": dcp,
        "retention_calls_per_store_per_save_max": max(sum(v.values()) for v in per_store.values()),
        "retention_calls_per_save_total": sum(sum(v.values()) for v in per_store.values()),
        "listings_per_store_per_save_max": max(after[h].listings - before[h].listings for h in names) / measured,
        "steps_held_max": max(after[h].steps.get(JOB, 0) for h in names),
        "seconds_measured_saves": round(seconds, 3),
    }  # fmt: skip


def _wait(done: Any, ranks: list[Any], timeout: float, what: str) -> None:
    """Wait for ``done()``; a rank that exited with an error, or the deadline, raises (naming it)."""
    deadline = time.monotonic() + timeout
    while not done():
        failed = [p for p in ranks if p.exitcode not in (None, 0)]
        if failed:
            raise RuntimeError(f"{failed[0].name} exited with {failed[0].exitcode} before {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not finish within {timeout}s")
        time.sleep(0.05)


def _rank(r: int, hosts: int, addresses: list[str], master_port: int, grouped: bool, dcp: bool, keep: int, measured: int,
          state_kib: int, warm: Any, go: Any) -> None:  # fmt: skip
    """One rank as ``torchrun`` starts one: the default process group (gloo), the client built as the quick start shows
    (``grouped``), or with ``group=False`` (the listing it replaces), or (``dcp``) ``dcp.save`` with a fresh writer per save."""
    import torch.distributed as dist

    from trainer_client import CheckpointClient, Connection

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{master_port}", rank=r, world_size=hosts)
    connection = Connection(addresses[r], timeout=60)
    if dcp:
        try:
            _dcp_saves(r, connection, keep, measured, state_kib, warm, go)
        finally:
            dist.destroy_process_group()
        return
    client = CheckpointClient(JOB, r, hosts, connection=connection, group=None if grouped else False)
    try:
        for step in range(1, keep + measured + 1):
            if step == keep + 1:
                _start_measured(r, warm, go)
            w = torch.randn(state_kib * 256, generator=torch.Generator().manual_seed(r * 1000 + step))
            client.save(step, {"w": w, "step": step}).wait(timeout=120)
        dist.barrier()
    finally:
        client.close()
        dist.destroy_process_group()


def _dcp_saves(r: int, connection: Any, keep: int, measured: int, state_kib: int, warm: Any, go: Any) -> None:
    """The same saves through ``dcp.save`` (a fresh ``MemStoreWriter`` per save, closed after it), each waiting for its
    R copies (the writer's default)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from trainer_client.dcp import MemStoreWriter

    for step in range(1, keep + measured + 1):
        if step == keep + 1:
            _start_measured(r, warm, go)
        w = torch.randn(state_kib * 256, generator=torch.Generator().manual_seed(r * 1000 + step))
        writer = MemStoreWriter(JOB, step, connection=connection)
        try:
            dcp.save({f"w{r}": w, "step": torch.tensor(step)}, storage_writer=writer)
        finally:
            writer.close()
    dist.barrier()


def _start_measured(r: int, warm: Any, go: Any) -> None:
    """Steps 1..keep evicted nothing: from here every save is beyond --keep. Rank 0 says the warm-up is over, then every
    rank waits for the scenario to read the stores' counts and say go."""
    import torch.distributed as dist

    dist.barrier()
    if r == 0:
        warm.set()
    if not go.wait(RANK_TIMEOUT):
        raise TimeoutError("the measured saves were never started")


VARIANTS = ("floor", "listing", "dcp")


def run(
    hosts: int = 32, replicas: int = 2, keep: int = 2, measured: int = 3, state_kib: int = 64, compare: bool = True,
    variants: tuple[str, ...] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The scenario above, a fresh cluster per variant (``VARIANTS``): with the floor (``floor``), and (``compare``)
    without it (``listing``); ``variants`` names them instead (``dcp``: through ``dcp.save``)."""
    chosen = variants if variants is not None else (("floor", "listing") if compare else ("floor",))
    unknown = set(chosen) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown save-scale variants {sorted(unknown)}: expected some of {VARIANTS}")
    return {
        name: run_once(hosts, name != "listing", replicas, keep, measured, state_kib, dcp=name == "dcp") for name in chosen
    }  # fmt: skip
