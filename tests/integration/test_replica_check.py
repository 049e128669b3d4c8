"""verify_replicas over real gloo process groups on 127.0.0.1: 4 ranks in one group, then 2 groups of 2 made with
``new_group``; a member that lies (one element of its state perturbed) is named on every rank, by its job rank.
Ranks are forked from a preloaded forkserver and reaped with a deadline (tests/harness/ranks.py)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from memstore.testing import free_ports
from tests.harness.ranks import forkserver_fixture, run_ranks
from trainer_client.errors import ReplicaMismatchError
from trainer_client.replica_check import verify_replicas

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

WORLD = 4


forkserver = forkserver_fixture(__name__)


def _state(liar: bool) -> dict[str, Any]:
    """What every replica builds from the same seed; a liar differs in the last element of one moment (sampled)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8)).to(torch.bfloat16)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 32, dtype=torch.bfloat16)).float().square().mean().backward()
    optim.step()
    state = {"model": model.state_dict(), "optim": optim.state_dict(), "step": 100}
    if liar:
        moment = state["optim"]["state"][0]["exp_avg"]
        moment.view(-1)[-1] += 1
    return state


def _expect(state: dict[str, Any], group: Any, members: list[int], rank: int, ranks: tuple[int, ...] | None) -> None:
    try:
        verify_replicas(state, group, members, rank)
    except ReplicaMismatchError as exc:
        assert exc.ranks == ranks, f"rank {rank}: named {exc.ranks}, expected {ranks}: {exc}"
        assert exc.members == tuple(members), exc
        return
    assert ranks is None, f"rank {rank}: no ReplicaMismatchError, expected one naming {ranks}"


def _worker(rank: int, port: int) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        members = list(range(WORLD))
        _expect(_state(liar=False), dist.group.WORLD, members, rank, None)  # all alike: nobody raises
        _expect(_state(liar=rank == 2), dist.group.WORLD, members, rank, (2,))  # every rank names rank 2
        # Two replica groups of two (HSDP-like): {0, 1} alike, {2, 3} with rank 3 lying. Every rank makes both groups.
        groups = {0: dist.new_group([0, 1]), 1: dist.new_group([2, 3])}
        pair = [0, 1] if rank < 2 else [2, 3]
        expected = None if rank < 2 else (3,)  # a pair that disagrees is a tie: the one unlike its first member
        _expect(_state(liar=rank == 3), groups[rank // 2], pair, rank, expected)
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("forkserver")
def test_every_rank_names_the_member_that_lies() -> None:
    (port,) = free_ports(1)
    run_ranks(_worker, WORLD, port, timeout=90)


def _client_worker(rank: int, port: int, addresses: list[str]) -> None:
    """Through the client: a replica group of the whole job saves with verify_replicas; a liar's save raises on every
    rank and saves nothing; the agreed restore (latest_step(group=...)) reads the group's stripes."""
    from trainer_client import CheckpointClient, Connection

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        with CheckpointClient("verified", rank, WORLD, connection=Connection(addresses[rank % len(addresses)]), run_id="r1",
                              replica_group=dist.group.WORLD, verify_replicas=True) as client:  # fmt: skip
            assert client.save(1, _state(liar=False)).wait(60).committed
            try:
                client.save(2, _state(liar=rank == 2))
            except ReplicaMismatchError as exc:
                assert exc.ranks == (2,), exc
            else:
                raise AssertionError(f"rank {rank}: the liar's save went through")
            assert client.latest_step(group=dist.group.WORLD) == 1  # step 2 was never saved, by any rank
            restored = client.load(1, group=dist.group.WORLD)
            expected = _state(liar=False)
            assert restored["step"] == 100
            assert all(torch.equal(restored["model"][k], v) for k, v in expected["model"].items())
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("forkserver")
def test_a_client_with_verify_replicas_refuses_a_liars_save_on_every_rank(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="64MiB")
    (port,) = free_ports(1)
    run_ranks(_client_worker, WORLD, port, [cluster.address(h) for h in cluster.members], timeout=90)
