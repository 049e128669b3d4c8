"""What the bench measures on the stores: the saves from the first of a fresh job (each paired with a memcpy of the same
bytes right before it), the small saves (fixed cost per save), and the restores in a new process, from local RAM
after a trainer crash and from peer RAM after a host loss.

Save 1 is the first save of a fresh job on freshly started stores (nothing warms anything up before it); saves
2..keep+2 come before the store's segment pool can recycle a segment ("early"); the rest are the steady state.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from memstore.bench.baselines import PairedTcp
from memstore.bench.cpu import CpuMeter
from memstore.bench.rig import restore_in_new_process, wait_caught_up, wait_idle, wait_settled
from memstore.bench.state import MiB, copy_all, fingerprint, make_state, nbytes_of, p50, prefaulted, tensors_of

if TYPE_CHECKING:
    from memstore.testing import LocalCluster
    from trainer_client import CheckpointClient

FIRST, EARLY, STEADY = "first", "early", "steady"
SMALL_SIZE = 1 * MiB


def phase_of(index: int, keep: int) -> str:
    """Save ``index + 1``'s phase: save 1, saves 2..keep+2, or the steady state after them."""
    return FIRST if index == 0 else EARLY if index <= keep + 1 else STEADY


def commit_timeout(nbytes: int) -> float:
    return 60.0 + nbytes / (10 * MiB)


@dataclass
class Series:
    """``count`` saves of ``state`` by one client, steps 1..count, on ``cluster``."""

    cluster: LocalCluster
    client: CheckpointClient
    state: Any
    keep: int
    count: int
    paired: Any = None  # a pre-faulted buffer of the state's bytes for the paired memcpy (None: no memcpy)
    tcp: PairedTcp | None = None  # raw TCP of the shard's bytes, measured right before each save (None: not measured)
    stores: dict[str, int] = field(default_factory=dict)  # the store processes' pids: their CPU per save is reported


def one_save(series: Series, index: int, tensors: list[Any]) -> dict[str, Any]:
    """A paired raw TCP transfer and memcpy (when asked), then one save timed from the call: stall (call -> return) and
    call -> committed; ``nbytes``: the bytes the rank captured (its shard's size as the store reports it); ``cpu``: the
    CPU seconds the save took in the trainer, each store and the machine (``memstore.bench.cpu``), ``tcp_cpu`` those
    of its paired TCP transfer."""
    cpus = os.cpu_count() or 1
    tcp = tcp_cpu = None
    if series.tcp is not None:
        with CpuMeter({"sender": series.tcp.sender_pid}) as meter:
            tcp = series.tcp.seconds()
        tcp_cpu = meter.report(cpus)
    memcpy = None
    if series.paired is not None:
        t = time.perf_counter()
        copy_all(series.paired, tensors)
        memcpy = time.perf_counter() - t
    with CpuMeter(series.stores) as meter:
        saved = timed_save(series.client, index + 1, series.state, nbytes_of(tensors))
    return {
        "step": index + 1,
        "phase": phase_of(index, series.keep),
        "stall_seconds": saved["stall_seconds"],
        "committed_seconds": saved["committed_seconds"],
        "memcpy_seconds": memcpy,
        "tcp_seconds": tcp,
        "cpu": meter.report(cpus),
        "tcp_cpu": tcp_cpu,
        "copies": saved["copies"],
        "nbytes": saved["nbytes"],
        "error": saved["error"],
    }


def timed_save(client: CheckpointClient, step: int, state: Any, state_bytes: int) -> dict[str, Any]:
    """``client.save(step, state)`` timed from the call: stall (call -> return) and call -> committed; its copies, the
    bytes the rank captured and the error it ended with ("" if none)."""
    from trainer_client.errors import ReplicationError

    t0 = time.perf_counter()
    handle = client.save(step, state)
    t1 = time.perf_counter()
    copies, nbytes, error = 0, 0, ""
    try:
        result = handle.wait(timeout=commit_timeout(state_bytes))
        copies, nbytes = int(result.copies), int(result.nbytes)
    except (ReplicationError, TimeoutError) as exc:  # a real outcome (a peer timing out): recorded, the run goes on
        error = str(exc)
    t2 = time.perf_counter()
    return {"stall_seconds": t1 - t0, "committed_seconds": t2 - t0, "copies": copies, "nbytes": nbytes, "error": error}


def save_series(series: Series) -> list[dict[str, Any]]:
    """Every save of the series; after each, retention settles (the oldest of keep steps is dropped everywhere)."""
    tensors = tensors_of(series.state)
    samples = []
    for i in range(series.count):
        samples.append(one_save(series, i, tensors))
        wait_settled(series.cluster, series.client.job_id, series.keep)
    return samples


@contextmanager
def fresh_series(cluster: LocalCluster, job: str, state: Any, keep: int, count: int) -> Iterator[Series]:
    """A series of ``count`` saves of ``state`` by a new client of job ``job`` on ``cluster``, its paired memcpy buffer
    and TCP pair made first and the stores idle, so its first memcpy, like its save 1, runs right after the client
    connected."""
    from trainer_client import CheckpointClient, Connection

    nbytes = nbytes_of(tensors_of(state))
    paired = prefaulted(nbytes)
    with PairedTcp(nbytes) as tcp:
        wait_idle(cluster)
        client = CheckpointClient(job, 0, 1, connection=Connection(cluster.address("h0")))
        try:
            stores = {host: store.proc.pid for host, store in cluster.stores.items() if store.proc is not None}
            yield Series(cluster, client, state, keep, count, paired, tcp, stores)
        finally:
            client.close()


def measure_saves(cluster: LocalCluster, job: str, state: Any, keep: int, steady: int) -> list[dict[str, Any]]:
    """Save 1 of a fresh job on the fresh stores (once they are idle), saves 2..keep+2, then ``steady`` ones, each
    after a raw TCP transfer and a memcpy of the same bytes (``tcp_seconds``, ``memcpy_seconds``)."""
    with fresh_series(cluster, job, state, keep, 1 + keep + 1 + steady) as series:
        return save_series(series)


def measure_prepared_first_save(cluster: LocalCluster, job: str, state: Any, keep: int) -> dict[str, Any]:
    """Save 1 of a fresh job on fresh stores after ``client.prepare(state)`` at set-up, as the integrations call it
    on a resume: the stores settle after the prepare (the client's ring filled, the peers' reserves faulted in, as
    during a trainer's first steps), then one save, timed like the series' (``one_save``), with ``prepare_seconds``."""
    with fresh_series(cluster, job, state, keep, 1) as series:
        t = time.perf_counter()
        series.client.prepare(state)
        prepare_seconds = time.perf_counter() - t
        wait_idle(cluster)
        return {"prepare_seconds": prepare_seconds, "save": one_save(series, 0, tensors_of(state))}


def measure_small_saves(cluster: LocalCluster, job: str, count: int, seed: int, keep: int) -> dict[str, Any]:
    """A 1 MiB state's fixed cost per save: save 1, then ``count`` saves; stall p50 over those after save 1."""
    from trainer_client import CheckpointClient, Connection

    state = make_state(SMALL_SIZE, seed)
    client = CheckpointClient(job, 0, 1, connection=Connection(cluster.address("h0")))
    try:
        samples = save_series(Series(cluster, client, state, keep, 1 + count))
    finally:
        client.close()
    stalls = [s["stall_seconds"] for s in samples[1:]]
    return {"bytes": nbytes_of(tensors_of(state)), "saves": len(stalls), "stall_seconds": stalls, "stall_p50": p50(stalls)}


def restore_local(cluster: LocalCluster, job: str, expected: str, reps: int, timeout: float, world_size: int = 1) -> dict[str, Any]:
    """A new process on the owner's store (h0) connects and ``load()``s, ``reps`` times: a trainer restarted after a crash
    (rank 0 of ``world_size``)."""
    source = {"address": cluster.address("h0"), "job": job, "world_size": world_size}
    runs = [restore_in_new_process(source, timeout) for _ in range(reps)]
    return summarize(runs, expected)


def restore_after_host_loss(
    cluster: LocalCluster, job: str, expected: str, reps: int, keep: int, timeout: float, tcp: PairedTcp | None = None,
    world_size: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """SIGKILL the owner store (h0), start its replacement (empty RAM) and, meanwhile, restore in a new process on it,
    as soon as the replacement's port accepts: its first restore, from peer RAM (timed both from then and from the
    trainer's ``load()`` call, see ``summarize``). ``tcp``: each restore is paired with a raw TCP transfer of the shard
    right before it (``tcp_seconds``), as each save is, on stores that are idle again (the last replacement's reserve
    faulted in): a transfer beside their start-up work would flatter the restore. The restore is rank 0's of a job of
    ``world_size`` ranks."""
    runs = []
    for _ in range(reps):
        wait_caught_up(cluster, "h0", job, keep, timeout)
        paired = None
        if tcp is not None:
            wait_idle(cluster)
            paired = tcp.seconds()
        run = restore_in_new_process(
            {"address": cluster.address("h0"), "job": job, "world_size": world_size},
            timeout,
            before=lambda: cluster.kill("h0"),
            during=lambda: cluster.restart("h0", timeout=60),
        )
        runs.append(run | {"tcp_seconds": paired})
    wait_caught_up(cluster, "h0", job, keep, timeout)
    return summarize(runs, expected)


def summarize(runs: list[dict[str, Any]], expected: str) -> dict[str, Any]:
    """``seconds``: from the moment the store's port accepts (a replacement may still be starting: adopting what its
    predecessor left, faulting in its --prefault reserve) to the state loaded; ``load_seconds``: from the ``load()``
    call, on a client connected once the store serves."""
    seconds = [float(r["seconds"]) for r in runs]
    return {
        "seconds": seconds,
        "p50": p50(seconds),
        "load_p50": p50([float(r["load_seconds"]) for r in runs]),
        "source_hosts": sorted({str(r["source_host"]) for r in runs}),
        "verified_equal": all(r["fingerprint"] == expected for r in runs),
        "runs": runs,
    }


def measure_restores(cluster: LocalCluster, job: str, state: Any, replicas: int, reps: int, keep: int) -> dict[str, Any]:
    """Both restores of the saved state (the peer one only where a peer holds a copy, R >= 2)."""
    expected = fingerprint(state)
    nbytes = nbytes_of(tensors_of(state))
    timeout = 120.0 + nbytes / (20 * MiB)
    out = {"local": restore_local(cluster, job, expected, reps, timeout), "peer": None}
    if replicas >= 2:
        with PairedTcp(nbytes) as tcp:
            out["peer"] = restore_after_host_loss(cluster, job, expected, reps, keep, timeout, tcp)
    return out
