"""Exact resume: a run checkpointed to memstore, killed and resumed ends bit-identical to one that never stopped."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from trainer_client import CheckpointClient
from trainer_client.errors import InvalidArgumentError
from trainer_client.training_state import ResumableDataLoader, TrainingState, capture_rng, restore_rng

pytestmark = pytest.mark.integration
STEPS, CRASH_AFTER = 14, 8


class Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(96, 8, generator=g)
        self.y = torch.randint(0, 3, (96,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.randn(8) * 0.01 + float(np.random.rand()) * 0.001  # draws from torch and numpy RNGs
        return self.x[i] + noise, self.y[i]


def build() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, ResumableDataLoader]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    loader = ResumableDataLoader(Data(), batch_size=16, shuffle=True, seed=7)  # 6 batches per epoch: crosses epochs
    return model, opt, sched, loader


def seed_all() -> None:
    random.seed(11)
    np.random.seed(11)
    torch.manual_seed(11)


def train(model, opt, sched, loader, step: int, until: int, on_step=None) -> list[float]:  # type: ignore[no-untyped-def]
    losses = []
    while step < until:
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y) + 1e-4 * random.random()  # python RNG too
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            losses.append(loss.item())
            if on_step:
                on_step(step)
            if step >= until:
                break
    return losses


def test_resume_is_bit_identical(make_cluster) -> None:
    # Reference: one uninterrupted run.
    seed_all()
    model, opt, sched, loader = build()
    seed_all()
    reference_losses = train(model, opt, sched, loader, 0, STEPS)
    reference = {k: v.clone() for k, v in model.state_dict().items()}

    # Stores in processes of their own: this test's point is the trainer's process-global state (its RNGs), which
    # in-process stores would share (in a loaded random-order run, the in-process variant once diverged at step 13).
    cluster = make_cluster(hosts=2, replicas=2, capacity="64MiB")
    client = CheckpointClient("exact", 0, 1, store=cluster.address("h0"))
    seed_all()
    model, opt, sched, loader = build()
    seed_all()
    ts = TrainingState(model=model, optimizer=opt, scheduler=sched, loader=loader)
    handles = []
    first_losses = train(model, opt, sched, loader, 0, CRASH_AFTER,
                         on_step=lambda s: handles.append(client.save(s, ts.capture(step=s, epoch=loader.epoch))))  # fmt: skip
    handles[-1].wait(timeout=30)
    client.close()
    del model, opt, sched, loader, ts  # the trainer process is gone

    # Whatever the dead process left in the global RNGs must not matter.
    random.seed(999)
    np.random.seed(999)
    torch.manual_seed(999)
    cluster.kill("h0")  # and its host too: the state comes back from the peer
    client = CheckpointClient("exact", 0, 1, store=cluster.address("h1"))
    model, opt, sched, loader = build()
    ts = TrainingState(model=model, optimizer=opt, scheduler=sched, loader=loader)
    info = ts.restore(client.load())
    assert info["step"] == CRASH_AFTER
    resumed_losses = train(model, opt, sched, loader, info["step"], STEPS)
    client.close()

    assert first_losses + resumed_losses == reference_losses  # the loss curve, bit for bit
    for name, value in model.state_dict().items():
        assert torch.equal(value, reference[name]), name


def test_rng_capture_round_trip() -> None:
    seed_all()
    saved = capture_rng()
    a = (random.random(), float(np.random.rand()), torch.rand(3))
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    restore_rng(saved)
    b = (random.random(), float(np.random.rand()), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_loader_resumes_mid_epoch_and_rejects_mismatch() -> None:
    full = ResumableDataLoader(list(range(20)), batch_size=4, seed=3)  # type: ignore[arg-type]
    order = [b.tolist() for b in full] + [b.tolist() for b in full]
    part = ResumableDataLoader(list(range(20)), batch_size=4, seed=3)  # type: ignore[arg-type]
    it = iter(part)
    seen = [next(it).tolist() for _ in range(3)]
    state = part.state_dict()
    resumed = ResumableDataLoader(list(range(20)), batch_size=4, seed=3)  # type: ignore[arg-type]
    resumed.load_state_dict(state)
    rest = [b.tolist() for b in resumed] + [b.tolist() for b in resumed]
    assert seen + rest[:2] == order[:5]
    assert rest[2:7] == order[5:10]  # second epoch: a fresh permutation, same as the uninterrupted run
    with pytest.raises(InvalidArgumentError, match="seed"):
        ResumableDataLoader(list(range(20)), batch_size=4, seed=4).load_state_dict(state)  # type: ignore[arg-type]
