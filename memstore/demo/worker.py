"""One trainer rank of ``memstore demo``: a tiny transformer language model trained with DDP over gloo.

Run by the demo and the chaos run (forked from a forkserver that imported torch once: ``memstore.children.start_forked``;
``python -m memstore.demo.worker --rank R ...`` runs one by hand). Every step
it checkpoints the whole training state (model, AdamW, LR schedule, RNGs, data position) into the host's
store; with ``--resume`` it first restores the newest step restorable for every rank and continues from
there. With ``--replica-group`` the ranks save as one data-parallel replica group (``replica_group=WORLD``):
each stores a quarter (1/world) of the state they all hold, and only its RNG streams as its own. Rank 0
appends one JSON line per step to ``--progress``; every rank writes a digest of its final weights, the
encoded size of its training state and the bytes it saved per step to ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from memstore.children import die_with_parent

MODEL_SIZES = {  # d_model, layers, heads, context
    "tiny": (64, 2, 4, 32),
    "small": (128, 4, 4, 64),
    "medium": (256, 6, 8, 128),
}
VOCAB = 48


def synthetic_corpus(n_tokens: int, seed: int = 2024) -> list[int]:
    """Text from a small random Markov chain: enough structure for the loss to fall, generated offline."""
    rng = random.Random(seed)
    table = [[rng.randrange(VOCAB) for _ in range(4)] for _ in range(VOCAB)]
    out = [0]
    for _ in range(n_tokens - 1):
        prev = out[-1]
        out.append(table[prev][rng.randrange(4)] if rng.random() < 0.9 else rng.randrange(VOCAB))
    return out


# DDP's reducer destructor joins gloo's worker thread, which may be waiting for the GIL to drop the
# comm hook's Python future: destroying the DDP wrapper can deadlock. It is kept alive here and the
# process exits with os._exit, skipping interpreter teardown.
_KEEP_ALIVE: list[object] = []


def _per_parameter_allreduce(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations at runtime
    """DDP comm hook: all-reduce each parameter's slice of the bucket separately.

    DDP rebuilds its gradient buckets after the first iteration, and a ring all-reduce sums each
    element in an order that depends on its offset in the flattened bucket. A resumed run's first
    iteration would use the initial buckets where the uninterrupted run used rebuilt ones, and the
    last bits of the gradients would differ. Reducing per parameter makes every element's
    summation order independent of the bucket layout, so resume is bit-exact.
    """
    import torch
    import torch.distributed as dist

    buffer = bucket.buffer()
    offset = 0
    works = []
    for grad in bucket.gradients():
        n = grad.numel()
        works.append(dist.all_reduce(buffer[offset : offset + n], async_op=True))
        offset += n
    for work in works:
        work.wait()
    buffer.div_(dist.get_world_size())
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buffer)
    return fut


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="memstore.demo.worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--store", default="", help="this host's store; empty = reference run without checkpoints")
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="tiny")
    p.add_argument("--job", default="demo")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--replica-group", action="store_true", help="save as one replica group of all ranks (dist.group.WORLD)")
    p.add_argument("--progress", required=True)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def _tiny_lm(model_size: str) -> Any:
    """A causal transformer LM of ``model_size`` (MODEL_SIZES), initialised from torch's current RNG state."""
    import torch
    from torch import nn

    d_model, layers, heads, context = MODEL_SIZES[model_size]

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, d_model)
            self.pos = nn.Parameter(torch.randn(context, d_model) * 0.02)
            layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.1, batch_first=True, norm_first=True)
            self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(d_model, VOCAB)
            self.mask: torch.Tensor
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.embed(x) + self.pos[: x.shape[1]]
            return self.head(self.body(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True))  # type: ignore[no-any-return]

    return TinyLM()


class _Training:
    """Model, DDP wrapper, AdamW, LR schedule and data loader of one rank, captured together as a TrainingState."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel

        from trainer_client.training_state import ResumableDataLoader, TrainingState

        context = MODEL_SIZES[args.model_size][3]
        corpus = torch.tensor(synthetic_corpus(20_000), dtype=torch.long)
        windows = [(corpus[i : i + context], corpus[i + 1 : i + context + 1]) for i in range(0, len(corpus) - context - 1, context // 2)]

        torch.manual_seed(0)  # identical initial weights on every rank
        self.model = _tiny_lm(args.model_size)
        self.ddp = DistributedDataParallel(self.model)
        self.ddp.register_comm_hook(None, _per_parameter_allreduce)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.01)
        warmup, steps = 5, args.steps
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
        )
        self.loader = ResumableDataLoader(windows, batch_size=8, shuffle=True, seed=17, rank=args.rank, world_size=args.world)  # type: ignore[arg-type]
        self.state = TrainingState(model=self.model, optimizer=self.opt, scheduler=self.sched, loader=self.loader)
        torch.manual_seed(1000 + args.rank)  # dropout differs per rank, as in real data-parallel runs
        random.seed(1000 + args.rank)

    def step(self, x: Any, y: Any) -> float:
        """One optimizer step on the batch (x, y); the loss."""
        from torch import nn

        self.opt.zero_grad(set_to_none=True)
        logits = self.ddp(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        self.opt.step()
        self.sched.step()
        return float(loss.item())

    def digest(self) -> str:
        """sha256 over the names and bytes of the final weights: equal digests, bit-identical models."""
        import torch

        digest = hashlib.sha256()
        for name, value in sorted(self.model.state_dict().items()):
            digest.update(name.encode())
            digest.update(value.detach().contiguous().view(torch.uint8).numpy().tobytes() if value.numel() else b"")
        return digest.hexdigest()

    def state_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.model.state_dict().values())


class _Checkpoints:
    """Every step saved to the store; the previous save is waited for (replicated) before the next one.

    With a replica group, every part of the state the ranks hold alike is saved as the group's (each rank
    captures its stripe of it); the RNG streams differ per rank (dropout) and stay each rank's own.
    """

    def __init__(self, client: Any, rank: int) -> None:
        self.client = client
        self.rank = rank
        self.pending: Any = None
        self.saves: list[dict[str, float]] = []
        self.state_nbytes = 0  # the encoded size of this rank's whole training state
        self.saved_nbytes: list[int] = []  # the bytes this rank's store holds per committed save (its stripe, in a group)

    def save(self, step: int, training: _Training) -> float:
        """Save ``step``; the stall it cost the training loop."""
        from trainer_client import serialization
        from trainer_client.errors import ReplicationError

        if self.pending is not None:
            t0 = time.perf_counter()
            try:
                self.saved_nbytes.append(self.pending.wait(timeout=120).nbytes)  # the previous step had a whole step to replicate
            except ReplicationError as exc:  # still restorable from fewer copies; repair catches up
                print(f"rank {self.rank}: {exc}", file=sys.stderr, flush=True)
            self.saves[-1]["wait"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        state = training.state.capture(step=step, epoch=training.loader.epoch)
        if not self.state_nbytes:  # once: the state's size does not change between steps
            self.state_nbytes = serialization.plan(state).nbytes
        replicated = [k for k in state if k != "rng"] if self.client.replica_group is not None else None
        self.pending = self.client.save(step, state, replicated=replicated)
        self.saves.append({"stall": self.pending.stall_seconds, "t0": t0})
        return float(self.pending.stall_seconds)

    def finish(self) -> float:
        """Wait for the last save to be committed; seconds from its start until then (0.0 without saves)."""
        if self.pending is None:
            return 0.0
        self.saved_nbytes.append(self.pending.wait(timeout=120).nbytes)
        return time.perf_counter() - self.saves[-1]["t0"]


def _restore(client: Any, training: _Training, rank: int) -> dict[str, Any]:
    """Restore the newest step restorable for every rank: {step, seconds, source}.

    With nothing restorable (every copy of the job was lost before it was spilled, as when a whole group
    dies early) the job starts again from step 0, as a scheduler would restart it.
    """
    import torch.distributed as dist

    t0 = time.perf_counter()
    # Agreed over the job's group: every rank asks only its own store, and all get the same step even if a
    # spill finishes between two ranks' questions (one rank must not restore while another starts fresh).
    latest = client.latest_step(group=dist.group.WORLD)
    if latest is None:
        print(f"rank {rank}: nothing restorable (lost before any step was spilled); starting from step 0", file=sys.stderr)
        return {"step": 0, "seconds": time.perf_counter() - t0, "source": ""}
    info = training.state.restore(client.load(latest, group=dist.group.WORLD))  # reuses the agreed version
    return {"step": info["step"], "seconds": time.perf_counter() - t0, "source": client.stats().last_load_source}


def _log(progress: Any, record: dict[str, Any]) -> None:
    if progress:
        progress.write(json.dumps(record) + "\n")
        progress.flush()


def _train(args: argparse.Namespace, training: _Training, checkpoints: _Checkpoints | None, step: int, progress: Any) -> dict[int, float]:
    """Train from ``step`` to ``--steps``, saving every step if there is a store; the loss of every step trained."""
    losses: dict[int, float] = {}
    while step < args.steps:
        for x, y in training.loader:
            step += 1
            losses[step] = training.step(x, y)
            record: dict[str, Any] = {"event": "step", "step": step, "loss": losses[step]}
            if checkpoints is not None:
                record["stall"] = checkpoints.save(step, training)
            _log(progress, record)
            if step >= args.steps:
                break
    return losses


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    args = _parse_args(argv)

    import torch
    import torch.distributed as dist

    from trainer_client import CheckpointClient, Connection

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.master_port}", rank=args.rank, world_size=args.world)
    training = _Training(args)

    group = dist.group.WORLD if args.replica_group else None  # DDP: every rank holds the same model and optimizer
    client = None
    if args.store:
        # group=: the ranks agree on the restorable floor at each save, so the stores' retention lists nobody.
        connection = Connection(args.store)
        client = CheckpointClient(args.job, args.rank, args.world, connection=connection, replica_group=group, group=dist.group.WORLD)
    restore: dict[str, Any] = {}
    if args.resume:
        assert client is not None
        restore = _restore(client, training, args.rank)

    progress = open(args.progress, "a") if args.rank == 0 else None  # noqa: SIM115
    if restore:
        _log(progress, {"event": "restored", **restore})
    checkpoints = _Checkpoints(client, args.rank) if client is not None else None
    losses = _train(args, training, checkpoints, restore.get("step", 0), progress)
    committed = checkpoints.finish() if checkpoints is not None else 0.0
    Path(args.out).write_text(json.dumps({
        "rank": args.rank, "digest": training.digest(), "losses": losses, "restore": restore,
        "stalls": [s["stall"] for s in checkpoints.saves] if checkpoints is not None else [],
        "last_commit_seconds": committed, "model_bytes": training.state_bytes(),
        "state_nbytes": checkpoints.state_nbytes if checkpoints is not None else 0,
        "saved_nbytes": checkpoints.saved_nbytes if checkpoints is not None else [],
    }))  # fmt: skip
    if progress:
        progress.close()
    if client is not None:
        client.close()
    _KEEP_ALIVE.append(training.ddp)  # never destroyed: see the __main__ block
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: DDP's reducer destructor joins gloo's worker thread while that thread
    # waits for the GIL to drop the comm hook's Python future, a deadlock seen at exit. Results are
    # written and the process group destroyed already.
    os._exit(code)
