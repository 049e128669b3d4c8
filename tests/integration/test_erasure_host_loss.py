"""Erasure coding (``--redundancy ec:4+1``) across a real process boundary: five store processes, one rank per store.

``tests/integration/test_erasure.py`` runs the same scheme on in-process stores; here a store is SIGKILLed (its process
and its shared memory gone, as a lost host) and a replacement process starts empty: every rank, agreeing over one gloo
group, restores the newest committed step bit-exactly, the lost host's rank from a shard rebuilt from the four survivors.
"""

from __future__ import annotations

from typing import Any

import pytest

from memstore.testing import LocalCluster
from tests.states import assert_same, rank_state
from tools.thread_ranks import on_every_rank
from trainer_client import CheckpointClient, Connection

pytestmark = pytest.mark.integration

JOB = "ec-kill-job"
WORLD = 5  # ec:4+1: one group of five stores, rank r on store h<r>
STEPS = range(1, 4)
SCALE = 100  # about 1.6 MB a rank: two blocks, in two of its data rows


def client(cluster: LocalCluster, rank: int) -> CheckpointClient:
    return CheckpointClient(JOB, rank, WORLD, connection=Connection(cluster.address(f"h{rank}"), timeout=20.0))


def save_committed(cluster: LocalCluster) -> None:
    cs = [client(cluster, r) for r in range(WORLD)]
    try:
        for step in STEPS:
            handles = [c.save(step, rank_state(c.rank, step, scale=SCALE)) for c in cs]
            for h in handles:
                info = h.wait(timeout=30)
                assert (info.state, info.copies) == ("committed", 1)  # committed: the parity covers every rank
    finally:
        for c in cs:
            c.close()


def restore(cluster: LocalCluster, rank: int, group: Any) -> tuple[int | None, str]:
    """Rank ``rank``'s restore as a restarted job does it: the step agreed over ``group``, then its load (checked)."""
    with client(cluster, rank) as c:
        step = c.latest_step(group=group)
        assert step is not None
        assert_same(c.load(step, group=group), rank_state(rank, step, scale=SCALE))
        return step, c.stats().last_load_source


def test_every_rank_restores_after_a_store_is_sigkilled_and_replaced(make_cluster) -> None:
    victim = "h2"  # about 14 s on 2 cores: one victim in the default suite (the recovery matrix's ec rows lose h0)
    cluster = make_cluster(hosts=WORLD, redundancy="ec:4+1", capacity="256MiB", keep=2)
    save_committed(cluster)

    cluster.kill(victim)  # SIGKILL: the process and its shared memory are gone
    cluster.restart(victim)  # its replacement: same id and address, empty RAM
    results, _ = on_every_rank(WORLD, lambda rank, group: restore(cluster, rank, group), timeout=120)

    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    assert [step for step, _ in results] == [STEPS[-1]] * WORLD  # the newest committed step, on every rank
    lost = int(victim[1:])
    # The lost host's rank was rebuilt from the survivors' shards and parity; every other rank read its own store's RAM.
    assert [source for _, source in results] == ["rebuild" if r == lost else f"h{r}" for r in range(WORLD)]
