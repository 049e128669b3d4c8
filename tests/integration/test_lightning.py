"""Lightning's Trainer checkpointing into memstore through MemStoreCheckpointIO: real `lightning` on CPU, real stores.

Run as a script (``python -m tests.integration.test_lightning STORE DIR JOB``) it is the trainer the slow test
SIGKILLs mid-fit.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

L = pytest.importorskip("lightning", reason="lightning is not installed: pip install 'memstore[lightning]' (the dev set-up has it)")

from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402

from memstore.testing import free_ports  # noqa: E402
from trainer_client import CheckpointClient, Connection  # noqa: E402
from trainer_client.errors import InvalidArgumentError  # noqa: E402
from trainer_client.lightning import POINTER_FORMAT, MemStoreCheckpointIO, Pointer, monitored_metrics  # noqa: E402

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
EPOCHS, KILL_EPOCH = 4, 2


@dataclass(frozen=True)
class Widths:  # a hyperparameter the shard format cannot hold: the plugin pickles it
    hidden: int = 16


class EpochShuffle(torch.utils.data.Sampler[int]):
    """A new order every epoch, fixed by (seed, epoch): Lightning calls set_epoch, so a resumed run sees the same order."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(100 + self.epoch)).tolist())

    def __len__(self) -> int:
        return self.n


class Tiny(L.LightningModule):
    def __init__(self, lr: float = 0.05, widths: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        hidden = widths.hidden if widths is not None else 16
        self.net = torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch, _i):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, _i):  # type: ignore[no-untyped-def]
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)}


def loaders() -> tuple[torch.utils.data.DataLoader, torch.utils.data.DataLoader]:  # type: ignore[type-arg]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(48, 6, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    return (torch.utils.data.DataLoader(data, batch_size=8, sampler=EpochShuffle(48)),
            torch.utils.data.DataLoader(data, batch_size=16))  # fmt: skip


def trainer(root: Path, epochs: int, plugin: Any = None, callbacks: list[Any] | None = None) -> Any:
    return L.Trainer(
        max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=str(root), plugins=[plugin] if plugin else None,
        callbacks=callbacks, enable_checkpointing=bool(callbacks),
    )  # fmt: skip


def model(seed: int) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def fit_reference(root: Path, epochs: int = EPOCHS) -> Tiny:
    """The same run, never interrupted (no checkpoints)."""
    m = model(0)
    trainer(root, epochs).fit(m, *loaders())
    return m


def assert_same_training_state(a: Tiny, b: Tiny) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    oa, ob = a.trainer.optimizers[0].state_dict(), b.trainer.optimizers[0].state_dict()
    assert oa["param_groups"] == ob["param_groups"]
    for i, st in oa["state"].items():
        for k, v in st.items():
            assert torch.equal(v, ob["state"][i][k]), (i, k)


def test_fit_saves_into_memstore_with_top_k_retention_and_last(make_inprocess_cluster, tmp_path: Path) -> None:
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="64MiB", keep=16)
    conn = Connection(cluster.address("h0"))
    removed: list[str] = []

    class Recording(MemStoreCheckpointIO):
        def remove_checkpoint(self, path: Any) -> None:
            removed.append(str(path))
            super().remove_checkpoint(path)

    plugin = Recording("lit-fit", connection=conn)
    ckpt_dir = tmp_path / "ckpt"
    cb = ModelCheckpoint(dirpath=ckpt_dir, monitor="val_loss", save_top_k=2, save_last=True)
    m = model(0)
    trainer(tmp_path, EPOCHS, plugin, [cb]).fit(m, *loaders())

    # Lightning's retention ran on the pointers: the top 2 and last.ckpt are there, the others were removed.
    files = sorted(os.listdir(ckpt_dir))
    assert set(files) == {Path(p).name for p in cb.best_k_models} | {"last.ckpt"}, files
    assert len(files) == 3 and removed and not any(os.path.exists(p) for p in removed)
    with pytest.raises(FileNotFoundError):
        plugin.load_checkpoint(removed[0])

    # Every pointer names its own memstore step of the job, the last one the newest; the bytes are in the stores.
    pointers = {f: Pointer.read(str(ckpt_dir / f)) for f in files}
    assert len({p.step for p in pointers.values()}) == 3 and all(p.job_id == "lit-fit" for p in pointers.values())
    assert pointers["last.ckpt"].step == max(p.step for p in pointers.values())
    assert json.loads((ckpt_dir / "last.ckpt").read_text())["format"] == POINTER_FORMAT
    with CheckpointClient("lit-fit", 0, 1, connection=conn) as client:
        assert client.latest_step() == pointers["last.ckpt"].step
        handle_metrics = client.restore_point(pointers["last.ckpt"].step)
        assert handle_metrics is not None and handle_metrics.timeline == pointers["last.ckpt"].timeline

    # last.ckpt is the end of fit, bit for bit; a top-k checkpoint is Lightning's own dict.
    last = plugin.load_checkpoint(ckpt_dir / "last.ckpt")
    assert last["global_step"] == m.trainer.global_step and last["epoch"] == EPOCHS - 1
    for k, v in m.state_dict().items():
        assert torch.equal(last["state_dict"][k], v), k
    best = plugin.load_checkpoint(cb.best_model_path)
    assert set(best) >= {"state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks", "hyper_parameters"}
    assert best["hyper_parameters"]["lr"] == 0.05


class RingAtTrainStart(Callback):
    """Records, when training starts (set-up done, no checkpoint saved yet), what the plugin's client has prepared."""

    def __init__(self, plugin: MemStoreCheckpointIO) -> None:
        self.plugin = plugin
        self.ahead = ""
        self.mapped: list[str] = []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        client = self.plugin._client
        if client is not None:
            self.ahead, self.mapped = client._ring.ahead_path(), client._ring.mapped_paths


def test_ckpt_path_last_resumes_bit_exactly_with_its_first_save_prepared(make_inprocess_cluster, tmp_path: Path) -> None:
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="64MiB", keep=4)
    conn = Connection(cluster.address("h0"))
    ckpt_dir = tmp_path / "ckpt"
    first_plugin = MemStoreCheckpointIO("lit-resume", connection=conn)
    fresh = RingAtTrainStart(first_plugin)
    trainer(tmp_path, KILL_EPOCH, first_plugin, [ModelCheckpoint(dirpath=ckpt_dir, save_last=True), fresh]).fit(model(0), *loaders())
    assert fresh.ahead == "" and fresh.mapped == []  # a fresh fit loads nothing: its first save allocates (trainer_client.warmup)
    # A new process would have a new plugin (and client): the resumed fit starts from other weights and restores all.
    resumed = model(1)
    plugin = MemStoreCheckpointIO("lit-resume", connection=conn)
    at_start = RingAtTrainStart(plugin)
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, save_last=True), at_start]
    trainer(tmp_path, EPOCHS, plugin, callbacks).fit(resumed, *loaders(), ckpt_path="last")
    # load_checkpoint prepared the first save of the resumed fit: its segment reserved ahead and mapped (the store's ring
    # for the job's rank 0 is already full from the first fit, so prepare adds no segment to it).
    assert at_start.ahead and at_start.ahead in at_start.mapped
    assert_same_training_state(resumed, fit_reference(tmp_path / "ref"))
    # The resumed run counted its memstore steps on from the first run's.
    assert Pointer.read(str(ckpt_dir / "last.ckpt")).step == 2 * EPOCHS - 1


def test_async_checkpoint_io_wrapping_the_plugin_works(make_inprocess_cluster, tmp_path: Path) -> None:
    cluster = make_inprocess_cluster(hosts=1, replicas=1, capacity="64MiB")
    inner = MemStoreCheckpointIO("lit-async", connection=Connection(cluster.address("h0")))
    m = model(0)
    trainer(tmp_path, 1, AsyncCheckpointIO(inner), [ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)]).fit(m, *loaders())
    last = inner.load_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    for k, v in m.state_dict().items():
        assert torch.equal(last["state_dict"][k], v), k


def test_hyperparameter_objects_are_pickled_and_loaded_with_lightnings_weights_only(make_inprocess_cluster, tmp_path: Path) -> None:
    cluster = make_inprocess_cluster(hosts=1, replicas=1, capacity="64MiB")
    plugin = MemStoreCheckpointIO("lit-hparams", connection=Connection(cluster.address("h0")))
    torch.manual_seed(0)
    m = Tiny(widths=Widths(hidden=4))
    ckpt_dir = tmp_path / "ckpt"
    trainer(tmp_path, 1, plugin, [ModelCheckpoint(dirpath=ckpt_dir, save_last=True)]).fit(m, *loaders())
    # As torch.load of a file: a class outside the weights_only allowlist needs weights_only=False.
    with pytest.raises(pickle.UnpicklingError):
        plugin.load_checkpoint(ckpt_dir / "last.ckpt", weights_only=True)
    ckpt = plugin.load_checkpoint(ckpt_dir / "last.ckpt", weights_only=False)
    assert ckpt["hyper_parameters"]["widths"] == Widths(hidden=4)
    assert torch.equal(ckpt["state_dict"]["net.0.weight"], m.state_dict()["net.0.weight"])
    # Lightning's own resume path with weights_only=False restores through the plugin too.
    torch.manual_seed(1)
    again = Tiny(widths=Widths(hidden=4))
    resume = trainer(tmp_path, 2, plugin, [ModelCheckpoint(dirpath=ckpt_dir, save_last=True)])
    resume.fit(again, *loaders(), ckpt_path="last", weights_only=False)
    assert again.trainer.global_step == 2 * m.trainer.global_step


def test_an_option_the_client_would_refuse_fails_when_the_plugin_is_made() -> None:
    with pytest.raises(TypeError, match=r"MemStoreCheckpointIO\(store=\) is not accepted: pass connection= \(Connection\(address=...\)\)"):
        MemStoreCheckpointIO("job", store="127.0.0.1:7070")
    with pytest.raises(TypeError, match="unexpected options replica_group, retries: it takes job_id, connection="):
        MemStoreCheckpointIO("job", retries=3, replica_group=[0, 1])
    assert MemStoreCheckpointIO("job", remote_save="background", run_id="r").client_options == {"remote_save": "background", "run_id": "r"}


def test_a_file_that_is_no_pointer_is_refused(tmp_path: Path) -> None:
    plugin = MemStoreCheckpointIO("lit-none", connection=Connection("127.0.0.1:1"))
    torch.save({"state_dict": {}}, tmp_path / "plain.ckpt")
    with pytest.raises(InvalidArgumentError, match="not a memstore checkpoint pointer"):
        plugin.load_checkpoint(tmp_path / "plain.ckpt")
    with pytest.raises(FileNotFoundError):
        plugin.load_checkpoint(tmp_path / "missing.ckpt")


def test_monitored_scores_become_the_saves_metrics() -> None:
    checkpoint = {"callbacks": {
        "ModelCheckpoint{'monitor': 'val_loss', 'mode': 'min'}": {"monitor": "val_loss", "current_score": torch.tensor(0.25)},
        "ModelCheckpoint{'monitor': None}": {"monitor": None, "current_score": None},
        "ModelCheckpoint{'monitor': 'acc'}": {"monitor": "acc", "current_score": torch.tensor(float("nan"))},
        "EarlyStopping{'monitor': 'val_loss'}": {"wait_count": 0, "best_score": torch.tensor(0.2)},
    }}  # fmt: skip
    assert monitored_metrics(checkpoint) == {"val_loss": 0.25}  # what --spill-keep-best ranks by


class KillAt(Callback):
    """SIGKILLs this process in the middle of epoch ``epoch`` (after the previous epoch's checkpoints were saved)."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_batch_end(self, trainer, *_args) -> None:  # type: ignore[no-untyped-def]
        if trainer.current_epoch == self.epoch and trainer.fit_loop.epoch_loop.batch_progress.current.completed == 3:
            os.kill(os.getpid(), signal.SIGKILL)


def _killed_fit(store: str, ckpt_dir: str, job: str) -> None:
    plugin = MemStoreCheckpointIO(job, connection=Connection(store))
    cb = ModelCheckpoint(dirpath=ckpt_dir, monitor="val_loss", save_top_k=2, save_last=True)
    trainer(Path(ckpt_dir).parent, EPOCHS, plugin, [cb, KillAt(KILL_EPOCH)]).fit(model(0), *loaders())


@pytest.mark.slow
def test_a_killed_fit_resumes_bit_exactly(make_inprocess_cluster, tmp_path: Path) -> None:
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="64MiB", keep=8)
    ckpt_dir = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.integration.test_lightning", cluster.address("h0"), str(ckpt_dir), "lit-kill"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert Pointer.read(str(ckpt_dir / "last.ckpt")).epoch == KILL_EPOCH - 1  # killed after epoch KILL_EPOCH - 1's save

    resumed = model(1)
    cb = ModelCheckpoint(dirpath=ckpt_dir, monitor="val_loss", save_top_k=2, save_last=True)
    plugin = MemStoreCheckpointIO("lit-kill", connection=Connection(cluster.address("h1")))  # through the other host's store
    trainer(tmp_path, EPOCHS, plugin, [cb]).fit(resumed, *loaders(), ckpt_path="last")
    assert_same_training_state(resumed, fit_reference(tmp_path / "ref"))


def _ddp_fit(stores: str, ckpt_dir: str, job: str, resume: str, out: str) -> None:
    """One rank of a 2-rank DDP fit under torchrun; each rank reaches its own host's store. ``job`` "": no checkpoints."""
    rank = int(os.environ["RANK"])
    loads: list[str] = []

    class Counting(MemStoreCheckpointIO):
        def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
            loads.append(str(path))
            return super().load_checkpoint(path, *args, **kwargs)

    plugin = Counting(job, connection=Connection(stores.split(",")[rank])) if job else None
    fit = L.Trainer(
        max_epochs=EPOCHS if resume == "1" or not job else KILL_EPOCH, accelerator="cpu", devices=2, strategy="ddp", logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=ckpt_dir,
        plugins=[plugin] if plugin else None, callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True)] if job else None,
        enable_checkpointing=bool(job),
    )  # fmt: skip
    m = model(0 if resume != "1" else 10 + rank)
    fit.fit(m, *loaders(), ckpt_path="last" if resume == "1" else None)
    torch.save({"state": m.state_dict(), "loads": loads}, f"{out}.rank{rank}")


@pytest.mark.slow
def test_ddp_saves_on_rank_0_and_every_rank_resumes_through_its_own_store(make_inprocess_cluster, tmp_path: Path) -> None:
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="64MiB", keep=8)
    stores = f"{cluster.address('h0')},{cluster.address('h1')}"
    ckpt_dir = tmp_path / "ckpt"

    def torchrun(job: str, resume: str, out: Path) -> list[dict[str, Any]]:
        (port,) = free_ports(1)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
             str(port), "-m", "tests.integration.test_lightning", "ddp", stores, str(ckpt_dir), job, resume, str(out)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return [torch.load(f"{out}.rank{r}", weights_only=True) for r in (0, 1)]

    torchrun("lit-ddp", "0", tmp_path / "first")
    resumed = torchrun("lit-ddp", "1", tmp_path / "resumed")
    reference = torchrun("", "0", tmp_path / "reference")
    for rank in (0, 1):
        assert resumed[rank]["loads"] == [str(ckpt_dir / "last.ckpt")]  # every rank loaded, each through its own store
        for k, v in reference[rank]["state"].items():
            assert torch.equal(resumed[rank]["state"][k], v), (rank, k)


if __name__ == "__main__":
    if sys.argv[1] == "ddp":
        _ddp_fit(*sys.argv[2:7])
    else:
        _killed_fit(*sys.argv[1:4])
