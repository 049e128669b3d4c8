"""The save path on many real stores: the calls each store serves per saved step once retention evicts.

One scenario, used by ``tests/integration/test_save_scale.py`` and ``benchmarks/save_scale.py``:

1. ``hosts`` store processes on 127.0.0.1 (R replicas, ``--keep`` K), one rank per host. Ranks are threads of
   this process (``memstore.devtools.ranks``), each with its own ``CheckpointClient`` to its own host's store and
   its own member of one gloo process group: the real all-reduce, without one torch process per rank.
2. Every rank saves steps 1..K (warm-up: nothing is evicted yet), then ``measured`` more steps, each beyond
   ``--keep``, so every store's retention evicts at each one. After the last, the scenario waits until every
   store holds at most K + 1 steps (retention ran), then reads the calls the stores served.
3. Twice, each a fresh cluster: with ``CheckpointClient(group=...)`` (the ranks' restorable floor rides on the
   commits; ``floor``) and without (each store lists every store before evicting; ``listing``).

Calls are counted on the stores' side from their Prometheus counters (``memstore_rpcs_total`` by method), per
store; ``List`` and ``LatestStep`` are the ones retention could cost. Repair passes run every 10 minutes here so
that they do not blur the counts.
"""

from __future__ import annotations

import re
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

import torch

from memstore.devtools.cluster import LocalCluster, wait_for
from memstore.devtools.ranks import on_every_rank

_SAMPLE = re.compile(
    r'^memstore_(rpcs_total\{method="([A-Za-z]+)"\}|retention_listings_total|steps\{job_id="([^"]+)",tier="ram"\}) ([0-9.e+]+)$', re.M
)
RETENTION_CALLS = ("List", "LatestStep")
JOB = "save-scale"


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


def run_once(hosts: int, grouped: bool, replicas: int = 2, keep: int = 2, measured: int = 3, state_kib: int = 64) -> dict[str, Any]:
    """One cluster, one way of saving; the retention calls per store per measured save."""
    import threading

    from trainer_client import CheckpointClient, Connection

    cluster = LocalCluster(hosts=hosts, replicas=replicas, capacity="64MiB", keep=keep, metrics=True,
                           extra_args=["--repair-interval", "600"])  # fmt: skip
    names = [f"h{i}" for i in range(hosts)]
    marks: dict[str, Any] = {}

    def mark(name: str) -> None:
        marks[name] = time.perf_counter()
        if name == "measured":  # every rank is done with the warm-up: what the stores served so far
            marks["before"] = {h: store_counts(cluster, h) for h in names}

    warm, done = threading.Barrier(hosts, lambda: mark("measured")), threading.Barrier(hosts, lambda: mark("done"))

    def rank(r: int, g: Any) -> None:
        client = CheckpointClient(JOB, r, hosts, connection=Connection(cluster.address(f"h{r}"), timeout=60), run_id="save-scale",
                                  group=g if grouped else None)  # fmt: skip
        try:
            for step in range(1, keep + measured + 1):
                if step == keep + 1:
                    warm.wait(timeout=300)  # steps 1..keep evict nothing: from here every save is beyond --keep
                w = torch.randn(state_kib * 256, generator=torch.Generator().manual_seed(r * 1000 + step))
                client.save(step, {"w": w, "step": step}).wait(timeout=120)
            done.wait(timeout=300)
        finally:
            client.close()

    try:
        cluster.start(timeout=60 + 2 * hosts)
        results, _ = on_every_rank(hosts, rank, timeout=600)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed
        wait_for(lambda: all(store_counts(cluster, h).steps.get(JOB, 0) <= keep + 2 for h in names), 120, what="retention on every store")
        after = {h: store_counts(cluster, h) for h in names}
    finally:
        cluster.stop()
    before: dict[str, StoreCounts] = marks["before"]
    per_store = {
        h: {m: (after[h].calls.get(m, 0) - before[h].calls.get(m, 0)) / measured for m in RETENTION_CALLS} for h in names
    }  # fmt: skip
    return {
        "hosts": hosts, "replicas": replicas, "keep": keep, "measured_saves": measured, "grouped": grouped,
        "retention_calls_per_store_per_save_max": max(sum(v.values()) for v in per_store.values()),
        "retention_calls_per_save_total": sum(sum(v.values()) for v in per_store.values()),
        "listings_per_store_per_save_max": max(after[h].listings - before[h].listings for h in names) / measured,
        "steps_held_max": max(after[h].steps.get(JOB, 0) for h in names),
        "seconds_measured_saves": round(marks["done"] - marks["measured"], 3),
    }  # fmt: skip


def run(hosts: int = 32, replicas: int = 2, keep: int = 2, measured: int = 3, state_kib: int = 64, compare: bool = True) -> dict[str, Any]:
    """The scenario above: with the floor, and (``compare``) without it on a fresh cluster of the same size."""
    out = {"floor": run_once(hosts, True, replicas, keep, measured, state_kib)}
    if compare:
        out["listing"] = run_once(hosts, False, replicas, keep, measured, state_kib)
    return out
