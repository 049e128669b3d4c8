"""The job's default process group, found without ``group=``: two real rank processes (gloo on 127.0.0.1) build their
clients as the quick start shows. Saves start the floor's all-reduce, ``latest_step()`` agrees over the group (each rank
asks only its own store), and ``group=False`` opts out. Ranks are forked from a preloaded forkserver and reaped."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from memstore.testing import free_ports
from tests.harness.ranks import forkserver_fixture, run_ranks

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

WORLD = 2


forkserver = forkserver_fixture(__name__)


def _worker(rank: int, port: int, addresses: list[str]) -> None:
    from trainer_client import CheckpointClient, Connection

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    connection = Connection(addresses[rank])
    made_before = CheckpointClient("grouped", rank, WORLD, connection=connection)  # before the group exists: found later
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        with made_before as client:
            for step in range(1, 4):
                assert client.save(step, {"w": torch.full((64,), float(rank * 100 + step))}).wait(60).committed
            assert client.group is dist.group.WORLD
            assert client._floor is not None and client._floor.collectives == 3  # one all-reduce per save
            assert client.latest_step() == 3
            stats = client.stats().agreement
            assert stats is not None and stats.rpcs == 1 and stats.collectives >= 1, stats  # its own store, then agreed
            assert torch.equal(client.load()["w"], torch.full((64,), float(rank * 100 + 3)))
        with CheckpointClient("grouped", rank, WORLD, connection=connection, group=False) as alone:
            assert alone.group is None
            assert alone.latest_step() == 3  # the cluster-wide call: no agreement made
            assert alone.stats().agreement.rpcs == 0 and alone.stats().agreement.collectives == 0
        with CheckpointClient("grouped", 0, 1, connection=connection) as other_world:  # not the job's group: none
            assert other_world.group is None
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("forkserver")
def test_clients_agree_over_the_jobs_default_group_unless_told_not_to(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="64MiB")
    (port,) = free_ports(1)
    run_ranks(_worker, WORLD, port, [cluster.address(h) for h in cluster.members], timeout=90)
