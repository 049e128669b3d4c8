"""The data-parallel section: D ranks that hold one state, saved today's way and with a replica group.

For D = 1, 2 and 4, on its own local cluster of 4 stores (R as the run's; rank r's store is host r), D ranks hold
the same state (``--dp-size`` bytes, the bench's layout). Two paths, each a fresh job:

* ``no_dedup``: today's, without a replica group: every rank saves its whole state (D x R copies in the stores' RAM);
* ``dedup``: ``CheckpointClient(replica_group=list(range(D)))``: every rank saves a stripe of about 1/D of it
  (:mod:`trainer_client.stripes`), R copies in all.

Each case saves step 1 (its clients' first save), then ``--restores`` steps more, the ones measured: the D ranks
call ``save()`` at once (one thread and one client each): its stall per rank, call -> committed, and the bytes each
rank captured (``SaveResult.nbytes``). Then the stores' RAM for the last step (every copy the stores list, as
``memstore status --json`` counts a job's ``ram_bytes``) over the whole state's encoded size: the copies of the
state. Then, ``--restores`` times, D new clients ``load()`` at once, each restored state checked against the saved
one's fingerprint; and the RAM once more (a restore of stripes pulls the other members' stripes into each rank's
store). The jobs are then deleted. Each time reported is the median over the rounds of the slowest rank's. The two
paths' rounds alternate (a save of one, then of the other; a restore of one, then of the other), so that both see
the same background load on a shared machine.

The D ranks share this machine's cores: captures in parallel cannot show the whole 1/D in wall time there, while the
bytes captured per rank do.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from memstore.bench.measure import Series, one_save
from memstore.bench.rig import SHM_ROOT, running, start_cluster, store_rpc, wait_idle, wait_settled
from memstore.bench.state import MiB, fingerprint, p50, tensors_of

if TYPE_CHECKING:
    from memstore.testing import LocalCluster

DEGREES = (1, 2, 4)
PATHS = ("no_dedup", "dedup")
HOSTS = 4
KEEP = 2
T = TypeVar("T")


def together(calls: list[Callable[[], T]], timeout: float = 600.0) -> list[T]:
    """Every call on its own thread, all released at once (as D ranks reach a checkpoint together); their results."""
    gate = threading.Barrier(len(calls), timeout=timeout)

    def go(call: Callable[[], T]) -> T:
        gate.wait()
        return call()

    with ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="bench-dp") as pool:
        return list(pool.map(go, calls))


def ram_bytes(cluster: LocalCluster, job: str, step: int) -> int:
    """Bytes of the R copies of ``job``'s ``step`` that the stores list (the survey ``memstore status`` shows): copies
    a store pulled ahead of a restore (``cached``, spare room given up first) are not counted."""
    from memstore.survey import take

    s = take(cluster.address(next(iter(cluster.stores))), 10.0, job)
    return sum(r["bytes"] for rows in s.shards.values() for r in rows if r["job"] == job and r["step"] == step and not r["cached"])


def delete_job(cluster: LocalCluster, job: str) -> None:
    from memstore.v1 import store_pb2 as pb

    for h in cluster.stores:
        store_rpc(cluster.address(h), "Delete", pb.DeleteRequest(job_id=job, step=-1, rank=-1))


def clients_of(cluster: LocalCluster, job: str, degree: int, dedup: bool) -> list[Any]:
    from trainer_client import CheckpointClient, Connection

    hosts = list(cluster.stores)
    group = list(range(degree)) if dedup else None
    return [CheckpointClient(job, r, degree, connection=Connection(cluster.address(hosts[r])), replica_group=group) for r in range(degree)]


def restore(client: Any, expected: str) -> dict[str, Any]:
    """One rank's ``load()`` of the newest step, timed; then its first read of every byte (the fingerprint)."""
    t0 = time.perf_counter()
    state = client.load()
    t1 = time.perf_counter()
    same = fingerprint(state) == expected
    t2 = time.perf_counter()
    return {"seconds": t1 - t0, "read_seconds": t2 - t0, "source_host": client.stats().last_load_source or "", "verified_equal": same}


def restore_round(cluster: LocalCluster, job: str, degree: int, dedup: bool, expected: str) -> list[dict[str, Any]]:
    """D new clients (restarted ranks) ``load()`` at once; every rank's restore."""
    loaders = clients_of(cluster, job, degree, dedup)
    try:
        return together([partial(restore, c, expected) for c in loaders])
    finally:
        for c in loaders:
            c.close()


def assembled_after(cluster: LocalCluster, job: str, degree: int, step: int, timeout: float = 30.0) -> float | None:
    """Seconds until the store of each of the ``degree`` ranks holds every stripe of ``step`` (its assembler pulled the
    others ahead of a restore); None if that did not happen within ``timeout``."""
    from memstore.survey import take

    hosts = list(cluster.stores)
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        s = take(cluster.address(next(iter(cluster.stores))), 10.0, job)
        held = {h: {r["rank"] for r in rows if r["job"] == job and r["step"] == step} for h, rows in s.shards.items()}
        if all(held.get(hosts[r], set()) >= set(range(degree)) for r in range(degree)):
            return time.monotonic() - start
        time.sleep(0.05)
    return None


def slowest(rounds: list[list[dict[str, Any]]], key: str) -> float:
    """The median over rounds of the slowest rank's ``key``."""
    return float(statistics.median(max(r[key] for r in ranks) for ranks in rounds))


def one_degree(cluster: LocalCluster, state: Any, whole: int, expected: str, degree: int, rounds: int) -> list[dict[str, Any]]:
    """Both paths' cases at ``degree`` ranks, their rounds interleaved (a save of one path, then of the other, and
    so on), so that both see the same background load: D ranks save ``state`` at once, 1 + ``rounds`` times; the
    stores' RAM for the last step; ``rounds`` restores."""
    jobs = {path: f"dp{degree}-{path}" for path in PATHS}
    tensors = tensors_of(state)
    savers = {path: clients_of(cluster, jobs[path], degree, path == "dedup") for path in PATHS}
    saves: dict[str, list[list[dict[str, Any]]]] = {path: [] for path in PATHS}
    try:
        series = {path: [Series(cluster, c, state, KEEP, 1 + rounds) for c in savers[path]] for path in PATHS}
        for i in range(1 + rounds):
            for path in PATHS:
                saves[path].append(together([partial(one_save, s, i, tensors) for s in series[path]]))
                wait_settled(cluster, jobs[path], KEEP)  # as in the main series: the next save comes a training step later
    finally:
        for c in [*savers["no_dedup"], *savers["dedup"]]:
            c.close()
    ram = {path: ram_bytes(cluster, jobs[path], 1 + rounds) for path in PATHS}
    assembly = assembled_after(cluster, jobs["dedup"], degree, 1 + rounds)  # a restart comes later than this
    restores: dict[str, list[list[dict[str, Any]]]] = {path: [] for path in PATHS}
    for _ in range(rounds):
        for path in PATHS:
            restores[path].append(restore_round(cluster, jobs[path], degree, path == "dedup", expected))
    cases = [summary(degree, path, jobs[path], saves[path], restores[path], ram[path], ram_bytes(cluster, jobs[path], 1 + rounds), whole)
             for path in PATHS]  # fmt: skip
    cases[PATHS.index("dedup")]["assembled_after_seconds"] = assembly
    for job in jobs.values():
        delete_job(cluster, job)
    return cases


def summary(
    degree: int, path: str, job: str, saves: list[list[dict[str, Any]]], restores: list[list[dict[str, Any]]], ram: int, ram_after: int,
    whole: int,
) -> dict[str, Any]:  # fmt: skip
    """One case's document: every save and restore, and the figures the table and the ratios use."""
    measured = saves[1:]  # save 1 is each client's first: its capture ring is set up then
    everything = [s for ranks in saves for s in ranks]
    return {
        "degree": degree, "path": path, "job": job, "first_saves": saves[0], "saves": measured,
        "stall_max": slowest(measured, "stall_seconds"),
        "stall_p50": float(statistics.median(p50([s["stall_seconds"] for s in ranks]) or 0.0 for ranks in measured)),
        "committed_max": slowest(measured, "committed_seconds"),
        "captured_bytes": [s["nbytes"] for s in measured[-1]], "captured_max": max(s["nbytes"] for s in measured[-1]),
        "copies_min": min(s["copies"] for s in everything), "errors": [s["error"] for s in everything if s["error"]],
        "ram_bytes": ram, "ram_copies": ram / whole, "ram_bytes_after_restore": ram_after, "ram_copies_after_restore": ram_after / whole,
        "restores": restores, "restore_max": slowest(restores, "seconds"), "restore_read_max": slowest(restores, "read_seconds"),
        "verified_equal": all(r["verified_equal"] for ranks in restores for r in ranks),
    }  # fmt: skip


def measure_data_parallel(
    state: Any, replicas: int, rounds: int, data_plane: str | None, env: dict[str, str], shm_root: str = SHM_ROOT
) -> dict[str, Any]:
    """Every case, D in :data:`DEGREES` x :data:`PATHS`, on a fresh cluster of max(4, R) stores; the section's document.
    ``rounds``: measured saves and restores of each case (their medians are reported)."""
    from trainer_client import serialization

    whole = serialization.plan(state).nbytes  # the whole state as one shard: what a rank saves today
    hosts = max(HOSTS, replicas)
    expected = fingerprint(state)
    # room per store: keep+3 steps (see start_cluster) of up to R copies each (its rank's and the replicas of others'),
    # for both paths' jobs at once
    with running(start_cluster(hosts, replicas, KEEP, 2 * whole * replicas, data_plane, env, shm_root)) as cluster:
        wait_idle(cluster)
        cases = [c for d in DEGREES for c in one_degree(cluster, state, whole, expected, d, rounds)]
    return {"hosts": hosts, "replicas": replicas, "state_bytes": whole, "rounds": rounds, "cases": cases}


def ok(section: dict[str, Any]) -> bool:
    """Every save reached R copies and every restore verified."""
    return all(c["copies_min"] >= section["replicas"] and not c["errors"] and c["verified_equal"] for c in section["cases"])


def text_table(section: dict[str, Any]) -> str:
    """The section as the bench prints it: one line per case."""
    head = ("D", "path", "stall max", "stall p50", "captured/rank", "RAM copies", "after restore", "restore max", "+ read", "verified")
    rows = [head]
    for c in section["cases"]:
        rows.append((
            str(c["degree"]), c["path"], f"{c['stall_max'] * 1000:.1f} ms", f"{c['stall_p50'] * 1000:.1f} ms",
            f"{c['captured_max'] / MiB:.2f} MiB",
            f"{c['ram_copies']:.2f}", f"{c['ram_copies_after_restore']:.2f}", f"{c['restore_max'] * 1000:.1f} ms",
            f"{c['restore_read_max'] * 1000:.1f} ms", "yes" if c["verified_equal"] else "NO",
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(v.rjust(w) if i > 1 else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths, strict=True))) for r in rows]
    size = section["state_bytes"] / MiB
    title = f"data parallel: a {size:.2f} MiB state on every rank, {section['hosts']} stores, R={section['replicas']}"
    return "\n".join([title, lines[0], "-" * len(lines[0]), *lines[1:]])
