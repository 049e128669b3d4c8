"""Fixed cost of a small save on an idle machine: stall p50 of N saves of a small state, one wait() between saves.

    python benchmarks/fixed_cost.py [--size 1MiB] [--saves 60]

Starts a 2-host, R=2 local cluster on 127.0.0.1 (stopped at the end) and prints save 1's stall and the stall p50/p95
of the saves after the fifth. ``memstore bench`` reports the same figure with the machine as the bench leaves it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from memstore.core.sizes import parse_size
from memstore.testing import LocalCluster
from trainer_client import CheckpointClient, Connection


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1MiB")
    p.add_argument("--saves", type=int, default=60)
    args = p.parse_args()
    size = parse_size(args.size)
    state = {"w": torch.randn(max(1, size // 4))}
    with LocalCluster(hosts=2, replicas=2, capacity="1GiB") as cluster:
        cluster.start()
        with CheckpointClient("fixed-cost", 0, 1, connection=Connection(cluster.address("h0"))) as client:
            path = "Unix socket" if client._link.local is not None else "gRPC"  # which control path ran
            stalls = []
            for step in range(args.saves):
                started = time.perf_counter()
                handle = client.save(step, state)
                stalls.append(time.perf_counter() - started)
                handle.wait(timeout=60)
    steady = sorted(stalls[5:]) or sorted(stalls)
    p50 = statistics.median(steady)
    p95 = steady[min(len(steady) - 1, int(0.95 * len(steady)))]
    print(f"{args.size} state, {args.saves} saves, control path: {path}")
    print(f"save 1 stall {stalls[0] * 1e3:.2f} ms; after save 5: p50 {p50 * 1e3:.2f} ms, p95 {p95 * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
