"""Capture and restore everything a training run needs to continue exactly where it stopped.

A resumed run must produce the same loss curve and weights, bit for bit, as a run that never
stopped. That needs more than model weights:

- model, optimizer and LR-scheduler state;
- the step and epoch counters;
- the RNG states of Python ``random``, NumPy's global generator, torch's CPU generator and every
  CUDA device's generator (dropout, shuffling and augmentation draw from them);
- the position in the data: :class:`ResumableDataLoader` wraps ``torch.utils.data.DataLoader`` and
  resumes mid-epoch at the next unseen batch of the same shuffled order;
- user extras (any value the safe shard format accepts).

Usage::

    ts = TrainingState(model=model, optimizer=opt, scheduler=sched, loader=loader)
    handle = client.save(step, ts.capture(step=step, epoch=epoch, extras={"best": best}))
    ...
    info = ts.restore(client.load())      # returns {"step": ..., "epoch": ..., "extras": {...}}

Capture copies nothing itself: ``CheckpointClient.save`` copies the tensors into the store, so
capture right after ``optimizer.step()`` and before the next forward pass mutates them.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from trainer_client.errors import InvalidArgumentError

FORMAT = "memstore.training_state/1"


def capture_rng() -> dict[str, Any]:
    """The global RNG states of Python, NumPy, torch CPU and (when present) every CUDA device."""
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)  # type: ignore[misc]
    rng: dict[str, Any] = {
        "python": {"version": py_version, "state": list(py_state), "gauss": py_gauss},
        "numpy": {"name": np_name, "keys": np_keys, "pos": int(np_pos), "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: Mapping[str, Any]) -> None:
    py = rng["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    n = rng["numpy"]
    np.random.set_state((n["name"], n["keys"], n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        states = rng["cuda"]
        if len(states) != torch.cuda.device_count():
            raise InvalidArgumentError(
                f"checkpoint has RNG states of {len(states)} CUDA devices; this process sees {torch.cuda.device_count()}"
            )
        torch.cuda.set_rng_state_all(states)


class ResumableBatchSampler(Sampler[list[int]]):
    """Batches of one rank's slice of a seeded permutation of ``range(n)``, starting at batch ``start``.

    The order depends only on (seed, epoch, rank, world_size), like ``DistributedSampler``, so a
    resumed run sees exactly the batches the interrupted one would have seen next.
    """

    def __init__(self, n: int, batch_size: int, *, shuffle: bool, seed: int, epoch: int, start: int,
                 rank: int, world_size: int, drop_last: bool) -> None:  # fmt: skip
        self.n, self.batch_size, self.shuffle, self.seed = n, batch_size, shuffle, seed
        self.epoch, self.start, self.rank, self.world_size, self.drop_last = epoch, start, rank, world_size, drop_last

    def _indices(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        per_rank = self.n // self.world_size  # equal share per rank: DDP needs the same batch count everywhere
        return order[self.rank * per_rank : (self.rank + 1) * per_rank]

    def batches(self) -> int:
        per_rank = self.n // self.world_size
        return per_rank // self.batch_size if self.drop_last else -(-per_rank // self.batch_size)

    def __len__(self) -> int:
        return max(0, self.batches() - self.start)

    def __iter__(self) -> Iterator[list[int]]:
        idx = self._indices()
        for b in range(self.start, self.batches()):
            yield idx[b * self.batch_size : (b + 1) * self.batch_size]


class ResumableDataLoader:
    """A ``DataLoader`` whose position (epoch, batches consumed) is part of the checkpoint.

    Counts the batches it has handed to the training loop (not the ones workers prefetched), so
    ``state_dict()`` is exact at any point. Randomness inside ``Dataset.__getitem__`` resumes exactly
    with ``num_workers=0`` (it draws from the global RNGs, which are checkpointed); with worker
    processes, derive it from the sample index and epoch instead, since worker RNG streams restart.
    ``**loader_kwargs`` go to ``DataLoader`` (num_workers, collate_fn, pin_memory, ...). Iterating past
    the end of an epoch starts the next one.
    """

    def __init__(self, dataset: Dataset[Any], batch_size: int, *, shuffle: bool = True, seed: int = 0, rank: int = 0,
                 world_size: int = 1, drop_last: bool = True, **loader_kwargs: Any) -> None:  # fmt: skip
        if batch_size < 1:
            raise InvalidArgumentError(f"batch_size {batch_size} is invalid: expected >= 1")
        if not 0 <= rank < world_size:
            raise InvalidArgumentError(f"rank {rank} is invalid: expected 0 <= rank < world_size ({world_size})")
        if {"batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"} & set(loader_kwargs):
            raise InvalidArgumentError(
                "ResumableDataLoader chooses the batches itself: pass batch_size/shuffle/drop_last to it, not a sampler"
            )
        self.dataset = dataset
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.loader_kwargs = loader_kwargs
        self.epoch = 0
        self.consumed = 0  # batches of the current epoch handed out

    def _sampler(self) -> ResumableBatchSampler:
        return ResumableBatchSampler(len(self.dataset), self.batch_size, shuffle=self.shuffle, seed=self.seed,  # type: ignore[arg-type]
                                     epoch=self.epoch, start=self.consumed, rank=self.rank, world_size=self.world_size,
                                     drop_last=self.drop_last)  # fmt: skip

    def __len__(self) -> int:
        return self._sampler().batches()

    def __iter__(self) -> Iterator[Any]:
        """Batches from the current position to the end of the epoch; then the next epoch begins."""
        kwargs = dict(self.loader_kwargs)
        # DataLoader draws its workers' base seed from this generator when an iterator starts. Left to
        # the global torch RNG, a resumed run (which starts an iterator mid-epoch) would consume one
        # draw the uninterrupted run did not, and every random number after it would differ.
        kwargs.setdefault("generator", torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch))
        loader = DataLoader(self.dataset, batch_sampler=self._sampler(), **kwargs)
        for batch in loader:
            self.consumed += 1
            yield batch
        self.epoch += 1
        self.consumed = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "world_size": self.world_size}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if state.get("world_size", self.world_size) != self.world_size or state.get("seed", self.seed) != self.seed:
            raise InvalidArgumentError(
                f"data position was saved with seed={state.get('seed')} world_size={state.get('world_size')}; this loader has "
                f"seed={self.seed} world_size={self.world_size}, so the batch order would differ"
            )
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])


class TrainingState:
    """Everything of a run that a checkpoint must hold, captured and restored in one call."""

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 scheduler: Any = None, loader: ResumableDataLoader | None = None) -> None:  # fmt: skip
        self.model, self.optimizer, self.scheduler, self.loader = model, optimizer, scheduler, loader

    def capture(self, *, step: int, epoch: int = 0, extras: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """A state for ``CheckpointClient.save``: the tensors are referenced, not copied."""
        state: dict[str, Any] = {
            "format": FORMAT,
            "step": int(step),
            "epoch": int(epoch),
            "rng": capture_rng(),
            "extras": dict(extras or {}),
        }
        if self.model is not None:
            state["model"] = self.model.state_dict()
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.loader is not None:
            state["loader"] = self.loader.state_dict()
        return state

    def restore(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Load every part into the objects given at construction; returns step, epoch and extras."""
        if state.get("format") != FORMAT:
            raise InvalidArgumentError(f"not a training state (format {state.get('format')!r}, expected {FORMAT!r})")
        for name in ("model", "optimizer", "scheduler", "loader"):
            target = getattr(self, name)
            if target is not None:
                if name not in state:
                    raise InvalidArgumentError(f"the checkpoint has no {name} state to restore")
                target.load_state_dict(state[name])
        restore_rng(state["rng"])
        return {"step": state["step"], "epoch": state["epoch"], "extras": state["extras"]}
