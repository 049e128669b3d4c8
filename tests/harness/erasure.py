"""Clients and saves of the erasure-coded tests: one rank per store (rank r on store h<r>), every save committed with
one copy (parity is no copy), and the shared memory a store holds counted as the bench counts it."""

from __future__ import annotations

from collections.abc import Iterable

from memstore.testing import LocalCluster, wait_for
from tests.harness.inprocess import InProcessCluster
from tests.states import rank_state
from trainer_client import CheckpointClient, Connection


def clients(cluster: LocalCluster, job: str, world: int, ranks: Iterable[int], via: str = "") -> list[CheckpointClient]:
    """A client of ``job`` for each of ``ranks``, through its own store (or ``via`` that one)."""
    return [CheckpointClient(job, r, world, connection=Connection(cluster.address(via or f"h{r}"), timeout=20.0)) for r in ranks]


def save_steps(cluster: LocalCluster, job: str, world: int, scale: int, steps: range) -> list[int]:
    """Save ``steps`` from every rank (``tests.states.rank_state`` at ``scale``), each waited for until committed and,
    on in-process stores, the next one saved once every store learnt it restorable (``learnt``); returns the shards'
    sizes."""
    cs = clients(cluster, job, world, range(world))
    sizes = []
    try:
        for step in steps:
            if step != steps[0] and isinstance(cluster, InProcessCluster):
                learnt(cluster, job, step - steps.step)
            handles = [c.save(step, rank_state(c.rank, step, scale=scale)) for c in cs]
            for h in handles:
                info = h.wait(timeout=30)
                assert (info.state, info.copies, info.error) == ("committed", 1, "")  # parity is no copy
                sizes.append(info.nbytes)
    finally:
        for c in cs:
            c.close()
    return sizes


def learnt(cluster: InProcessCluster, job: str, step: int) -> None:
    """Until every store's janitor learnt ``step`` of ``job`` restorable from every rank's settled copy: ranks without a
    process group (these tests' clients) let the next save take the oldest kept step's segment only then
    (``memstore.server.engine.recycling``), as a trainer's next save, a training step later, finds it learnt."""

    def known() -> bool:
        versions = [cluster.servers[h].store.eviction.restorable(job) for h in cluster.stores]
        return all(v is not None and v[0] >= step for v in versions)

    wait_for(known, timeout=10, interval=0.01, what=f"every store to learn step {step} of {job} restorable")


def shm_bytes(cluster: LocalCluster, host: str) -> int:
    """The shared memory ``host``'s store holds, counted as the bench counts it (``memstore.bench.rig.RamSampler``):
    every segment, in use (shards, parity fragments, leases) or kept for reuse (``pooled_bytes``, the reserve)."""
    h = cluster.health(host)
    assert h is not None
    return h.used_bytes
