"""Data-parallel restores after a restart in place and after a host loss, with and without a replica group.

    python benchmarks/data_parallel_host_loss.py [--size-mib 256]

A 4-host, R=2 local cluster on 127.0.0.1; 4 ranks (one per host, as threads of this process) hold the same state
(``memstore.bench.state.make_state``: 12 float32 tensors). For today's path and for ``replica_group=[0, 1, 2, 3]``:
the 4 ranks save at once (the time until every ``save()`` returned), then, a few seconds later (the stores assemble
the groups' stripes ahead meanwhile), 4 new clients restore at once, twice; then host h1 is SIGKILLed and replaced
(same id, empty RAM), and 4 new clients restore at once again (rank 1 through the replacement). Each line prints the
slowest rank and every rank's time, in seconds.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from memstore.bench.state import make_state
from memstore.testing import LocalCluster
from trainer_client import CheckpointClient, Connection

PATHS = (("no replica group", None), ("replica group", [0, 1, 2, 3]))


def clients(cluster: LocalCluster, job: str, group: list[int] | None) -> list[CheckpointClient]:
    return [CheckpointClient(job, r, 4, connection=Connection(cluster.address(f"h{r}")), run_id="x", replica_group=group)
            for r in range(4)]  # fmt: skip


def restore_all(cs: list[CheckpointClient]) -> list[float]:
    def one(c: CheckpointClient) -> float:
        t0 = time.perf_counter()
        c.load(1)
        return time.perf_counter() - t0

    with ThreadPoolExecutor(len(cs)) as pool:
        return list(pool.map(one, cs))


def show(what: str, times: list[float]) -> None:
    print(f"{what}: slowest {max(times):.3f} s; ranks {[round(t, 3) for t in times]}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mib", type=int, default=256)
    args = p.parse_args()
    state: Any = make_state(args.size_mib << 20, 0)
    with LocalCluster(hosts=4, replicas=2, capacity=f"{args.size_mib * 12}MiB", workdir=Path(tempfile.mkdtemp())) as cluster:
        for name, group in PATHS:
            savers = clients(cluster, name.replace(" ", "-"), group)
            with ThreadPoolExecutor(4) as pool:
                t0 = time.perf_counter()
                handles = list(pool.map(lambda c: c.save(1, state), savers))
                print(f"{name}: 4 saves returned after {time.perf_counter() - t0:.3f} s", flush=True)
            for h in handles:
                h.wait(120)
            for c in savers:
                c.close()
            time.sleep(3)  # a restart comes later than this
            for _ in range(2):
                restarted = clients(cluster, name.replace(" ", "-"), group)
                show(f"{name}: restart in place, 4 restores at once", restore_all(restarted))
                for c in restarted:
                    c.close()
        cluster.kill("h1")
        cluster.restart("h1")
        for name, group in PATHS:
            restarted = clients(cluster, name.replace(" ", "-"), group)
            show(f"{name}: after the loss of h1, 4 restores at once", restore_all(restarted))
            for c in restarted:
                c.close()


if __name__ == "__main__":
    main()
