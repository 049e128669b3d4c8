"""One trainer rank of ``memstore demo``: a tiny transformer language model trained with DDP over gloo.

Run by the demo as ``python -m memstore.demo_worker --rank R ...``. Every step it checkpoints the
whole training state (model, AdamW, LR schedule, RNGs, data position) into the host's store; with
``--resume`` it first restores the newest step restorable for every rank and continues from there.
Rank 0 appends one JSON line per step to ``--progress``; every rank writes a digest of its final
weights to ``--out``.
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="memstore.demo_worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--store", default="", help="this host's store; empty = reference run without checkpoints")
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="tiny")
    p.add_argument("--job", default="demo")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--progress", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from trainer_client import CheckpointClient
    from trainer_client.errors import ReplicationError
    from trainer_client.training_state import ResumableDataLoader, TrainingState

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.master_port}", rank=args.rank, world_size=args.world)
    d_model, layers, heads, context = MODEL_SIZES[args.model_size]

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

    corpus = torch.tensor(synthetic_corpus(20_000), dtype=torch.long)
    windows = [(corpus[i : i + context], corpus[i + 1 : i + context + 1]) for i in range(0, len(corpus) - context - 1, context // 2)]

    torch.manual_seed(0)  # identical initial weights on every rank
    model = TinyLM()
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, _per_parameter_allreduce)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    warmup = 5
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
    )
    loader = ResumableDataLoader(windows, batch_size=8, shuffle=True, seed=17, rank=args.rank, world_size=args.world)  # type: ignore[arg-type]
    ts = TrainingState(model=model, optimizer=opt, scheduler=sched, loader=loader)
    torch.manual_seed(1000 + args.rank)  # dropout differs per rank, as in real data-parallel runs
    random.seed(1000 + args.rank)

    client = CheckpointClient(args.job, args.rank, args.world, store=args.store) if args.store else None
    step = 0
    restore: dict[str, Any] = {}
    if args.resume:
        assert client is not None
        t0 = time.perf_counter()
        latest = client.latest_step()
        if latest is None:
            print(f"rank {args.rank}: nothing to resume from", file=sys.stderr)
            return 3
        info = ts.restore(client.load(latest))
        step = info["step"]
        restore = {"step": step, "seconds": time.perf_counter() - t0, "source": client.last_load_source}

    progress = open(args.progress, "a") if args.rank == 0 else None  # noqa: SIM115
    pending = None
    saves: list[dict[str, float]] = []
    losses: dict[int, float] = {}
    if progress and restore:
        progress.write(json.dumps({"event": "restored", **restore}) + "\n")
        progress.flush()
    while step < args.steps:
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            logits = ddp(x)
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            losses[step] = loss.item()
            record: dict[str, Any] = {"event": "step", "step": step, "loss": losses[step]}
            if client is not None:
                if pending is not None:
                    t0 = time.perf_counter()
                    try:
                        pending.wait(timeout=120)  # the previous step had a whole step to replicate
                    except ReplicationError as exc:  # still restorable from fewer copies; repair catches up
                        print(f"rank {args.rank}: {exc}", file=sys.stderr, flush=True)
                    saves[-1]["wait"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                pending = client.save(step, ts.capture(step=step, epoch=loader.epoch))
                saves.append({"stall": pending.stall_seconds, "t0": t0})
                record["stall"] = pending.stall_seconds
            if progress:
                progress.write(json.dumps(record) + "\n")
                progress.flush()
            if step >= args.steps:
                break
    committed = 0.0
    if pending is not None:
        t0 = time.perf_counter()
        pending.wait(timeout=120)
        committed = time.perf_counter() - saves[-1]["t0"]
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(value.detach().contiguous().view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    state_bytes = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    Path(args.out).write_text(json.dumps({
        "rank": args.rank, "digest": digest.hexdigest(), "losses": losses, "restore": restore,
        "stalls": [s["stall"] for s in saves], "last_commit_seconds": committed, "model_bytes": state_bytes,
    }))  # fmt: skip
    if progress:
        progress.close()
    if client is not None:
        client.close()
    _KEEP_ALIVE.append(ddp)  # never destroyed: see the __main__ block
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
