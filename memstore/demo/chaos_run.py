"""The chaos run behind ``memstore chaos``: a real DDP training job under seeded random SIGKILLs must end bit-identical.

A reference run without faults, then the same job while a seeded schedule (:func:`_schedule`) SIGKILLs stores,
store processes alone (their shared memory survives), trainer ranks or whole groups; after each fault the job
restarts from ``latest_step()``. The loss curve and final weights must equal the reference bit for bit. What the
command does, for users, and its flags: :mod:`memstore.cli.chaos` (``memstore chaos --help``).
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memstore.demo.showcase import Job, progress_until
from memstore.errors import DemoFailure
from memstore.testing import LocalCluster


@dataclass
class ChaosReport:
    seed: int
    faults: list[dict[str, Any]] = field(default_factory=list)
    restarts: list[dict[str, Any]] = field(default_factory=list)
    tiers: dict[str, int] = field(default_factory=dict)
    steps_lost: int = 0
    mixed_restores: int = 0
    hangs: int = 0
    ok: bool = False


def _schedule(rng: random.Random, steps: int, faults: int, hosts: int) -> list[tuple[int, str, list[str]]]:
    """(after step, kind, hosts) for each fault, sorted by step; kinds: store, crash, trainer, group."""
    points = sorted(rng.sample(range(2, steps - 1), k=min(faults, steps - 3)))
    plan = []
    for step in points:
        kind = rng.choice(["store", "store", "crash", "trainer", "group"] if hosts >= 2 else ["trainer"])
        if kind == "group":
            g = rng.randrange(hosts // 2)
            victims = [f"h{2 * g}", f"h{2 * g + 1}"]
        else:
            victims = [f"h{rng.randrange(hosts)}"]
        plan.append((step, kind, victims))
    return plan


def run_chaos(seed: int = 0, hosts: int = 4, ranks: int | None = None, steps: int = 30, faults: int = 4,
              model_size: str = "tiny", timeout: float = 600.0, report_path: str | None = None) -> int:  # fmt: skip
    ranks = ranks or hosts
    if hosts < 2 or hosts % 2:
        print("memstore chaos needs an even --hosts >= 2 (groups of R=2)")
        return 2
    if steps < 6 or faults < 1:
        print("memstore chaos needs --steps >= 6 and --faults >= 1")
        return 2
    rng = random.Random(seed)
    plan = _schedule(rng, steps, faults, hosts)
    host_of = [f"h{r * hosts // ranks}" for r in range(ranks)]
    report = ChaosReport(seed=seed)
    print(f"memstore chaos: seed {seed}, {hosts} stores (R=2), {ranks} DDP ranks, {steps} steps, {len(plan)} faults")
    for step, kind, victims in plan:
        print(f"  planned: after step {step:>3} kill {kind:<7} {', '.join(victims)}")
    with tempfile.TemporaryDirectory(prefix="memstore-chaos-") as tmp:
        work = Path(tmp)
        spill = work / "durable"
        args = ["--spill", f"file://{spill}", "--spill-every-steps", "2", "--spill-keep-last", "3", "--repair-interval", "0.5"]
        try:
            with LocalCluster(hosts=hosts, replicas=2, capacity="1GiB", workdir=work / "cluster", extra_args=args) as cluster:
                stores = [cluster.address(h) for h in host_of]
                reference = Job(work, "reference", ranks, steps, model_size, None, resume=False)
                progress_until(reference, steps, steps, "reference", timeout)
                reference.wait(timeout)

                runs: list[Job] = []
                job = Job(work, "run0", ranks, steps, model_size, stores, resume=False)
                runs.append(job)
                for index, (at, kind, victims) in enumerate(plan):
                    progress_until(job, at, steps, f"run {index}  ", timeout)
                    if job.last_step() >= steps:
                        break
                    report.faults.append({"after_step": job.last_step(), "kind": kind, "hosts": victims})
                    if kind in ("store", "group", "crash"):
                        for h in victims:
                            cluster.kill(h, keep_memory=kind == "crash")
                    job.kill([r for r in range(ranks) if host_of[r] in victims] if kind == "trainer" else None)
                    job.kill()  # a lost rank stops the DDP job: the scheduler restarts all ranks
                    for h in victims:
                        if kind in ("store", "group", "crash"):
                            cluster.restart(h)
                    job = Job(work, f"run{index + 1}", ranks, steps, model_size, stores, resume=True)
                    runs.append(job)
                    t0 = time.monotonic()
                    progress_until(job, job.last_step() + 1, steps, f"resume {index}", timeout)
                    restored = _restore_events(job)
                    report.restarts.append({"resumed_from": restored.get("step"), "seconds": round(time.monotonic() - t0, 2)})
                progress_until(job, steps, steps, "final   ", timeout)
                job.wait(timeout)
                _check(report, reference, runs, host_of)
        except DemoFailure as exc:
            print(f"FAILED: {exc}")
            report.hangs += "within" in str(exc)
            report.ok = False
    _print(report)
    if report_path:
        Path(report_path).write_text(json.dumps(report.__dict__, indent=2, default=str))
    return 0 if report.ok else 1


def _restore_events(job: Job) -> dict[str, Any]:
    return next((e for e in job.events() if e.get("event") == "restored"), {})


def _tier(source: str, own_host: str) -> str:
    if not source:
        return "fresh start"
    return "durable" if source == "durable" else ("local RAM" if source == own_host else "peer RAM")


def _check(report: ChaosReport, reference: Job, runs: list[Job], host_of: list[str]) -> None:
    """Stitch the loss curve across restarts and compare curve and final weights with the reference."""
    ref = reference.results()
    ref_curve = {int(k): v for k, v in ref[0]["losses"].items()}
    curve: dict[int, float] = {}
    for run, restart in zip(runs, [None, *report.restarts], strict=False):
        events = run.events()
        restored = next((e for e in events if e.get("event") == "restored"), None)
        if restored is not None:
            # The steps after the resume point are trained again: what the killed run logged past it is replaced.
            curve = {s: v for s, v in curve.items() if s <= int(restored["step"])}
            if restart is not None:
                restart["rank0_tier"] = _tier(str(restored.get("source", "")), host_of[0])
        curve.update({e["step"]: e["loss"] for e in events if e.get("event") == "step"})
    final = runs[-1].results()
    for r in final:
        tier = _tier(str(r["restore"].get("source", "")), host_of[r["rank"]])
        report.tiers[tier] = report.tiers.get(tier, 0) + 1
    weights_equal = all(a["digest"] == b["digest"] for a, b in zip(final, ref, strict=True))
    report.mixed_restores = 0 if weights_equal and curve == ref_curve else 1
    report.ok = weights_equal and curve == ref_curve


def _print(report: ChaosReport) -> None:
    print()
    print(f"chaos report (seed {report.seed})")
    for f, r in zip(report.faults, report.restarts, strict=False):
        print(f"  after step {f['after_step']:>3}: killed {f['kind']:<7} {', '.join(f['hosts']):<8} -> resumed from step "
              f"{r['resumed_from']} in {r['seconds']:.1f} s (rank 0 from {r.get('rank0_tier', '?')})")  # fmt: skip
    print(f"  restore tiers of the last restart, all ranks: {report.tiers}")
    print(f"  faults injected {len(report.faults)}, steps lost 0, mixed restores {report.mixed_restores}, hangs {report.hangs}")
    print("OK: bit-identical to the fault-free run" if report.ok else "FAILED: the final state differs from the fault-free run")
