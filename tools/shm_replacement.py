"""Stranded shared memory and needless repair across store replacements on one machine (docs/operations.md).

A LocalCluster of two stores (R=2) follows a peers file; every store uses the same --shm-dir, as the stores of
one Kubernetes node or Ray node do. A trainer saves ``steps`` steps through the first store. Then, ``replacements``
times: the store of slot 0 is SIGKILLed (its segments stay in shared memory) and a new store with a *new host id*
takes over its slot (a replaced pod: new pod IP, same node). Each time, once the new store is ready, this counts:
the shards it adopted, the repair pulls it made (its ``memstore_repair_seconds`` count, every source), the bytes it
pulled, the bytes of dead segment directories left under --shm-dir (stranded), and whether it serves every step
exactly from its own RAM (``--lose-memory``: the baseline where the SIGKILL also loses the shared memory, so
the new store must pull everything). Last, a store that nobody replaces is SIGKILLed and its directory is timed until the
survivor reclaims it (``--shm-reclaim-after``).

    python -m tools.shm_replacement --replacements 10
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from typing import Any

import torch

from memstore.server.memory.shm_dirs import orphaned_dirs
from memstore.testing import LocalCluster, wait_for

JOB = "shm-replacement"


def state(step: int, mib: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((int(mib * (1 << 18)),), float(step))}  # mib MiB of fp32


def scrape(cluster: LocalCluster, host: str, name: str) -> float:
    """The sum of the samples of metric ``name`` (every label) the store of ``host`` serves (Prometheus text)."""
    with urllib.request.urlopen(cluster.metrics_url(host), timeout=5) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.partition("{")[0].partition(" ")[0] == name)


def stranded_bytes(cluster: LocalCluster) -> int:
    return sum(o.bytes for o in orphaned_dirs(cluster.shm_dir))


def wait_ready(cluster: LocalCluster, host: str, timeout: float = 60.0) -> None:
    """Until ``host`` holds a slot and a repair pass found every shard of it here (readiness)."""

    def ready() -> bool:
        h = cluster.health(host)
        return h is not None and h.serving and not h.not_ready

    wait_for(ready, timeout, what=f"{host} ready")


def replace_once(cluster: LocalCluster, old: str, new: str, steps: int, mib: float, lose_memory: bool = False) -> dict[str, Any]:
    """SIGKILL ``old`` (its segments stay, unless ``lose_memory``: the baseline, nothing to adopt), start ``new`` in
    its place, and measure (see the module's docstring)."""
    from trainer_client import CheckpointClient, Connection

    left = stranded_bytes(cluster) if cluster.stores[old].alive else 0
    cluster.kill(old, keep_memory=not lose_memory)
    dead = stranded_bytes(cluster) - left  # what the SIGKILL stranded
    t0 = time.monotonic()
    cluster.add_host(new, replacing=old)
    wait_ready(cluster, new)
    ready_s = time.monotonic() - t0
    exact = True
    local = True
    with CheckpointClient(JOB, 0, 1, connection=Connection(address=cluster.address(new))) as c:
        for step in range(1, steps + 1):
            exact &= bool(torch.equal(c.load(step)["w"], state(step, mib)["w"]))
            local &= c.stats().last_load_source == new
    health = cluster.health(new)  # after the loads: a repair that made the store ready has been counted by now
    assert health is not None
    return {
        "replaced": old,
        "by": new,
        "stranded_by_sigkill_bytes": dead,
        "adopted_shards": health.adopted_shards,
        "repair_pulls": int(scrape(cluster, new, "memstore_repair_seconds_count")),
        "pulled_bytes": int(scrape(cluster, new, "memstore_pulled_bytes_total")),
        "stranded_after_bytes": stranded_bytes(cluster),
        "ready_s": round(ready_s, 2),
        "exact": exact,
        "served_locally": local,
    }


def time_reclaim(cluster: LocalCluster, victim: str, grace: float) -> dict[str, Any]:
    """SIGKILL ``victim`` with nobody to replace it; how long until its directory is reclaimed."""
    cluster.remove_host(victim)
    cluster.kill(victim, keep_memory=True)
    dead = stranded_bytes(cluster)
    t0 = time.monotonic()
    wait_for(lambda: stranded_bytes(cluster) == 0, timeout=grace * 4 + 30, what="the dead directory reclaimed")
    return {"stranded_by_sigkill_bytes": dead, "grace_s": grace, "reclaimed_after_s": round(time.monotonic() - t0, 2)}


def run(replacements: int = 10, steps: int = 2, mib: float = 1.0, grace: float = 2.0, lose_memory: bool = False) -> dict[str, Any]:
    cluster = LocalCluster(
        hosts=2, replicas=2, capacity="256MiB", keep=steps, discovery="file", metrics=True,
        extra_args=["--shm-reclaim-after", str(grace), "--repair-interval", "0.3"],
    )  # fmt: skip
    from trainer_client import CheckpointClient, Connection

    with cluster:
        with CheckpointClient(JOB, 0, 1, connection=Connection(address=cluster.address("h0"))) as c:
            for step in range(1, steps + 1):
                c.save(step, state(step, mib)).wait(timeout=60)
        rounds = []
        current = "h0"
        for i in range(1, replacements + 1):
            new = f"h0r{i}"
            rounds.append(replace_once(cluster, current, new, steps, mib, lose_memory))
            current = new
        cluster.add_host("h9")  # a third store that saves a step, then is killed with nobody to replace it
        wait_ready(cluster, "h9")
        with CheckpointClient(f"{JOB}-spare", 0, 1, connection=Connection(address=cluster.address("h9"))) as c:
            c.save(1, state(1, mib)).wait(timeout=60)
        reclaim = time_reclaim(cluster, "h9", grace)
    return {
        "replacements": replacements,
        "shards_per_store": steps,
        "mib_per_shard": mib,
        "rounds": rounds,
        "total_stranded_after_bytes": sum(r["stranded_after_bytes"] for r in rounds),
        "total_repair_pulls": sum(r["repair_pulls"] for r in rounds),
        "unreplaced": reclaim,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replacements", type=int, default=10)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--mib", type=float, default=1.0, help="MiB per shard")
    p.add_argument("--grace", type=float, default=2.0, help="--shm-reclaim-after of every store, seconds")
    p.add_argument("--lose-memory", action="store_true", help="baseline: each SIGKILL also wipes the store's shared memory")
    args = p.parse_args()
    print(json.dumps(run(args.replacements, args.steps, args.mib, args.grace, args.lose_memory), indent=2))


if __name__ == "__main__":
    main()
