"""How long ``save(capture="enqueued")`` keeps the trainer, on the CPU: the case issue 25 measured.

    python benchmarks/enqueued_cpu.py [--size 1GiB] [--tensors 64] [--saves 8] [--hosts 2] [--replicas 2] [--json out.json]

Starts a ``--hosts``-host, R=``--replicas`` local cluster on 127.0.0.1 twice, and with a fresh client on each (one
that calls ``client.prepare(state)`` first, one that does not) saves a CPU state of ``--tensors`` float32
tensors of ``--size`` bytes ``--saves`` times with ``capture="enqueued"``, waiting for each save to be replicated
(``handle.wait()``) before the next. Reports, per save, the time until ``save()`` returned and until the capture
was done (``wait_captured(block=True)``), in milliseconds; and the time ``prepare`` took.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from memstore.core.sizes import parse_size
from memstore.testing import LocalCluster
from trainer_client import CheckpointClient, Connection


def timed_saves(
    client: CheckpointClient, state: Any, saves: int, between: Callable[[], None] | None = None
) -> tuple[list[float], list[float]]:
    """Steps 1..``saves`` with ``capture="enqueued"``, each replicated before the next: the seconds until ``save()``
    returned and until the capture was done (``wait_captured(block=True)``), per save. ``between``: called before each
    save (a test waits there for the next save's memory, reserved once retention let the oldest step go, as it is at a
    trainer's cadence; without it a save may come first and allocate its memory itself)."""
    returned, captured = [], []
    for step in range(1, saves + 1):
        if between is not None:
            between()
        t0 = time.perf_counter()
        handle = client.save(step, state, capture="enqueued")
        returned.append(time.perf_counter() - t0)
        handle.wait_captured(block=True)
        captured.append(time.perf_counter() - t0)
        handle.wait(300)
    return returned, captured


def run(address: str, job: str, state: dict[str, torch.Tensor], saves: int, prepare: bool) -> dict[str, Any]:
    with CheckpointClient(job, 0, 1, connection=Connection(address)) as client:
        prepared = 0.0
        if prepare:
            t0 = time.perf_counter()
            client.prepare(state)
            prepared = time.perf_counter() - t0
        returned, captured = timed_saves(client, state, saves)
        return {
            "prepare_ms": round(prepared * 1e3, 1),
            "returned_ms": [round(x * 1e3, 2) for x in returned],
            "captured_ms": [round(x * 1e3, 1) for x in captured],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--saves", type=int, default=8)
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    size = parse_size(args.size)
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(size // args.tensors // 4, generator=g) for i in range(args.tensors)}
    capacity = f"{(8 * size + (1 << 30) - 1) // (1 << 30) + 1}GiB"  # the ring (--keep + 4 segments) and the peers' copies
    out: dict[str, Any] = {"size": args.size, "tensors": args.tensors, "hosts": args.hosts, "replicas": args.replicas}
    for name, prepare in (("without_prepare", False), ("with_prepare", True)):  # a fresh cluster each: a user's first use
        with LocalCluster(hosts=args.hosts, replicas=args.replicas, capacity=capacity) as cluster:
            out[name] = run(cluster.address("h0"), f"enq-{name}", state, args.saves, prepare=prepare)
    for name in ("without_prepare", "with_prepare"):
        r = out[name]
        print(f"{name:16} prepare {r['prepare_ms']:8.1f} ms | save() returned (ms): {r['returned_ms']}")
        print(f"{'':16} {'':16} | captured (ms):       {r['captured_ms']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
