"""GPU capture and restore: a CUDA state into the store's memory and back onto the device, against the D2H floor.

    python benchmarks/gpu_capture.py [--size 1GiB] [--tensors 64] [--saves 10] [--device cuda:0] [--json out.json]

Needs a CUDA device; exits with a message where torch sees none. Starts a 1-host, R=1 local cluster on 127.0.0.1
(capacity: three times the state, stopped at the end), builds a state of ``--tensors`` float32 CUDA tensors of
``--size`` bytes in all, and measures, in one run:

- floor: ``copy_`` of every tensor into a slice of one pinned buffer (``torch.empty(pin_memory=True)``), then a
  synchronize: the device->host copy of the same bytes into pinned memory (median of 5), as GB/s;
- ``capture="copied"``: the first save's stall (registering the segment included) and the steady stall (median
  of the saves after the fourth: by then the store recycles segments the client has registered), GB/s and the
  ratio to the floor;
- ``capture="enqueued"``: the time until ``save()`` returns, and until ``wait_captured(block=True)`` returns
  (medians, steady saves);
- ``load(map_location=device)``: GB/s (median of 3), next to loading to CPU then ``.to(device)`` per tensor
  (pageable source) for comparison.

Prints a table; ``--json`` writes the same figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from memstore.core.sizes import parse_size
from memstore.devtools.cluster import LocalCluster
from trainer_client import CheckpointClient


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def build_state(size: int, tensors: int, device: torch.device) -> dict[str, torch.Tensor]:
    each = max(1, size // tensors // 4)
    g = torch.Generator(device=device).manual_seed(0)
    return {f"t{i}": torch.randn(each, device=device, generator=g) for i in range(tensors)}


def floor_seconds(state: dict[str, torch.Tensor], device: torch.device, reps: int = 5) -> float:
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        offset = 0
        for t in state.values():
            n = t.numel() * t.element_size()
            pinned[offset : offset + n].view(t.dtype).copy_(t, non_blocking=True)
            offset += n
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    torch.cuda.set_device(device)
    state = build_state(parse_size(args.size), args.tensors, device)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    floor = floor_seconds(state, device)
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device), "bytes": nbytes, "tensors": args.tensors,
        "floor_seconds": floor, "floor_gbps": gbps(nbytes, floor),
    }  # fmt: skip
    with LocalCluster(hosts=1, replicas=1, capacity=str(3 * nbytes + (256 << 20))) as cluster:
        cluster.start()
        with CheckpointClient("gpu-capture", 0, 1, store=cluster.address("h0")) as client:
            stalls = []
            for step in range(args.saves):
                torch.cuda.synchronize(device)
                started = time.perf_counter()
                handle = client.save(step, state, capture="copied")
                stalls.append(time.perf_counter() - started)
                handle.wait(timeout=600)
            steady = statistics.median(stalls[4:] or stalls)
            copier = client._captures._copier
            out.update(
                copied_first_seconds=stalls[0], copied_first_gbps=gbps(nbytes, stalls[0]),
                copied_steady_seconds=steady, copied_steady_gbps=gbps(nbytes, steady), copied_steady_vs_floor=steady / floor,
                registrations=copier.pins.registered if copier is not None else 0,
            )  # fmt: skip
            returned, captured = [], []
            for step in range(args.saves, 2 * args.saves):
                torch.cuda.synchronize(device)
                started = time.perf_counter()
                handle = client.save(step, state, capture="enqueued")
                returned.append(time.perf_counter() - started)
                handle.wait_captured(block=True)
                captured.append(time.perf_counter() - started)
                handle.wait(timeout=600)
            out.update(
                enqueued_return_seconds=statistics.median(returned[4:] or returned),
                enqueued_captured_seconds=statistics.median(captured[4:] or captured),
            )
            last = 2 * args.saves - 1
            loads, pageable = [], []
            for _ in range(3):
                torch.cuda.synchronize(device)
                started = time.perf_counter()
                restored = client.load(last, map_location=device)
                loads.append(time.perf_counter() - started)  # load() returns once the copies are done
                del restored
                started = time.perf_counter()
                on_cpu = client.load(last)
                moved = {k: v.to(device) for k, v in on_cpu.items()}
                torch.cuda.synchronize(device)
                pageable.append(time.perf_counter() - started)
                del on_cpu, moved
            out.update(
                load_seconds=statistics.median(loads), load_gbps=gbps(nbytes, statistics.median(loads)),
                load_cpu_then_to_seconds=statistics.median(pageable), load_cpu_then_to_gbps=gbps(nbytes, statistics.median(pageable)),
            )  # fmt: skip
    return out


def print_table(r: dict[str, Any]) -> None:
    mib = r["bytes"] / (1 << 20)
    print(f"{r['device']}: {mib:.0f} MiB in {r['tensors']} float32 CUDA tensors")
    rows = [
        ("floor: D2H into pinned memory", r["floor_seconds"], r["floor_gbps"], 1.0),
        ('save capture="copied", first', r["copied_first_seconds"], r["copied_first_gbps"], r["copied_first_seconds"] / r["floor_seconds"]),
        ('save capture="copied", steady', r["copied_steady_seconds"], r["copied_steady_gbps"], r["copied_steady_vs_floor"]),
        ('save capture="enqueued": returns', r["enqueued_return_seconds"], None, None),
        ('  ... wait_captured(block=True)', r["enqueued_captured_seconds"], None, None),
        ('load(map_location="cuda")', r["load_seconds"], r["load_gbps"], None),
        ("load() then .to(device) (pageable)", r["load_cpu_then_to_seconds"], r["load_cpu_then_to_gbps"], None),
    ]
    print(f"{'':38} {'ms':>10} {'GB/s':>8} {'x floor':>8}")
    for name, seconds, rate, ratio in rows:
        rate_s = f"{rate:8.2f}" if rate is not None else f"{'':8}"
        ratio_s = f"{ratio:8.2f}" if ratio is not None else f"{'':8}"
        print(f"{name:38} {seconds * 1e3:10.2f} {rate_s} {ratio_s}")
    print(f"segment registrations (cudaHostRegister) over all saves: {r['registrations']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1GiB", help="bytes of CUDA state (suffixes: MiB, GiB)")
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--saves", type=int, default=10, help="saves per capture mode (the first four count as warm-up)")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--json", help="write the figures to this file")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu_capture.py needs a CUDA device, and torch.cuda.is_available() is False here")
    result = run(args)
    print_table(result)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
