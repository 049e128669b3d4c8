"""torchtitan's CheckpointManager saving into memstore through MemStoreCheckpointManager: real torchtitan, real stores.

torchtitan's own Trainer cannot run on a CPU-only torch (its model package imports triton; on CPU its device
module is torch.cuda and Trainer.__init__ calls torch.cuda.set_device; docs/integrations.md), so this drives the
real CheckpointManager, OptimizersContainer and LRSchedulersContainer with the loop torchtitan's Trainer.train runs:
``checkpointer.load(step=load_step)``, then each step ``checkpointer.save(step, last_step=...)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed: pip install 'memstore[torchtitan]' (./dev installs it)")

import torch.distributed as dist
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

from trainer_client import CheckpointClient, Connection
from trainer_client.torchtitan import MemStoreCheckpointManager, step_of

pytestmark = pytest.mark.integration
STEPS, CRASH_AT = 10, 6


class TrainState:
    """What torchtitan's Trainer checkpoints of itself (``states={"train_state": trainer}``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]


class Batches:
    """A stateful loader: its position is checkpointed (torchtitan's dataloader is Stateful too)."""

    def __init__(self) -> None:
        self.position = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + self.position)
        self.position += 1
        x = torch.randn(8, 8, generator=g)
        return x, x[:, :4].cos()

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.position = sd["position"]


class Run:
    """One start of a torchtitan job: model, optimizers, schedulers and the checkpointer built as its Trainer builds them."""

    def __init__(self, tmp_path: Path, store: str, seed: int, job: str = "titan", **checkpoint: Any) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        self.optimizers = default_adamw(lr=1e-2).build(model_parts=[self.model])
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=self.optimizers, training_steps=STEPS)
        self.train_state, self.data = TrainState(), Batches()
        config = MemStoreCheckpointManager.Config(enable=True, job_id=job, connection=Connection(store), interval=2, **checkpoint)
        self.checkpointer = config.build(
            dataloader=self.data, model_parts=[self.model], optimizers=self.optimizers, lr_schedulers=self.lr_schedulers,
            states={"train_state": self.train_state}, sd_adapter=None, base_folder=str(tmp_path),
        )  # fmt: skip

    def train(self, until: int, load_step: int = -1) -> bool:
        loaded = self.checkpointer.load(step=load_step)
        while self.train_state.step < until:
            self.train_state.step += 1
            x, y = self.data.next()
            self.optimizers.zero_grad()
            torch.nn.functional.mse_loss(self.model(x), y).backward()
            self.optimizers.step()
            self.lr_schedulers.step()
            self.checkpointer.save(self.train_state.step, last_step=self.train_state.step == STEPS)
        self.checkpointer.maybe_wait_for_saving()
        return loaded


@pytest.fixture
def process_group() -> Iterator[None]:
    """torchtitan's trainer runs under torch.distributed; one gloo rank here."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def assert_same(a: Run, b: Run) -> None:
    for k, v in a.model.state_dict().items():
        assert torch.equal(v, b.model.state_dict()[k]), k
    oa, ob = a.optimizers.state_dict(), b.optimizers.state_dict()
    assert oa.keys() == ob.keys()
    for k, v in oa.items():
        assert torch.equal(v, ob[k]) if isinstance(v, torch.Tensor) else v == ob[k], k
    assert a.lr_schedulers.state_dict() == b.lr_schedulers.state_dict() and a.data.position == b.data.position


def uninterrupted(tmp_path: Path, store: str, steps: int = STEPS) -> Run:
    """The same run, never stopped (load_only: it saves nothing, and its job has nothing to load)."""
    run = Run(tmp_path / "reference", store, seed=0, job="titan-reference", load_only=True)
    assert run.train(steps) is False
    return run


def test_a_crashed_run_resumes_bit_exactly_from_memstore_with_its_first_save_prepared(
    make_inprocess_cluster, process_group, tmp_path: Path
) -> None:
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="64MiB", keep=3)
    first = Run(tmp_path, cluster.address("h0"), seed=0, last_save_model_only=False)
    assert first.checkpointer.load() is False and first.checkpointer.writer._client is None  # a fresh start prepares nothing
    assert first.train(CRASH_AT) is False  # memstore has nothing yet, no initial_load_path: a fresh start
    first.checkpointer.close()  # the process dies here; its saves of steps 2, 4 and 6 are in the stores
    with CheckpointClient("titan", 0, 1, connection=Connection(cluster.address("h1"))) as client:
        assert client.latest_step() == CRASH_AT
    assert not (tmp_path / "checkpoint").exists()  # nothing in torchtitan's folder

    resumed = Run(tmp_path, cluster.address("h1"), seed=1, last_save_model_only=False)  # another host's store, other weights
    assert resumed.checkpointer.load() is True  # as Run.train does first (it loads again, the same step)
    client = resumed.checkpointer.writer._client  # load prepared the next save's memory: reserved ahead and mapped
    assert client is not None and client._ring.ahead_path() in client._ring.mapped_paths
    assert resumed.train(STEPS) is True and resumed.train_state.step == STEPS
    assert resumed.checkpointer.writer._client is client  # the prepared client made every save after it
    resumed.checkpointer.close()
    assert_same(resumed, uninterrupted(tmp_path, cluster.address("h0")))


def test_load_step_async_save_and_the_last_step_export(make_inprocess_cluster, process_group, tmp_path: Path) -> None:
    cluster = make_inprocess_cluster(hosts=1, replicas=1, capacity="64MiB", keep=8)
    store = cluster.address("h0")
    run = Run(tmp_path, store, seed=0, async_mode="async")  # dcp.async_save on a thread; last step: model-only export
    run.train(STEPS)
    run.checkpointer.close()
    with CheckpointClient("titan", 0, 1, connection=Connection(store)) as client:
        assert client.latest_step() == STEPS - 2  # step 10 was the export, not a memstore step
    export = tmp_path / "checkpoint" / f"step-{STEPS}"
    assert (export / ".metadata").is_file() and step_of(str(export)) == STEPS  # torchtitan's own files

    earlier = Run(tmp_path, store, seed=1)
    assert earlier.train(4, load_step=4) is True  # checkpoint.load_step=4: that step, from memstore
    assert_same(earlier, uninterrupted(tmp_path, store, 4))


def test_the_config_takes_a_connection_and_refuses_the_old_store_option() -> None:
    """Options are checked when the config is made (not at the first save): ``store=`` names its replacement."""
    config = MemStoreCheckpointManager.Config(enable=True, job_id="titan", connection=Connection("10.0.0.5:7070", timeout=5))
    assert config.connection == Connection("10.0.0.5:7070", timeout=5)
    with pytest.raises(
        TypeError, match=r"Config\(store=\) is not accepted: pass connection= \(Connection\(address=...\)\), or set MEMSTORE_STORE"
    ):
        MemStoreCheckpointManager.Config(enable=True, job_id="titan", store="10.0.0.5:7070")
    with pytest.raises(TypeError, match=r"checkpoint\.connection expects a trainer_client\.Connection, got a str"):
        MemStoreCheckpointManager.Config(enable=True, job_id="titan", connection="10.0.0.5:7070")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unexpected keyword argument 'stroe'"):
        MemStoreCheckpointManager.Config(enable=True, job_id="titan", stroe="10.0.0.5:7070")  # type: ignore[call-arg]
