"""trainer_client.warmup: an integration prepares a client's first save once, and a failure never fails anything; and
Ray Train's restore prepares the first save after a restart (a fake Ray Train worker, real stores)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness.allocations import allocations_now
from trainer_client import CheckpointClient, Connection, Credentials
from trainer_client.warmup import prepare_once

pytestmark = pytest.mark.integration
MiB = 1 << 20


def test_prepare_once_prepares_a_client_once_and_logs_a_failure_instead_of_raising(
    make_inprocess_cluster, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    cluster = make_inprocess_cluster(hosts=1, replicas=1, capacity="8MiB")
    with CheckpointClient("warm", 0, 1, connection=Connection(cluster.address("h0"))) as client:
        with caplog.at_level(logging.WARNING, logger="trainer_client.warmup"):
            assert prepare_once(client, {"w": torch.zeros(4 * MiB)}) is False  # 16 MiB: over the store's capacity
        assert "preparing the first save of job 'warm' rank 0 failed" in caplog.text and "capacity" in caplog.text
        assert prepare_once(client, {"w": torch.zeros(1024)}) is False  # once per client, failed or not
        assert client._ring.ahead_path() == ""
        state = {"w": torch.arange(1024.0)}
        client.save(0, state).wait(30)  # the save allocates its memory, as without prepare
        assert torch.equal(client.load(0)["w"], state["w"])

    with CheckpointClient("warm", 0, 1, connection=Connection(cluster.address("h0"))) as client:
        assert prepare_once(client, {"w": torch.arange(1024.0)}) is True  # another client: prepared
        assert client._ring.ahead_path() in client._ring.mapped_paths


@pytest.fixture
def ray_worker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """A fake Ray Train worker (rank 0 of 1, run "ray-warm"): ``get_checkpoint`` returns ``worker["checkpoint"]``;
    ``report`` records the pointers reported."""
    pytest.importorskip("ray.train")
    import memstore.ray.train as train

    class Context:
        def get_world_rank(self) -> int:
            return 0

        def get_world_size(self) -> int:
            return 1

        def get_experiment_name(self) -> str:
            return "ray-warm"

    worker: dict[str, Any] = {"checkpoint": None, "reported": []}

    def report(metrics: dict[str, Any], checkpoint: Any = None) -> None:
        if checkpoint is not None:
            with checkpoint.as_directory() as directory:
                worker["reported"].append(train.Pointer.read(directory))

    monkeypatch.setattr(train.ray.train, "get_context", Context)
    monkeypatch.setattr(train.ray.train, "get_checkpoint", lambda: worker["checkpoint"])
    monkeypatch.setattr(train.ray.train, "report", report)
    return worker


def test_ray_train_restore_prepares_the_first_save_after_a_restart(make_inprocess_cluster, ray_worker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import ray.train

    from memstore.ray.train import RayTrainCheckpoints

    cluster = make_inprocess_cluster(hosts=1, replicas=1, capacity="64MiB")
    connection = Connection(cluster.address("h0"), credentials=Credentials())  # a store of its own: no Ray cluster asked
    state: dict[str, Any] = {"model": {"w": torch.randn(64, 64)}, "optim": {"step": torch.tensor(3.0), "lr": 0.01}}

    first = RayTrainCheckpoints(connection=connection)
    assert first.restore() is None and first.client._ring.mapped_paths == []  # a fresh start: nothing to prepare with
    first.save(0, state)
    first.finish()
    first.close()
    (pointer,) = ray_worker["reported"]

    pointer.write(str(tmp_path))  # Ray Train restarts the worker group with the last reported checkpoint
    ray_worker["checkpoint"] = ray.train.Checkpoint.from_directory(str(tmp_path))
    resumed = RayTrainCheckpoints(connection=connection)
    restored_step = resumed.restore()
    assert restored_step is not None
    step, restored = restored_step
    assert step == 0 and torch.equal(restored["model"]["w"], state["model"]["w"])
    ring = resumed.client._ring
    assert ring.ahead_path() in ring.mapped_paths  # restore prepared the next save: reserved ahead and mapped
    allocations = allocations_now(resumed.client)
    state["optim"]["lr"] = 0.009765625  # the next save differs a little (its small entries): the headroom holds it
    resumed.save(1, state)
    resumed.finish()
    assert allocations == [], allocations  # the first save after the restart fit in what restore prepared
    assert ray_worker["reported"][-1].step == 1
    resumed.close()
