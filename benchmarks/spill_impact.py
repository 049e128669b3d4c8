"""Does the durable tier slow training down? Save stall with no spill, a healthy spill and a dead one.

    python benchmarks/spill_impact.py [--mib 256] [--saves 8] [--json PATH]

Three clusters (2 hosts, R=2), the same state saved every step and spilled every step: to nothing,
to a local directory, and to an S3 endpoint that refuses every connection (the spiller keeps
retrying with backoff). Reports the trainer's stall p50 and time to committed p50 of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memstore.testing import LocalCluster, free_ports


@dataclass
class SpillImpact:
    stall_p50: float
    committed_p50: float
    stall_over_no_spill: float | None = None


def run(label: str, mib: int, saves: int, extra: list[str], env: dict[str, str] | None) -> SpillImpact:
    """Saves of a ``mib`` MiB state every ~0.2 s on a fresh 2-host cluster started with ``extra`` store flags."""
    import torch

    from trainer_client import CheckpointClient

    state = {f"t{i}": torch.randn((mib << 20) // 4 // 8) for i in range(8)}
    with (
        LocalCluster(hosts=2, replicas=2, capacity=f"{mib * 4 + 64}MiB", extra_args=extra, env=env) as cluster,
        CheckpointClient("impact", 0, 1, store=cluster.address("h0")) as c,
    ):
        stalls, commits = [], []
        for step in range(1, saves + 4):
            t0 = time.perf_counter()
            h = c.save(step, state)
            stall = time.perf_counter() - t0
            h.wait(timeout=120)
            if step > 3:  # after the segment pool is warm
                stalls.append(stall)
                commits.append(time.perf_counter() - t0)
            time.sleep(0.2)
        health = cluster.health("h0")
    spill = [(j.last_spilled_step, j.consecutive_failures) for j in health.spill] if health else []
    out = SpillImpact(stall_p50=statistics.median(stalls), committed_p50=statistics.median(commits))
    print(f"{label:<34} stall p50 {out.stall_p50 * 1e3:7.1f} ms   committed p50 {out.committed_p50 * 1e3:7.1f} ms   spill {spill}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/spill_impact.py", description="save stall with and without spilling")
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--saves", type=int, default=8)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    (dead_port,) = free_ports(1)
    dead = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{dead_port}",
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "x",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    with tempfile.TemporaryDirectory() as d:
        results = {
            "no spill": run("no spill", args.mib, args.saves, [], None),
            "spill every step, local dir": run(
                "spill every step to a local dir", args.mib, args.saves, ["--spill", f"file://{d}", "--spill-every-steps", "1"], None
            ),
            "spill every step, storage down": run(
                "spill every step, storage down", args.mib, args.saves, ["--spill", "s3://nowhere/x", "--spill-every-steps", "1"], dead
            ),
        }
    base = results["no spill"].stall_p50
    for v in results.values():
        v.stall_over_no_spill = v.stall_p50 / base
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({k: asdict(v) for k, v in results.items()}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
