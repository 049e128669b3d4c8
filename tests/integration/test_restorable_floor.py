"""The restorable floor: with CheckpointClient(group=...), retention evicts without listing the cluster.

Ranks are threads of this process, each with its own client and gloo group member (``tools.thread_ranks``):
the same all-reduce as ranks in separate processes. The stores run in this process, so the test reads each store's
retention counters directly.
"""

from __future__ import annotations

from typing import Any

import pytest

from memstore.testing import wait_for
from tests.states import assert_same, rank_state
from tools.thread_ranks import on_every_rank
from trainer_client import CheckpointClient, Connection
from trainer_client.errors import InvalidArgumentError

pytestmark = pytest.mark.integration

HOSTS, R, KEEP, STEPS = 3, 2, 2, 6


def _held_steps(cluster: Any, job: str) -> dict[str, list[int]]:
    return {h: sorted({k.step for k, _, _ in s.store.catalog.held(job)}) for h, s in cluster.servers.items()}


def _save_every_step(cluster: Any, job: str, group_given: bool) -> None:
    def rank(r: int, g: Any) -> int | None:
        connection = Connection(cluster.address(f"h{r}"), timeout=20)
        client = CheckpointClient(job, r, HOSTS, connection=connection, run_id=f"{job}-run", group=g if group_given else None)
        try:
            for step in range(1, STEPS + 1):
                client.save(step, rank_state(r, step)).wait(timeout=30)
            return client._floor.collectives if client._floor else None
        finally:
            client.close()

    results, _ = on_every_rank(HOSTS, rank, timeout=120)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    assert results == ([STEPS] * HOSTS if group_given else [None] * HOSTS)  # one all-reduce per save


def test_retention_with_the_ranks_floor_lists_nobody_and_keeps_the_newest(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=HOSTS, replicas=R, capacity="256MiB", keep=KEEP)
    _save_every_step(cluster, "floor-job", group_given=True)
    stores = [s.store for s in cluster.servers.values()]
    floors = {h: s.store.floors.get("floor-job") for h, s in cluster.servers.items()}
    listings = [s.janitor.listings for s in stores]
    # Every store learned a floor (from its rank's commits and status calls, or the replicas it received) and did not
    # list the cluster: 4 saves beyond --keep would have cost each store 4 passes that list. One is allowed: on a busy
    # machine a store's first eviction (step 3) may come before any floor reached it (floors arrive in the background).
    assert all(floors.values()) and max(listings) <= 1, (floors, listings)
    # The floor trails the newest save by one (each save's own agreement reaches the store with its status call):
    # keep 2 holds exactly steps 5 and 6, as retention did by listing the cluster.
    evicted = lambda: all(steps == [STEPS - 1, STEPS] for steps in _held_steps(cluster, "floor-job").values())  # noqa: E731
    try:
        wait_for(evicted, 20, what="retention below the floor")
    except TimeoutError:
        now = {h: s.store.floors.get("floor-job") for h, s in cluster.servers.items()}
        raise AssertionError(f"held {_held_steps(cluster, 'floor-job')}, floors {now}") from None
    with CheckpointClient("floor-job", 0, HOSTS, connection=Connection(cluster.address("h1"), timeout=20)) as c:
        assert c.latest_step() == STEPS
        assert_same(c.load(STEPS, rank=2), rank_state(2, STEPS))
    stores[0].delete("floor-job", -1, -1)  # a job deleted whole: a later run under its id starts without a floor
    assert stores[0].floors.get("floor-job") is None


def test_without_a_group_retention_lists_the_cluster_as_before(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=HOSTS, replicas=R, capacity="256MiB", keep=KEEP)
    _save_every_step(cluster, "no-floor-job", group_given=False)
    stores = [s.store for s in cluster.servers.values()]
    assert all(s.floors.get("no-floor-job") is None for s in stores)
    assert sum(s.janitor.listings for s in stores) > 0  # the O(N) question the floor removes
    wait_for(lambda: all(steps == [STEPS - 1, STEPS] for steps in _held_steps(cluster, "no-floor-job").values()), 20, what="retention")


def test_a_floor_newer_than_the_save_or_a_group_of_another_size_is_refused(make_inprocess_cluster) -> None:
    import torch.distributed as dist

    from memstore.v1 import store_pb2 as pb

    cluster = make_inprocess_cluster(hosts=1, replicas=1, capacity="64MiB", keep=KEEP)
    with CheckpointClient("bad-floor", 0, 1, connection=Connection(cluster.address("h0"), timeout=20)) as c:
        lease = c._link.stub.Allocate(pb.AllocateRequest(key=c._key(3, timeline="t.0"), world_size=1, nbytes=4096), timeout=10)
        with pytest.raises(Exception, match="restorable_floor 4 is invalid: expected a step from 0 to the saved step 3"):
            c._link.stub.Commit(pb.CommitRequest(lease_id=lease.lease_id, restorable_floor=4), timeout=10)
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    with pytest.raises(InvalidArgumentError, match=r"group has 1 ranks .* rank 0 of 2"):
        CheckpointClient("bad-floor", 0, 2, connection=Connection(cluster.address("h0"), timeout=20), group=group)
