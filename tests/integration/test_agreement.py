"""latest_step(group=...): every rank asks only its own store, and the ranks agree over a real gloo process group.

Ranks are threads of this process (``tools.thread_ranks``), each with its own CheckpointClient and its
own gloo group member: the same collectives as ranks in separate processes, without a torch process per rank.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch.distributed as dist

from memstore.testing import LocalCluster, wait_for
from tests.states import assert_same, rank_state
from tools.thread_ranks import on_every_rank as run_on_ranks
from trainer_client import CheckpointClient
from trainer_client.errors import InvalidArgumentError, StoreUnavailableError

pytestmark = pytest.mark.integration

T = TypeVar("T")
JOB = "agree-job"
HOSTS, R, WORLD = 4, 2, 8


def host_of(rank: int, hosts: int = HOSTS, world: int = WORLD) -> str:
    return f"h{rank // (world // hosts)}"


def on_every_rank(clients: list[CheckpointClient], fn: Callable[[CheckpointClient, Any], T]) -> list[T | BaseException]:
    """Run ``fn(client, group)`` on every rank at once; each rank's result, or the exception it raised."""
    results, _ = run_on_ranks(len(clients), lambda r, g: fn(clients[r], g), timeout=120)
    return results


def connect(cluster: LocalCluster, ranks: range | list[int], world: int = WORLD, hosts: int = HOSTS, **kw: Any) -> list[CheckpointClient]:
    return [CheckpointClient(JOB, r, world, store=cluster.address(host_of(r, hosts, world)), timeout=20, **kw) for r in ranks]


def save(clients: list[CheckpointClient], steps: range) -> None:
    for step in steps:
        for h in [c.save(step, rank_state(c.rank, step)) for c in clients]:
            h.wait(timeout=30)


def test_agreed_answer_matches_the_cluster_wide_one_at_one_call_per_rank(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=HOSTS, replicas=R, capacity="256MiB", keep=3, metrics=True)
    clients = connect(cluster, range(WORLD), run_id="run-a")
    try:
        save(clients, range(1, 4))
        assert all(c.latest_step() == 3 for c in clients)  # the unscoped answer, for comparison
        answers = on_every_rank(clients, lambda c, g: c.latest_step(group=g))
        assert answers == [3] * WORLD
        assert all(c.stats().agreement.rpcs == 1 and not c.stats().agreement.fallback for c in clients)
        assert all(c.stats().agreement.collectives == 3 for c in clients)
        # load(group=...) right after reuses the agreed point: no second query, the right bytes.
        loaded = on_every_rank(clients, lambda c, g: c.load(3, group=g))
        for c, state in zip(clients, loaded, strict=True):
            assert_same(state, rank_state(c.rank, 3))
        assert all(c.stats().agreement.rpcs == 1 for c in clients)
    finally:
        for c in clients:
            c.close()


def test_an_incomplete_newest_step_falls_back_once_and_every_rank_agrees(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=HOSTS, replicas=R, capacity="256MiB", keep=3)
    clients = connect(cluster, range(WORLD), run_id="run-b")
    try:
        save(clients, range(1, 3))
        save(clients[:5], range(3, 4))  # ranks 5..7 crashed before saving step 3
        answers = on_every_rank(clients, lambda c, g: c.latest_step(group=g))
        assert answers == [2] * WORLD
        assert clients[0].stats().agreement.fallback and clients[0].stats().agreement.rpcs == 2  # rank 0 asked the cluster once
        assert all(c.stats().agreement.fallback and c.stats().agreement.rpcs == 1 for c in clients[1:])
    finally:
        for c in clients:
            c.close()


def test_a_replaced_host_restores_its_ranks_from_its_group(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=HOSTS, replicas=R, capacity="256MiB", keep=3)
    clients = connect(cluster, range(WORLD), run_id="run-c")
    save(clients, range(1, 3))
    for c in clients:
        c.close()
    cluster.kill("h1")
    cluster.restart("h1")  # empty memory: its ranks' shards live on h0, its group peer
    clients = connect(cluster, range(WORLD), run_id="run-c2")
    try:
        loaded = on_every_rank(clients, lambda c, g: (c.latest_step(group=g), c.load(group=g), c.stats().last_load_source))
        for c, got in zip(clients, loaded, strict=True):
            assert not isinstance(got, BaseException), got
            step, state, source = got
            assert step == 2
            assert_same(state, rank_state(c.rank, 2))
            if host_of(c.rank) == "h1":
                assert source == "h0"
    finally:
        for c in clients:
            c.close()


def test_a_restart_from_durable_storage_lists_it_once_for_the_job(make_inprocess_cluster, tmp_path: Path) -> None:
    root = tmp_path / "spill"
    cluster = make_inprocess_cluster(
        hosts=2, replicas=2, capacity="256MiB", extra_args=["--spill", f"file://{root}", "--spill-every-steps", "1"]
    )
    clients = connect(cluster, range(4), world=4, hosts=2, run_id="run-d")
    save(clients, range(1, 3))
    for c in clients:
        c.close()
    newest = root / JOB / "step-000000000002"
    wait_for(lambda: all((newest / f"rank-{r:06d}.json").exists() for r in range(4)), timeout=60, what="step 2 spilled")
    for host in ("h0", "h1"):
        cluster.kill(host)
    for host in ("h0", "h1"):
        cluster.restart(host)  # every copy in memory is gone: only durable storage has the job
    clients = connect(cluster, range(4), world=4, hosts=2, run_id="run-d2")
    try:
        loaded = on_every_rank(clients, lambda c, g: (c.latest_step(group=g), c.load(group=g), c.stats().last_load_source))
        for c, got in zip(clients, loaded, strict=True):
            assert not isinstance(got, BaseException), got
            step, state, source = got
            assert (step, source) in ((2, "durable"), (2, "h0"), (2, "h1"))  # a group peer may have pulled it first
            assert_same(state, rank_state(c.rank, 2))
        assert any(got[2] == "durable" for got in loaded if not isinstance(got, BaseException))
        assert all(c._agreement.durable == {(2, "run-d.0")} for c in clients)
    finally:
        for c in clients:
            c.close()


def test_a_failed_store_makes_every_rank_raise_instead_of_hanging(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="128MiB")
    clients = connect(cluster, range(4), world=4, hosts=2, run_id="run-e")
    try:
        save(clients, range(1, 2))
        cluster.kill("h1")
        results = on_every_rank(clients, lambda c, g: c.latest_step(group=g))
        assert all(isinstance(r, StoreUnavailableError) for r in results), results
    finally:
        for c in clients:
            c.close()


def test_a_group_that_is_not_the_jobs_is_refused(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="128MiB")
    (client,) = connect(cluster, [1], world=4, hosts=2)
    try:
        group = dist.ProcessGroupGloo(dist.PrefixStore("one", dist.HashStore()), 0, 1)
        with pytest.raises(InvalidArgumentError, match="rank 1 of 4"):
            client.latest_step(group=group)
        with pytest.raises(InvalidArgumentError, match=r"not a torch\.distributed process group"):
            client.latest_step(group=object())
    finally:
        client.close()


def test_ranks_given_each_others_group_members_all_raise_instead_of_hanging(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=3, replicas=3, capacity="64MiB")
    clients = connect(cluster, range(3), world=3, hosts=3, run_id="run-f")
    try:
        swapped = [0, 2, 1]  # group member i is given to the client of rank swapped[i]: ranks 1 and 2 are mixed up
        results, _ = run_on_ranks(3, lambda r, g: clients[swapped[r]].latest_step(group=g), timeout=60)
        assert isinstance(results[1], InvalidArgumentError) and isinstance(results[2], InvalidArgumentError), results
        assert isinstance(results[0], StoreUnavailableError) and "not the job's" in str(results[0]), results[0]
    finally:
        for c in clients:
            c.close()
