"""DCP saves carry the restorable floor in DCP's own plans: no store lists the cluster to evict (issue 40, item 5).

Four gloo ranks, processes forked from a forkserver, each save through ``dcp.save`` with a fresh ``MemStoreWriter``
(as the DCP guide shows) into its own host's store. The stores run in this process (``make_inprocess_cluster``): the
test reads their retention counters and the calls they served (``memstore_rpcs_total``, as ``tools.save_scale``
counts them). Without the floor riding the plans, each store would list its peers at every save beyond ``--keep``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from memstore.testing import free_ports, wait_for
from tests.harness.ranks import forkserver_fixture, run_ranks
from tools.save_scale import RETENTION_CALLS, store_counts
from trainer_client import Connection
from trainer_client.dcp import MemStoreReader, MemStoreWriter

pytestmark = [
    pytest.mark.integration,
    pytest.mark.usefixtures("forkserver"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

HOSTS, R, KEEP, STEPS = 4, 2, 2, 6
JOB = "dcp-floor"

forkserver = forkserver_fixture(__name__)


def _state(rank: int, step: int) -> dict[str, torch.Tensor]:
    return {f"w{rank}": torch.full((64,), float(rank * 100 + step)), "step": torch.tensor(step)}


def _save_worker(rank: int, addresses: list[str], port: int) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=HOSTS)
    try:
        for step in range(1, STEPS + 1):
            writer = MemStoreWriter(JOB, step, connection=Connection(addresses[rank], timeout=20))
            try:
                dcp.save(_state(rank, step), storage_writer=writer)
            finally:
                writer.close()
    finally:
        dist.destroy_process_group()


def test_dcp_saves_evict_below_the_agreed_floor_without_listing_the_cluster(make_inprocess_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_inprocess_cluster(hosts=HOSTS, replicas=R, keep=KEEP, capacity="128MiB", metrics=True,
                                     extra_args=["--repair-interval", "600"])  # fmt: skip
    hosts = [f"h{i}" for i in range(HOSTS)]
    before = {h: store_counts(cluster, h) for h in hosts}
    run_ranks(_save_worker, HOSTS, [cluster.address(h) for h in hosts], free_ports(1)[0])

    servers = cluster.servers
    held = lambda: {h: sorted({k.step for k, _, _ in servers[h].store.catalog.held(JOB)}) for h in hosts}  # noqa: E731
    wait_for(lambda: all(steps == [STEPS - 1, STEPS] for steps in held().values()), 20, what=f"retention below the floor: {held()}")
    # The floor of the last save is the save before it, a version of another timeline, known to every store.
    floors = {h: servers[h].store.floors.get(JOB) for h in hosts}
    assert all(f is not None and f.step == STEPS - 1 and f.timeline.startswith("dcp-") for f in floors.values()), floors
    assert len({f.timeline for f in floors.values() if f is not None}) == 1, floors
    # No store listed the cluster to evict; what each served of List/LatestStep is the coordinator's overwrite check
    # (FileSystemWriter's rule), one cluster-wide LatestStep per save: at most one call per store per saved step.
    assert [servers[h].store.janitor.listings for h in hosts] == [0] * HOSTS
    after = {h: store_counts(cluster, h) for h in hosts}
    calls = {h: sum(after[h].calls.get(m, 0) - before[h].calls.get(m, 0) for m in RETENTION_CALLS) / STEPS for h in hosts}
    assert max(calls.values()) <= 1.5, calls

    loaded = {"w3": torch.zeros(64), "step": torch.tensor(0)}
    dcp.load(loaded, storage_reader=MemStoreReader(JOB, connection=Connection(cluster.address("h1"))))
    assert torch.equal(loaded["w3"], _state(3, STEPS)["w3"]) and int(loaded["step"]) == STEPS  # the newest save, kept
