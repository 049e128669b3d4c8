"""``memstore demo``: save, kill a host, restore from survivors, verify bit-exactness.

Runs on an embedded local cluster (real store processes on 127.0.0.1). Ranks are simulated by
clients in this process, spread evenly over the hosts; each saves a model-and-optimizer-like state
every step. After step ``kill_at`` the demo SIGKILLs one store, checks that every rank still restores
the latest step bit-exactly (from local RAM or a peer), starts the replacement store, and checks that
it serves its ranks again. Exit status is non-zero if any check fails.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from memstore.local_cluster import LocalCluster, wait_for


def _state(rank: int, step: int, size_mib: float) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(rank * 7919 + step)
    n = max(1, int(size_mib * (1 << 20) / 4 / 3))
    return {
        "model": {"weight": torch.randn(n, generator=g), "bias": torch.randn(16, generator=g).to(torch.bfloat16)},
        "optim": {"state": {0: {"exp_avg": torch.randn(n, generator=g), "exp_avg_sq": torch.rand(n, generator=g)}}, "lr": 1e-3},
        "step": step,
        "rng": torch.get_rng_state(),
    }


def _equal(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return bool(a == b)


def run_demo(hosts: int = 4, replicas: int = 2, ranks: int = 8, steps: int = 3, kill_at: int = 3, size_mib: float = 4.0) -> int:
    from trainer_client import CheckpointClient

    if not 1 <= kill_at <= steps:
        print(f"--kill-at {kill_at} must be within 1..--steps ({steps})")
        return 2
    if ranks < hosts:
        print(f"--ranks {ranks} must be >= --hosts {hosts}")
        return 2
    per_host = -(-ranks // hosts)
    host_of = {r: f"h{r // per_host}" for r in range(ranks)}
    capacity = f"{int(size_mib * per_host * replicas * 4 + 64)}MiB"
    job = "demo"
    victim = "h1" if hosts > 1 else "h0"
    failures: list[str] = []
    print(f"memstore demo: {hosts} stores on 127.0.0.1, R={replicas}, {ranks} ranks, {size_mib:g} MiB state per rank")
    with LocalCluster(hosts=hosts, replicas=replicas, capacity=capacity) as cluster:
        clients = {r: CheckpointClient(job, r, ranks, store=cluster.address(host_of[r])) for r in range(ranks)}
        stalls: list[float] = []
        commits: list[float] = []
        for step in range(1, kill_at + 1):
            t0 = time.perf_counter()
            handles = [(r, clients[r].save(step, _state(r, step, size_mib))) for r in range(ranks)]
            stalls += [h.stall_seconds for _, h in handles]
            for _, h in handles:
                h.wait(timeout=60)
            commits.append(time.perf_counter() - t0)
            print(f"  step {step}: {ranks} shards saved and committed with {replicas} copies ({commits[-1] * 1e3:.0f} ms)")
        for c in clients.values():
            c.close()

        print(f"  SIGKILL store {victim} (ranks {[r for r in range(ranks) if host_of[r] == victim]})")
        cluster.kill(victim)
        survivors = [r for r in range(ranks) if host_of[r] != victim]
        t0 = time.perf_counter()
        restored: dict[int, str] = {}
        for r in survivors:
            with CheckpointClient(job, r, ranks, store=cluster.address(host_of[r])) as c:
                latest = c.latest_step()
                if latest != kill_at:
                    failures.append(f"rank {r}: latest_step() = {latest}, expected {kill_at}")
                    continue
                if not _equal(c.load(latest), _state(r, latest, size_mib)):
                    failures.append(f"rank {r}: restored state differs from what was saved")
                restored[r] = c.last_load_source
        survivor_restore = time.perf_counter() - t0

        cluster.restart(victim)
        t0 = time.perf_counter()
        for r in (r for r in range(ranks) if host_of[r] == victim):
            with CheckpointClient(job, r, ranks, store=cluster.address(victim)) as c:
                if not _equal(c.load(kill_at), _state(r, kill_at, size_mib)):
                    failures.append(f"rank {r}: state restored through the replacement store differs")
                restored[r] = c.last_load_source
        replacement_restore = time.perf_counter() - t0
        try:
            wait_for(lambda: (cluster.health(victim) or _NoHealth).shards >= per_host * replicas, timeout=30, what="repair")
            print(f"  replacement {victim} repaired: back to {replicas} copies of its group's shards")
        except TimeoutError as exc:
            failures.append(str(exc))

    print()
    print(f"  save stall per rank:     p50 {statistics.median(stalls) * 1e3:.1f} ms (max {max(stalls) * 1e3:.1f} ms)")
    print(f"  step committed (all {ranks} ranks, {replicas} copies): p50 {statistics.median(commits) * 1e3:.0f} ms")
    print(
        f"  restore of {len(survivors)} surviving ranks: {survivor_restore * 1e3:.0f} ms; "
        f"{len(restored) - len(survivors)} ranks through the replacement: {replacement_restore * 1e3:.0f} ms"
    )
    print(f"  restore sources: {dict(sorted(restored.items()))}")
    if failures:
        print("FAILED:")
        for f in failures:
            print(f"  - {f}")
        return 1
    print(f"OK: every rank restored step {kill_at} bit-exactly after losing store {victim}")
    return 0


class _NoHealth:
    shards = -1
