"""A Ray Train (TorchTrainer, Train V2) job saves to memstore every step and resumes after a worker is killed and
after a node is lost, with the same final weights as a run that never stopped."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

import memstore.ray as mray
from memstore.ray import gcs
from memstore.testing import wait_for
from tests.ray_integration.conftest import RayCluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # three TorchTrainer runs: ~2.5 min on 2 cores

RAY_WORKER_NODES = 3  # two train workers, one node to spare for the node-loss run
STEPS = 8


def train_func(config: dict[str, Any]) -> None:
    """Two DDP ranks on CPU; each step's batch depends only on (rank, step), so a resumed run can match bit for bit."""
    import torch.nn.functional as F
    from ray.train.torch import prepare_model

    from memstore.ray.train import RayTrainCheckpoints
    from trainer_client import Connection

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = RayTrainCheckpoints(connection=Connection(timeout=30))
    start = 0
    restored = ckpt.restore()
    if restored is not None:
        step, state = restored
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = step + 1
        with open(config["log"], "a") as log:
            log.write(f"rank {rank} resumed at {start}\n")
    for step in range(start, STEPS):
        if step == config.get("fail_at") and rank == 1 and not os.path.exists(config["marker"]):
            Path(config["marker"]).write_text(gcs.current_node_id())
            if config["how"] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Event().wait(120)  # "node": blocked here until the test removes this node (and this process with it)
        g = torch.Generator().manual_seed(rank * 1000 + step)
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        report = step % config.get("report_every", 1) == 0  # the same on every rank
        ckpt.save(step, {"model": model.module.state_dict(), "optim": opt.state_dict()}, metrics={"loss": loss.item()}, report=report)
    ckpt.finish()
    if rank == 0:
        torch.save(model.module.state_dict(), config["out"])


def fit(name: str, tmp: Path, **config: Any) -> tuple[dict[str, torch.Tensor], Any]:
    out = tmp / f"{name}.pt"
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"out": str(out), "marker": str(tmp / f"{name}.marker"), "log": str(tmp / f"{name}.log"), **config},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(
            name=name,
            storage_path=str(tmp / "ray_results"),
            failure_config=FailureConfig(max_failures=2),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )
    result = trainer.fit()
    return torch.load(out), result


@pytest.fixture(scope="module")
def stores(ray_cluster: RayCluster) -> dict[str, str]:
    return mray.ensure_stores(
        replicas=2, capacity="64MiB", config={"shm_dir": ray_cluster.shm_dir, "discovery_interval": 0.5, "repair_interval": 0.5}
    )


@pytest.fixture(scope="module")
def reference(stores: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    weights, result = fit("uninterrupted", tmp_path_factory.mktemp("ref"))
    assert result.error is None
    with result.checkpoint.as_directory() as d:
        assert '"step": 7' in Path(d, "memstore.json").read_text()  # finish() reported the last step
    return weights


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_resumes_after_a_worker_is_killed(reference: dict[str, torch.Tensor], tmp_path: Path) -> None:
    # Saves every step, reports every second step: Ray Train registers the pointer of step 3 (reported at step 4)
    # by the time the report at step 6 returns, and the resume starts from memstore's newest step, 6.
    weights, result = fit("worker-killed", tmp_path, fail_at=7, how="kill", report_every=2)
    assert result.error is None
    assert (tmp_path / "worker-killed.marker").exists()  # the kill happened
    log = (tmp_path / "worker-killed.log").read_text()
    assert "rank 1 resumed at 7" in log and "rank 0 resumed at 7" in log
    assert_same_weights(weights, reference)


def test_resumes_after_a_node_is_lost(reference: dict[str, torch.Tensor], ray_cluster: RayCluster, tmp_path: Path) -> None:
    marker = tmp_path / "node-lost.marker"

    def remove_the_node() -> None:
        wait_for(marker.exists, 120, interval=0.1, what="rank 1 to reach step 5")
        node_id = marker.read_text()
        ray_cluster.kill(next(n for n in ray_cluster.workers if n.node_id == node_id))

    killer = threading.Thread(target=remove_the_node)
    killer.start()
    try:
        weights, result = fit("node-lost", tmp_path, fail_at=5, how="node")
    finally:
        killer.join(timeout=130)
    assert result.error is None
    assert "rank 1 resumed at" in (tmp_path / "node-lost.log").read_text()
    assert_same_weights(weights, reference)
