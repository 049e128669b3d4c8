"""A replica group's restore against the plain one, on a small state: what issue 40's "at most 1.2x" is measured by.

    python benchmarks/group_restore.py [--tensors 64] [--numel 38000] [--loads 30] [--runs 3] [--json PATH]

Starts 2 stores on 127.0.0.1 (R = 2), saves one step of the same state (64 float32 tensors, 9.3 MiB by default) as two
jobs of 2 ranks: ``plain`` (each rank its whole state) and ``group`` (``replica_group=[0, 1]``: each rank a stripe of
it). Then, ``--loads`` times per run, a new client of rank 0 of each job calls ``latest_step()`` and ``load(1)`` (the
two jobs interleaved, which goes first alternating); ``load()`` is timed, every restore compared with the state, then
freed outside the timing (not inside the next load's). Each run reports the median load of each job and their ratio;
the stores' defaults otherwise.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from memstore.testing import LocalCluster
from trainer_client import CheckpointClient, Connection

JOBS = {"plain": None, "group": [0, 1]}


def state(tensors: int, numel: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(numel, generator=g) for i in range(tensors)}


def client(cluster: LocalCluster, host: str, job: str, rank: int) -> CheckpointClient:
    return CheckpointClient(job, rank, 2, connection=Connection(cluster.address(host)), run_id="r1", replica_group=JOBS[job], group=False)


def one_run(cluster: LocalCluster, hosts: list[str], expected: dict[str, torch.Tensor], loads: int) -> dict[str, float]:
    times: dict[str, list[float]] = {job: [] for job in JOBS}
    for i in range(loads):
        for job in JOBS if i % 2 else reversed(JOBS):
            with client(cluster, hosts[0], job, 0) as c:
                c.latest_step()
                start = time.perf_counter()
                out = c.load(1)
                times[job].append(time.perf_counter() - start)
                if not all(torch.equal(out[k], v) for k, v in expected.items()):
                    raise SystemExit(f"job {job}: a restore differs from the state saved")
                del out
                gc.collect()  # freed here, with any reference cycle, not inside the next load's timing
    medians = {job: statistics.median(t) for job, t in times.items()}
    return {"plain_ms": medians["plain"] * 1e3, "group_ms": medians["group"] * 1e3, "ratio": medians["group"] / medians["plain"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--numel", type=int, default=38000, help="float32 elements per tensor")
    p.add_argument("--loads", type=int, default=30, help="loads of each job per run")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", default="", help="also write the results here")
    args = p.parse_args()
    for name in ("tensors", "numel", "loads", "runs"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    expected = state(args.tensors, args.numel)
    nbytes = sum(t.numel() * t.element_size() for t in expected.values())
    cluster = LocalCluster(hosts=2, replicas=2, capacity="1GiB")
    cluster.start(timeout=60)
    try:
        hosts = list(cluster.members)
        for job in JOBS:
            clients = [client(cluster, hosts[r], job, r) for r in range(2)]
            try:
                for handle in [c.save(1, expected) for c in clients]:
                    if not handle.wait(timeout=60).committed:
                        raise SystemExit(f"job {job}: step 1 did not commit")
            finally:
                for c in clients:
                    c.close()
        runs = [one_run(cluster, hosts, expected, args.loads) for _ in range(args.runs)]
    finally:
        cluster.stop()
    for r in runs:
        print(f"plain {r['plain_ms']:.1f} ms  group {r['group_ms']:.1f} ms  group/plain {r['ratio']:.2f}")
    result = {"state_bytes": nbytes, "tensors": args.tensors, "loads": args.loads, "runs": runs}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
