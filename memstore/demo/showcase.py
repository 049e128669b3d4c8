"""``memstore demo``: a real DDP training job survives the loss of a host, bit for bit.

1. Starts a local cluster (default 4 stores, R=2) on 127.0.0.1.
2. Trains a tiny transformer language model with DDP over gloo, one rank per host, once without
   any fault: the reference.
3. Trains the same job again, checkpointing every step into memstore. Mid-run it SIGKILLs one host:
   its store and its trainer rank. Like a cluster scheduler, it then restarts the job: a replacement
   store comes up for the lost host (same id and address, empty RAM) and every rank restarts,
   restores the newest step restorable for all ranks (the lost host's rank through the replacement,
   from peer RAM) and trains to the end.
4. Checks that the loss curve and the final weights of every rank are bit-identical to the
   reference, reads how many times the stores hold the job's state from ``memstore status --json``,
   prints a summary, and exits non-zero if not.

With ``redundancy="ec:K+M"`` (``memstore demo --redundancy ec:4+1``) the stores erasure-code instead of copying: one
group of K+M stores (the demo's default hosts), each rank's shard kept whole on its own store plus the group's parity;
the lost host's rank restores a shard rebuilt from the survivors, and the demo checks that every step in RAM has its
parity complete.

With ``replica_group=True`` (``memstore demo --replica-group``) the ranks save as one data-parallel replica
group (``CheckpointClient(replica_group=dist.group.WORLD)``): each captures about 1/ranks of the state, the
stores hold it R times instead of ranks x R, and the demo checks both figures too. ``report`` writes the
summary as JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from memstore.children import child_env, forkserver, start_forked
from memstore.core.redundancy import Redundancy
from memstore.demo import worker
from memstore.errors import DemoFailure
from memstore.testing import LocalCluster, free_ports

#: What the trainer ranks' forkserver imports once (each rank then forks from it: no import of torch per rank and launch).
#: ``torch._dynamo``: torch imports it when a process makes its first optimizer (1.5-2.5 s of a core per rank otherwise).
WORKER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "trainer_client", "memstore.demo.worker"]


def _say(msg: str) -> None:
    print(msg, flush=True)


class Job:
    """The trainer processes of one launch of the job."""

    def __init__(self, workdir: Path, name: str, ranks: int, steps: int, model_size: str, stores: list[str] | None, resume: bool,
                 replica_group: bool = False) -> None:  # fmt: skip
        self.workdir = workdir / name
        self.workdir.mkdir(parents=True)
        self.progress = self.workdir / "progress.jsonl"
        self.progress.touch()
        (port,) = free_ports(1)
        self.procs: list[BaseProcess] = []
        ctx = forkserver(WORKER_PRELOAD)
        for r in range(ranks):
            args = ["--rank", str(r), "--world", str(ranks), "--master-port", str(port), "--steps", str(steps),
                    "--model-size", model_size, "--progress", str(self.progress), "--out", str(self.workdir / f"rank{r}.json")]  # fmt: skip
            if stores is not None:
                args += ["--store", stores[r]]
            if resume:
                args.append("--resume")
            if replica_group:
                args.append("--replica-group")
            self.procs.append(start_forked(ctx, worker.main, args, self.workdir / f"rank{r}.log", {"OMP_NUM_THREADS": "1"}, f"rank{r}"))

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.progress.read_text().splitlines() if line.strip()]

    def last_step(self) -> int:
        return max((e["step"] for e in self.events() if e.get("event") == "step"), default=0)

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for r, p in enumerate(self.procs):
            p.join(timeout=max(1.0, deadline - time.monotonic()))
            if p.exitcode is None:
                self.kill()
                raise DemoFailure(f"rank {r} did not finish within {timeout:.0f}s; log: {self.workdir / f'rank{r}.log'}")
            if p.exitcode != 0:
                self.kill()
                tail = (self.workdir / f"rank{r}.log").read_text(errors="replace")[-2000:]
                raise DemoFailure(f"rank {r} exited with {p.exitcode}:\n{tail}")

    def check_alive(self) -> None:
        for r, p in enumerate(self.procs):
            if p.exitcode not in (None, 0):
                tail = (self.workdir / f"rank{r}.log").read_text(errors="replace")[-2000:]
                self.kill()
                raise DemoFailure(f"rank {r} exited with {p.exitcode}:\n{tail}")

    def kill(self, ranks: list[int] | None = None) -> None:
        for r, p in enumerate(self.procs):
            if (ranks is None or r in ranks) and p.exitcode is None:
                p.kill()
                p.join(timeout=10)

    def results(self) -> list[dict[str, Any]]:
        return [json.loads((self.workdir / f"rank{r}.json").read_text()) for r in range(len(self.procs))]


def progress_until(job: Job, target: int, total: int, label: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    shown = 0
    tty = sys.stdout.isatty()
    while True:
        job.check_alive()
        step = job.last_step()
        if step > shown and (tty or step >= target or step // 10 > shown // 10):
            shown = step
            bar = "#" * int(30 * step / total)
            print(f"\r  {label} step {step:>4}/{total} [{bar:<30}]", end="" if tty else "\n", flush=True)
        if step >= target or all(p.exitcode is not None for p in job.procs):
            if tty:
                print(flush=True)
            return
        if time.monotonic() > deadline:
            job.kill()
            raise DemoFailure(f"{label}: no progress to step {target} within {timeout:.0f}s")
        time.sleep(0.1)


def run_demo(hosts: int | None = None, replicas: int = 2, ranks: int | None = None, steps: int = 40, kill_at: int = 20,
             model_size: str = "small", timeout: float = 600.0, replica_group: bool = False, report: str | None = None,
             redundancy: str | None = None) -> int:  # fmt: skip
    """``redundancy`` (replicas:R or ec:K+M), when given, is the stores' scheme instead of ``replicas``; ``hosts`` None:
    4, or one group of an ec:K+M scheme (K+M) if that is more."""
    try:
        scheme = Redundancy.parse(redundancy) if redundancy is not None else Redundancy.of_replicas(replicas)
    except ValueError as exc:
        _say(f"--{exc}")
        return 2
    hosts = hosts if hosts is not None else max(4, scheme.group_size)
    ranks = ranks or hosts
    if hosts < 2:
        _say("memstore demo needs --hosts >= 2 (one host is killed)")
        return 2
    replicas = scheme.replicas
    if not 1 <= scheme.group_size <= hosts:
        _say(f"--redundancy {scheme} needs {scheme.group_size} hosts, within 1..--hosts ({hosts})")
        return 2
    if ranks < 1:
        _say("--ranks must be >= 1")
        return 2
    if not 1 <= kill_at < steps:
        _say(f"--kill-at {kill_at} must be within 1..--steps-1 ({steps - 1})")
        return 2
    host_of = [f"h{r * hosts // ranks}" for r in range(ranks)]
    victim = host_of[-1] if ranks > 1 else "h1"
    victim_ranks = [r for r in range(ranks) if host_of[r] == victim]
    started = time.monotonic()
    _say(f"memstore demo: {hosts} stores on 127.0.0.1 ({scheme}), {ranks} DDP ranks (gloo), {model_size} transformer LM, {steps} steps")
    if replica_group:
        _say(f"  the {ranks} ranks save as one replica group (replica_group=WORLD): each stores 1/{ranks} of the state")
    with tempfile.TemporaryDirectory(prefix="memstore-demo-") as tmp:
        work = Path(tmp)
        try:
            with LocalCluster(hosts=hosts, redundancy=str(scheme), capacity="1GiB", workdir=work / "cluster") as cluster:
                stores = [cluster.address(h) for h in host_of]

                _say("[1/3] reference run, no faults")
                reference = Job(work, "reference", ranks, steps, model_size, None, resume=False)
                progress_until(reference, steps, steps, "reference", timeout)
                reference.wait(timeout)

                _say(f"[2/3] checkpointed run: every step saved to memstore; SIGKILL of host {victim} after step {kill_at}")
                first = Job(work, "run", ranks, steps, model_size, stores, resume=False, replica_group=replica_group)
                progress_until(first, kill_at, steps, "training ", timeout)
                killed_at = first.last_step()
                t_kill = time.monotonic()
                cluster.kill(victim)
                first.kill(victim_ranks)
                first.kill()  # the other ranks lost their DDP peer: the scheduler restarts the whole job
                _say(f"  host {victim} (store + rank {victim_ranks}) SIGKILLed at step {killed_at}; job restarted by the scheduler")

                _say(f"[3/3] replacement store for {victim} (empty RAM); every rank restores and trains on")
                cluster.restart(victim)
                resumed = Job(work, "resumed", ranks, steps, model_size, stores, resume=True, replica_group=replica_group)
                progress_until(resumed, steps, steps, "resumed  ", timeout)
                resumed.wait(timeout)
                recovery = time.monotonic() - t_kill
                summary = _compare(reference, first, resumed, victim_ranks)
                summary.update(host_of=host_of, replicas=replicas, replica_group=replica_group, redundancy=str(scheme))
                summary.update(_footprint(cluster.address("h0"), resumed, scheme, cluster.keep, replica_group))
                summary["ok"] = summary["ok"] and summary["footprint_ok"]
                baseline = _torch_baseline_of(cluster.address("h0"), ranks, steps, replica_group)
        except DemoFailure as exc:
            _say(f"FAILED: {exc}")
            return 1
    total = time.monotonic() - started
    _print_summary(summary, baseline, recovery, total, victim)
    if report:
        facts = {**summary, "baseline": baseline, "recovery_seconds": recovery, "total_seconds": total}
        Path(report).write_text(json.dumps(facts, indent=2))
    return 0 if summary["ok"] else 1


def _compare(reference: Job, first: Job, resumed: Job, victim_ranks: list[int]) -> dict[str, Any]:
    ref = reference.results()
    res = resumed.results()
    run_events = [e for e in first.events() if e.get("event") == "step"]
    restored = res[0]["restore"]
    resumed_from = int(restored["step"])
    curve = {e["step"]: e["loss"] for e in run_events if e["step"] <= resumed_from}
    curve.update({int(k): v for k, v in res[0]["losses"].items()})
    ref_curve = {int(k): v for k, v in ref[0]["losses"].items()}
    mismatched_weights = [r["rank"] for r, q in zip(res, ref, strict=True) if r["digest"] != q["digest"]]
    stalls = [s for e in run_events if (s := e.get("stall")) is not None] + [s for r in res for s in r["stalls"]]
    return {
        "ok": curve == ref_curve and not mismatched_weights,
        "curve_equal": curve == ref_curve,
        "mismatched_weights": mismatched_weights,
        "resumed_from": resumed_from,
        "restore": {r["rank"]: r["restore"] for r in res},
        "victim_ranks": victim_ranks,
        "stall_p50": statistics.median(stalls) if stalls else 0.0,
        "commit": statistics.median([r["last_commit_seconds"] for r in res]),
        "model_bytes": res[0]["model_bytes"],
        "final_loss": ref_curve[max(ref_curve)],
        "first_loss": ref_curve[min(ref_curve)],
    }


def _job_in_status(store: str, job: str) -> dict[str, Any] | None:
    """``job``'s row of ``memstore status --json`` asked through ``store`` (None if the job is not listed)."""
    proc = subprocess.run([sys.executable, "-m", "memstore", "status", "--json", "--store", store],
                          capture_output=True, text=True, timeout=60, env={**os.environ, **child_env()})  # fmt: skip
    try:
        jobs = json.loads(proc.stdout)["jobs"]
    except (ValueError, KeyError, TypeError):
        raise DemoFailure(f"memstore status --json gave no jobs (exit {proc.returncode}): {proc.stderr[-2000:]}") from None
    return next((j for j in jobs if j["job"] == job), None)


def _footprint(store: str, resumed: Job, scheme: Redundancy, keep: int, replica_group: bool, timeout: float = 60.0) -> dict[str, Any]:
    """How many times the stores hold one rank's training state, from ``memstore status --json`` once retention has
    settled (at most ``keep`` steps in RAM, all committed: the job has finished), and the share of it each rank saved
    per step. With ``replica_group`` both must match a replica group of all ranks: R and 1/ranks. Under ec:K+M every
    step in RAM must have its parity complete (``parity_complete``); the parity is no copy (one copy of each rank)."""
    res = resumed.results()
    ranks = len(res)
    state = res[0]["state_nbytes"]
    replicas = scheme.replicas
    deadline = time.monotonic() + timeout
    while True:  # retention evicts the steps before the newest ``keep`` just after they settle
        row = _job_in_status(store, "demo")
        settled = row is not None and 1 <= row["steps_in_ram"] <= keep and (not scheme.erasure_coded or row["parity_complete"])
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if row is None or not row["steps_in_ram"]:
        raise DemoFailure("memstore status --json lists no step of the job in RAM")
    multiple = (row["copies_bytes"] - row["cached_bytes"]) / row["steps_in_ram"] / state  # copies pulled ahead are spare room
    group = ranks if replica_group else 1
    expected = replicas * ranks / group
    shares = [statistics.median(r["saved_nbytes"]) / state for r in res]
    ok = not replica_group or (
        0.95 * expected <= multiple <= 1.15 * expected and all(0.8 / group <= f <= 1.2 / group for f in shares)  # stripe framing
    )
    parity = row["parity_complete"]  # None under replicas
    ok = ok and parity is not False
    return {"ram_bytes": row["ram_bytes"], "copies_bytes": row["copies_bytes"], "cached_bytes": row["cached_bytes"],
            "steps_in_ram": row["steps_in_ram"], "held_multiple": row["ram_multiple"],
            "state_nbytes": state, "ram_multiple": multiple,
            "expected_ram_multiple": expected, "saved_share": shares, "expected_saved_share": 1 / group, "parity_complete": parity,
            "footprint_ok": ok}  # fmt: skip


def _torch_baseline_of(store: str, ranks: int, step: int, replica_group: bool) -> dict[str, float]:
    """Rank 0's final training state saved and loaded by memstore and by torch.save/torch.load, idle machine."""
    import torch

    from trainer_client import CheckpointClient, Connection

    group = list(range(ranks)) if replica_group else None  # then rank 0 saves its stripe, as in training
    with CheckpointClient("demo", 0, ranks, connection=Connection(store), replica_group=group) as client:
        state = client.load(step, zero_copy=False)
        replicated = [k for k in state if k != "rng"] if replica_group else None
        timings = []
        for extra in range(1, 4):  # the same save as in training, now without 2x{ranks} processes competing for 2 cores
            handle = client.save(step + extra, state, replicated=replicated)
            timings.append(handle.stall_seconds)
            handle.wait(timeout=60)
        t0 = time.perf_counter()
        client.load(step)
        memstore_load = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(
        prefix="memstore-demo-disk-", dir=os.path.expanduser("~") if os.access(os.path.expanduser("~"), os.W_OK) else None
    ) as d:
        path = Path(d) / "state.pt"
        t0 = time.perf_counter()
        with open(path, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        save = time.perf_counter() - t0
        t0 = time.perf_counter()
        torch.load(path, weights_only=False)  # our own file, just written to a private temp dir: the baseline users run
        load = time.perf_counter() - t0
    return {"torch_save_fsync": save, "torch_load": load, "memstore_local_load": memstore_load, "memstore_save_idle": min(timings)}


def _print_summary(s: dict[str, Any], baseline: dict[str, float], recovery: float, total: float, victim: str) -> None:
    ms = 1e3
    _say("")
    _say("summary")
    weights = s["model_bytes"] / 2**20
    _say(f"  loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}; training state per rank {weights:.1f} MiB of weights (+ AdamW)")
    _say(f"  stall per save during training (p50): {s['stall_p50'] * ms:8.2f} ms")
    stripe = " of rank 0's stripe" if s["replica_group"] else ""
    _say(
        f"  same state, idle machine: memstore save{stripe} {baseline['memstore_save_idle'] * ms:.2f} ms vs torch.save + fsync "
        f"{baseline['torch_save_fsync'] * ms:.2f} ms (local disk, 1 copy; memstore: {_protection(s)} in RAM)"
    )
    shares = " ".join(f"{f:.3f}" for f in s["saved_share"])
    _say(f"  saved per step and rank, share of a rank's state ({s['state_nbytes'] / 2**20:.2f} MiB): {shares} "
         f"(expected {s['expected_saved_share']:.3f})")  # fmt: skip
    _say(f"  stores hold the state {s['ram_multiple']:.2f} times (expected {s['expected_ram_multiple']:.0f}: "
         f"{_copies_formula(s)}); memstore status: {s['copies_bytes'] / 2**20:.1f} MiB of copies for {s['steps_in_ram']} steps in "
         f"RAM, {s['ram_bytes'] / 2**20:.1f} MiB held with the rings' spares ({s['held_multiple']}x the state)"
         + (f", of which {s['cached_bytes'] / 2**20:.1f} MiB cached ahead of restores" if s["cached_bytes"] else ""))  # fmt: skip
    if s["parity_complete"] is not None:
        _say(f"  {s['redundancy']} parity complete for every step in RAM: {'yes' if s['parity_complete'] else 'NO'}")
    _say(f"  time to committed ({_protection(s)}):  {s['commit'] * ms:8.2f} ms")
    _say(f"  resumed from step {s['resumed_from']}; recovery (kill -> job finished again) {recovery:.1f} s")
    for rank, r in sorted(s["restore"].items(), key=lambda kv: int(kv[0])):
        own = s["host_of"][int(rank)]
        tier = "local RAM" if r["source"] == own else f"peer RAM of {r['source']}"
        if r["source"] == "rebuild":  # ec:K+M: no store held a copy
            tier = f"a shard rebuilt from the {s['redundancy']} group's survivors (their shards and parity)"
        if s["replica_group"]:  # its own stripe came from there, the group's others through its store
            tier = f"{len(s['saved_share'])} stripes, its own from {tier}"
        note = f" (rank of the lost host, through the replacement {own})" if int(rank) in s["victim_ranks"] else ""
        _say(f"  rank {rank}: restored in {r['seconds'] * ms:7.1f} ms from {tier}{note}")
    source = f"{len(s['saved_share'])} stripes" if s["replica_group"] else "local RAM"
    _say(
        f"  same state, idle machine: memstore load ({source}) {baseline['memstore_local_load'] * ms:.2f} ms vs torch.load "
        f"{baseline['torch_load'] * ms:.2f} ms"
    )
    _say(f"  total demo time {total:.0f} s")
    if s["ok"]:
        _say(f"OK: loss curve and final weights of every rank are bit-identical to the uninterrupted run, after losing host {victim}")
    if not s["footprint_ok"]:
        if s["parity_complete"] is False:
            _say(f"FAILED: under {s['redundancy']} every step in RAM must have its parity complete once the job has finished")
        else:
            _say(f"FAILED: with a replica group the stores must hold the state ~{s['expected_ram_multiple']:.0f} times and each "
                 f"rank save ~{s['expected_saved_share']:.3f} of it")  # fmt: skip
    if not s["curve_equal"] or s["mismatched_weights"]:
        _say(f"FAILED: loss curve equal: {s['curve_equal']}; ranks with different final weights: {s['mismatched_weights']}")


def _protection(s: dict[str, Any]) -> str:
    """How the stores protect a step: "2 copies", or "1 copy + ec:4+1 parity"."""
    if s["redundancy"].startswith("ec:"):
        return f"1 copy + {s['redundancy']} parity"
    return f"{s['replicas']} copies"


def _copies_formula(s: dict[str, Any]) -> str:
    ranks = len(s["saved_share"])
    if s["redundancy"].startswith("ec:"):
        return f"{ranks} ranks x 1 copy; the {s['redundancy']} parity is no copy, held in RAM beside them"
    if s["replica_group"]:
        return f"R={s['replicas']} copies of the one state the {ranks} ranks share"
    return f"{ranks} ranks x R={s['replicas']} copies"
