"""What a checkpoint costs a Ray Train job: memstore vs Ray Train's own checkpoints, per step and at resume.

    python benchmarks/ray_train.py [--mib 64] [--steps 6] [--json PATH]

A local Ray cluster (``ray.cluster_utils``, a head without CPUs plus two 1-CPU nodes on 127.0.0.1) runs a
``TorchTrainer`` of two workers, each holding ``--mib`` MiB of state, three ways:

- ``none``: ``ray.train.report(metrics)`` each step, no checkpoint (the floor: the report barrier alone);
- ``ray``: Ray Train's own way: ``torch.save`` into a temporary directory, then ``ray.train.report(...,
  checkpoint=Checkpoint.from_directory(...))``, which copies it to ``storage_path`` (a local directory here,
  so the figure is a lower bound for S3 or NFS);
- ``memstore``: ``RayTrainCheckpoints.save`` (capture into the node's store, R=2 copies, pointer report).

Each worker times every step's checkpoint call (first step separately: the first save of a job pays for
fresh memory), and a second ``fit`` of the same run name times the resume: ``RayTrainCheckpoints.restore``
against ``get_checkpoint`` + ``torch.load``. The figures are ratios to ``none`` and between the two.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep the cluster on 127.0.0.1
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray

MODES = ("none", "ray", "memstore")


def _state(mib: int, step: int) -> dict[str, Any]:
    import torch

    n = mib * (1 << 20) // 4
    return {"weights": torch.full((n,), float(step)), "step": step}


def _bench_loop(config: dict[str, Any]) -> None:
    import torch

    from memstore.ray.train import RayTrainCheckpoints
    from trainer_client import Connection

    mode, mib, steps = config["mode"], config["mib"], config["steps"]
    rank = ray.train.get_context().get_world_rank()
    times: list[tuple[float, float]] = []  # per step: (capture: the training step waits, report: ray.train.report and what it waits for)
    ckpt = RayTrainCheckpoints(connection=Connection(timeout=120)) if mode == "memstore" else None
    t0 = time.perf_counter()
    if ckpt is not None:
        restored = ckpt.restore()
    else:
        restored = None
        found = ray.train.get_checkpoint()
        if found is not None and mode == "ray":
            with found.as_directory() as d:
                restored = torch.load(os.path.join(d, f"rank{rank}.pt"))
    resume = time.perf_counter() - t0
    if restored is None:
        for step in range(steps):
            state = _state(mib, step)
            t0 = time.perf_counter()
            if ckpt is not None:
                ckpt.save(step, state)
                capture, report = ckpt.last_capture_seconds, ckpt.last_report_seconds
            elif mode == "ray":
                with tempfile.TemporaryDirectory() as d:
                    torch.save(state, os.path.join(d, f"rank{rank}.pt"))
                    capture = time.perf_counter() - t0
                    ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(d))
                report = time.perf_counter() - t0 - capture
            else:
                ray.train.report({"step": step})
                capture, report = 0.0, time.perf_counter() - t0
            times.append((capture, report))
        if ckpt is not None:
            ckpt.finish()
    else:
        ray.train.report({"resumed": 1})
    with open(os.path.join(config["out"], f"{mode}-{'resume' if restored is not None else 'train'}-rank{rank}.json"), "w") as f:
        json.dump({"times": times, "resume": resume if restored is not None else None}, f)


def _fit(mode: str, mib: int, steps: int, out: Path) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    TorchTrainer(
        _bench_loop,
        train_loop_config={"mode": mode, "mib": mib, "steps": steps, "out": str(out)},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=f"bench-{mode}", storage_path=str(out / "ray_results")),
    ).fit()


def _summary(out: Path, mode: str) -> dict[str, Any]:
    train = [json.loads(p.read_text()) for p in sorted(out.glob(f"{mode}-train-rank*.json"))]
    resume = [json.loads(p.read_text())["resume"] for p in sorted(out.glob(f"{mode}-resume-rank*.json"))]
    later = [step for t in train for step in t["times"][1:]]
    return {
        "first_capture_s": max(t["times"][0][0] for t in train),
        "first_report_s": max(t["times"][0][1] for t in train),
        "capture_p50_s": statistics.median(c for c, _ in later),
        "report_p50_s": statistics.median(r for _, r in later),
        # The rank that reaches restore last waits for no one: its time is the cost without start-up skew.
        "resume_s": min(resume) if resume else None,
        "resume_per_rank_s": resume,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--mib", type=int, default=64, help="state per worker, MiB")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    from ray.cluster_utils import Cluster

    import memstore.ray

    shm = f"/dev/shm/memstore-bench-{os.getpid()}"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=200 << 20)
    ray.init(address=cluster.address, _node_ip_address="127.0.0.1", logging_level=logging.WARNING, log_to_driver=False)
    results: dict[str, Any] = {"mib_per_worker": args.mib, "workers": 2, "steps": args.steps}
    try:
        memstore.ray.ensure_stores(replicas=2, capacity=f"{args.mib * 8}MiB", config={"shm_dir": shm, "keep": 2})
        with tempfile.TemporaryDirectory() as tmp:
            for mode in MODES:
                out = Path(tmp, mode)
                out.mkdir()
                _fit(mode, args.mib, args.steps, out)  # train
                _fit(mode, args.mib, args.steps, out)  # the same run again: resumes from its newest checkpoint
                results[mode] = _summary(out, mode)
    finally:
        memstore.ray.stop_stores()
        ray.shutdown()
        cluster.shutdown()
        import shutil

        shutil.rmtree(shm, ignore_errors=True)
    base = results["none"]["report_p50_s"]
    for mode in ("ray", "memstore"):
        r = results[mode]
        print(f"{mode:9s} capture: first {r['first_capture_s'] * 1e3:7.1f} ms, later p50 {r['capture_p50_s'] * 1e3:7.1f} ms   "
              f"report p50 {r['report_p50_s'] * 1e3:7.1f} ms (alone: {base * 1e3:.1f} ms)   "
              f"resume {r['resume_s'] * 1e3:7.1f} ms")  # fmt: skip
    ray_r, ms_r = results["ray"], results["memstore"]
    results["ratios"] = {
        "capture_ray_over_memstore": ray_r["capture_p50_s"] / ms_r["capture_p50_s"],
        "first_capture_ray_over_memstore": ray_r["first_capture_s"] / ms_r["first_capture_s"],
        "report_ray_over_memstore": ray_r["report_p50_s"] / ms_r["report_p50_s"],
        "resume_ray_over_memstore": ray_r["resume_s"] / ms_r["resume_s"],
    }
    print("ratios (Ray Train's own / memstore):", {k: round(v, 2) for k, v in results["ratios"].items()})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
