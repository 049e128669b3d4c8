"""RAM at the floor (issue 39, item 2): at the store's defaults the stores hold at most the kept steps plus one save in
flight, (keep + 1) x R of the state (+ 0.5 for headers and timing), for one rank and for four ranks of one host, and
``memstore status --json`` reports what each job holds."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from memstore.cli import main as memstore_main
from memstore.testing import wait_for
from memstore.v1 import store_pb2 as pb
from memstore.v1 import store_pb2_grpc as pb_grpc
from memstore.v1.channel import insecure_channel
from tests.harness.inprocess import InProcessCluster
from trainer_client import CheckpointClient, Connection

pytestmark = pytest.mark.integration
MiB = 1 << 20
KEEP, R = 2, 2


def state(step: int, rank: int, nbytes: int) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((nbytes // 4 // 4,), float(step * 10 + rank + i)) for i in range(4)}


def used(cluster: InProcessCluster) -> int:
    total = 0
    for host in cluster.stores:
        h = cluster.health(host, timeout=10)
        assert h is not None, f"{host} did not answer"
        total += h.used_bytes
    return total


@contextmanager
def peak_of(read: Callable[[], int]) -> Iterator[list[int]]:
    """Samples ``read()`` on a thread while the block runs; the list holds the largest value seen."""
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], read())
            stop.wait(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join(10)


def held(cluster: InProcessCluster, host: str, job: str) -> int:
    """How many copies of ``job``'s shards the store ``host`` holds (its own and replicas)."""
    with insecure_channel(cluster.address(host)) as channel:
        return len(pb_grpc.StoreStub(channel).List(pb.ListRequest(job_id=job), timeout=10).shards)


def saves(cluster: InProcessCluster, job: str, ranks: int, nbytes: int, steps: int) -> None:
    """``ranks`` clients of one host (threads), each prepared, saving ``steps`` steps at once, each waited for, the next
    once every store's retention let the oldest step go (a training step later, at a trainer's cadence)."""
    errors: list[BaseException] = []
    start = threading.Barrier(ranks)

    def rank(r: int) -> None:
        try:
            with CheckpointClient(job, r, ranks, connection=Connection(cluster.address("h0")), run_id="run") as client:
                client.prepare(state(0, r, nbytes))
                for step in range(1, steps + 1):
                    start.wait(60)
                    client.save(step, state(step, r, nbytes)).wait(60)
                    client._ring.wait_ahead()  # a trainer's cadence: the next save's memory is reserved before it comes
                    if r == 0:
                        wait_for(lambda: all(held(cluster, h, job) <= KEEP * ranks for h in cluster.stores), 30, what="retention")
        except BaseException as exc:  # reported by the test
            errors.append(exc)
            start.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not [t for t in threads if t.is_alive()], "a rank hung"
    if errors:
        raise errors[0]


def status_row(capsys: pytest.CaptureFixture[str], cluster: InProcessCluster, job: str) -> dict[str, Any]:
    capsys.readouterr()
    assert memstore_main(["status", "--store", cluster.address("h0"), "--json"]) == 0
    jobs = {j["job"]: j for j in json.loads(capsys.readouterr().out)["jobs"]}
    return jobs[job]


@pytest.mark.parametrize(("ranks", "nbytes"), [(1, 8 * MiB), (4, 2 * MiB)])
def test_the_stores_hold_the_kept_steps_and_one_save_in_flight(
    make_inprocess_cluster: Any, capsys: pytest.CaptureFixture[str], ranks: int, nbytes: int
) -> None:
    cluster = make_inprocess_cluster(hosts=2, replicas=R, capacity="256MiB", keep=KEEP)  # every other flag at its default
    with peak_of(lambda: used(cluster)) as peak:
        saves(cluster, "ram", ranks, nbytes, steps=8)
    settled = used(cluster)
    logical = ranks * nbytes
    assert peak[0] / logical <= (KEEP + 1) * R + 0.5, f"peak {peak[0] / logical:.2f}x the state"
    assert settled / logical <= (KEEP + 1) * R + 0.5, f"settled {settled / logical:.2f}x the state"
    row = status_row(capsys, cluster, "ram")
    # every byte the stores hold is the job's (its copies, leases and spares), but for the reserve; retention may have
    # let a spare go between the two readings
    assert row["copies_bytes"] <= row["ram_bytes"] <= max(settled, used(cluster))
    assert row["copies_bytes"] >= KEEP * R * logical  # the kept steps, R copies each
    assert row["state_bytes"] >= logical and row["ram_multiple"] == round(row["ram_bytes"] / row["state_bytes"], 2)
    capsys.readouterr()
    assert memstore_main(["status", "--store", cluster.address("h0")]) == 0
    assert "RAM / state" in capsys.readouterr().out
