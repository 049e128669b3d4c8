"""The several-ranks-per-host section (``--ranks-per-host N``, N >= 2): N trainer processes on one store save at once.

On a local cluster of its own (the run's ``--hosts``, ``--replicas`` and ``--keep``), N ranks of one job (world size
N), each a process of its own (this module run as ``python -m memstore.bench.ranks``, driven over JSON lines like the
restore process of :mod:`~memstore.bench.rig`), all connected to store h0, each with its own state of ``--size``/N
bytes (the bench's layout, seeded per rank): the run's state split over N ranks, as a model-parallel job splits one,
so the total logical state is the single-rank run's. The ranks save 1 + keep + 1 + ``--saves`` times, phases as in
the main series (save 1, the early saves, the steady state). Each round:

1. every rank copies its state into a pre-faulted buffer of its own (its memcpy baseline, measured in the rank's process
   at the same moment as the others', so under the same contention as their saves), and says so;
2. once all have, every rank is told to ``save()`` at once (the barrier: one line to each), and reports its stall
   (call -> return), its ratio over its own memcpy and call -> committed;
3. retention settles (the oldest of keep steps dropped everywhere), as the next save comes a training step later.

Meanwhile the stores' shared memory is sampled (the sum over stores of Health's ``used_bytes``, what ``memstore
status --json`` shows as each host's ``used``), every :data:`SAMPLE_SECONDS`: the RAM multiple is it over the total
logical state, at its peak across the saves, right after them, and once the job went idle (its spares given
back). (keep+1) x R is what the guarantee needs.

Each rank runs torch on one thread unless ``OMP_NUM_THREADS`` says otherwise, as ``torchrun`` sets it for several
processes per host (its memcpy and its save's copies alike).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from memstore.bench.measure import FIRST, STEADY, phase_of, timed_save
from memstore.bench.rig import RamSampler, RestoreProcess, idle_ram, ram_fields, running, start_cluster, wait_idle, wait_settled
from memstore.bench.state import MiB, copy_all, make_state, nbytes_of, p50, prefaulted, ratio, tensors_of

if TYPE_CHECKING:
    from memstore.testing import LocalCluster

JOB = "bench-ranks"
ANSWER_SECONDS = 600.0  # the longest a rank may take to answer one command


def check_ranks(ranks: int, size: int) -> None:
    """ValueError unless ``ranks`` ranks per host can split ``size`` bytes, at least 1 MiB each."""
    if ranks < 1:
        raise ValueError(f"--ranks-per-host must be >= 1 (1: the one benchmarked rank only), got {ranks}")
    if ranks > 1 and size // ranks < MiB:
        raise ValueError(f"--size {size} over --ranks-per-host {ranks} leaves less than 1 MiB per rank")


def measure(config: dict[str, Any]) -> dict[str, Any]:
    """The section for the run's ``config`` (``memstore.bench.config_of``)."""
    return measure_ranks(
        config["size"], config["ranks_per_host"], config["hosts"], config["replicas"], config["keep"], config["saves"], config["seed"],
        config["data_plane"], config["store_env"], config["shm_dir"], config.get("idle_wait", 0.0),
    )  # fmt: skip


class Rank:
    """One rank's process: started, told its state and store, then its memcpy and its saves, one command at a time."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.child = RestoreProcess("memstore.bench.ranks", f"bench rank {rank}")

    def start(self, address: str, world_size: int, nbytes: int, seed: int) -> None:
        self.child.read(timeout=120.0)  # torch imported
        self.child.send({"address": address, "job": JOB, "rank": self.rank, "world_size": world_size, "size": nbytes, "seed": seed})

    def ask(self, command: dict[str, Any]) -> None:
        self.child.send(command)

    def answer(self) -> dict[str, Any]:
        return self.child.read(timeout=ANSWER_SECONDS)


def everyone(ranks: list[Rank], command: dict[str, Any]) -> list[dict[str, Any]]:
    """``command`` to every rank at once, then every answer (in rank order): a barrier around it."""
    for r in ranks:
        r.ask(command)
    return [r.answer() for r in ranks]


def save_rounds(cluster: LocalCluster, ranks: list[Rank], keep: int, count: int, ram: RamSampler) -> list[list[dict[str, Any]]]:
    """``count`` rounds of memcpy then save, by every rank at once; retention settles after each."""
    rounds = []
    for i in range(count):
        with ram.sampling():
            memcpy = everyone(ranks, {"op": "memcpy"})
            saves = everyone(ranks, {"op": "save", "step": i + 1})
        rounds.append([
            {"rank": r.rank, "step": i + 1, "phase": phase_of(i, keep), "memcpy_seconds": m["memcpy_seconds"], **s,
             "stall_over_memcpy": ratio(s["stall_seconds"], m["memcpy_seconds"])}
            for r, m, s in zip(ranks, memcpy, saves, strict=True)
        ])  # fmt: skip
        wait_settled(cluster, JOB, keep)
    return rounds


def measure_ranks(
    size: int, ranks: int, hosts: int, replicas: int, keep: int, steady: int, seed: int, data_plane: str | None, env: dict[str, str],
    shm_root: str, idle_wait: float = 0.0,
) -> dict[str, Any]:  # fmt: skip
    """The section's document: ``ranks`` rank processes on store h0 of a fresh cluster, each saving ``size``/``ranks``
    bytes, 1 + keep + 1 + ``steady`` rounds; then up to ``idle_wait`` seconds for the stores to give the spares back."""
    per_rank = size // ranks
    procs = [Rank(r) for r in range(ranks)]
    try:
        with running(start_cluster(hosts, replicas, keep, per_rank * ranks, data_plane, env, shm_root)) as cluster:
            wait_idle(cluster)
            for r in procs:
                r.start(cluster.address("h0"), ranks, per_rank, seed + r.rank)
            state_bytes = [int(a["state_bytes"]) for a in (r.answer() for r in procs)]  # each client connected
            ram = RamSampler(cluster)
            try:
                rounds = save_rounds(cluster, procs, keep, 1 + keep + 1 + steady, ram)
                settled = ram.used()
                idle = idle_ram(ram, idle_wait) if idle_wait > 0 else None
            finally:
                ram.close()
            everyone(procs, {"op": "close"})
    finally:
        for r in procs:
            r.child.close()
    section = summary(rounds, state_bytes, hosts, replicas, keep)
    return {**section, **ram_fields(ram.peak, settled, idle, sum(state_bytes))}


def summary(rounds: list[list[dict[str, Any]]], state_bytes: list[int], hosts: int, replicas: int, keep: int) -> dict[str, Any]:
    """Every save, and per phase the worst and median rank's stall over its own memcpy and call -> committed; the RAM."""
    total = sum(state_bytes)
    saves = [s for r in rounds for s in r]

    def phase(name: str) -> dict[str, Any]:
        ratios = [s["stall_over_memcpy"] for s in saves if s["phase"] == name and s["stall_over_memcpy"] is not None]
        committed = [s["committed_seconds"] for s in saves if s["phase"] == name]
        return {
            "saves": len(committed), "stall_over_memcpy_max": max(ratios, default=None), "stall_over_memcpy_p50": p50(ratios),
            "committed_max": max(committed, default=None), "committed_p50": p50(committed),
            # the whole host's bytes over its slowest rank's call -> committed (round by round, the median round)
            "committed_bytes_per_second": p50([total / max(s["committed_seconds"] for s in r) for r in rounds if r[0]["phase"] == name]),
        }  # fmt: skip

    return {
        "ranks": len(state_bytes), "hosts": hosts, "replicas": replicas, "keep": keep, "state_bytes": total,
        "rank_state_bytes": state_bytes, "first": phase(FIRST), "steady": phase(STEADY),
        "per_rank": [per_rank(saves, r) for r in range(len(state_bytes))],
        "copies_min": min(s["copies"] for s in saves), "errors": [s["error"] for s in saves if s["error"]],
        "ram_multiple_needed": (keep + 1) * replicas,
        "saves": rounds,
    }  # fmt: skip


def per_rank(saves: list[dict[str, Any]], rank: int) -> dict[str, Any]:
    """One rank's save 1 and steady state: stall over its own memcpy, call -> committed."""
    mine = [s for s in saves if s["rank"] == rank]
    first = next(s for s in mine if s["phase"] == FIRST)
    steady = [s for s in mine if s["phase"] == STEADY]
    return {
        "rank": rank, "first_stall_over_memcpy": first["stall_over_memcpy"], "first_committed_seconds": first["committed_seconds"],
        "steady_stall_over_memcpy_p50": p50([s["stall_over_memcpy"] for s in steady if s["stall_over_memcpy"] is not None]),
        "steady_committed_p50": p50([s["committed_seconds"] for s in steady]),
    }  # fmt: skip


def ok(section: dict[str, Any]) -> bool:
    """Every save of every rank reached R copies."""
    return section["copies_min"] >= section["replicas"] and not section["errors"]


def summary_line(section: dict[str, Any]) -> str:
    """The section in one line of the human summary."""

    def x(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f}x"

    first, steady = section["first"], section["steady"]
    return (
        f"{section['ranks']} ranks on one store, {section['state_bytes'] / MiB:.0f} MiB in all: stall over each rank's own memcpy "
        f"save 1 max {x(first['stall_over_memcpy_max'])}, steady max {x(steady['stall_over_memcpy_max'])} "
        f"(p50 {x(steady['stall_over_memcpy_p50'])}); committed steady p50 {(steady['committed_p50'] or 0) * 1000:.0f} ms; "
        f"RAM / state peak {x(section['ram_multiple_peak'])}, settled {x(section['ram_multiple_settled'])}, "
        f"idle {x(section['ram_multiple_idle'])} (the guarantee needs {section['ram_multiple_needed']}x)"
    )


def rank_worker() -> None:
    """The child: one rank. stdout carries one JSON line per answer (anything else printed goes to stderr)."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    import torch  # a trainer has torch loaded before it saves

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # as torchrun sets it for several processes per host: N ranks do not share each core N ways

    from trainer_client import CheckpointClient, Connection

    out.write(json.dumps({"ready": True}) + "\n")
    cmd = json.loads(sys.stdin.readline())
    state = make_state(int(cmd["size"]), int(cmd["seed"]))
    tensors = tensors_of(state)
    nbytes = nbytes_of(tensors)
    paired = prefaulted(nbytes)
    client = CheckpointClient(cmd["job"], int(cmd["rank"]), int(cmd["world_size"]), connection=Connection(cmd["address"], timeout=60.0))
    out.write(json.dumps({"state_bytes": nbytes}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "memcpy":
            t = time.perf_counter()
            copy_all(paired, tensors)
            out.write(json.dumps({"memcpy_seconds": time.perf_counter() - t}) + "\n")
        elif cmd["op"] == "save":
            out.write(json.dumps(timed_save(client, int(cmd["step"]), state, nbytes)) + "\n")
        else:  # close
            client.close()
            out.write(json.dumps({"closed": True}) + "\n")
            return


if __name__ == "__main__":
    rank_worker()
