"""GPU capture and restore: a CUDA state into the store's memory and back onto the device, against the copy floors.

    python benchmarks/gpu_capture.py [--device cuda] [--state tensors|model] [--size 1GiB] [--tensors 64] [--layers 12]
        [--dim 2048] [--hosts 1] [--replicas 1] [--saves 50] [--warmup 5] [--loop]
        [--steps 200] [--every 25 | --every 2,10,25] [--batch 8] [--seq 1024] [--json out.json]

Starts a ``--hosts``-host, R=``--replicas`` local cluster on 127.0.0.1 (capacity: twelve times the state plus 512 MiB
per store unless ``--capacity``) and builds the state on ``--device``: ``--state tensors`` (default), ``--tensors``
float32 tensors of ``--size`` bytes; ``--state model``, ``{"model": ..., "optim": ...}`` of a pre-norm transformer of
``--layers`` ``nn.TransformerEncoderLayer`` (d=``--dim``, feed-forward 4d) in bf16 with AdamW after one step (the
token embedding, tied to the output, is a fixed buffer, not saved): 48 tensors per layer, 576 and 3.63 GB by default.

It measures, in one run (medians of 5 for the floors): the D2H floor (``copy_`` of every tensor into one pinned
buffer, then a synchronize) and the H2D floor (the reverse); ``capture="copied"``: the first save of a fresh client,
the first save after ``client.prepare(state)`` on another (``prepare`` timed apart) and the steady stall (median of
``--saves`` after ``--warmup``); ``capture="enqueued"``: until ``save()`` returns (median, max) and until
``wait_captured(block=True)`` returns; ``client.stats().capture`` (registrations after the warm-up, fallbacks to
pageable memory with the last reason); ``handle.superseded``; ``load(map_location=device)`` in this process against
a load to CPU then ``.to(device)``, checked bit for bit; and the same load in a fresh process (after a crash).

``--loop`` times the training loop: the transformer and AdamW on random batches (``--batch`` x ``--seq``) with
``client.gate(optimizer)``, ``--steps`` steps without saves (the baseline), then ``--steps`` per ``k`` of ``--every``
with an enqueued save every ``k`` steps (after ``prepare``), each step timed to a synchronize of the trainer's
stream. It reports the median and mean step time and their ratios to the baseline (the target is on the mean), the
``save()`` return times, the superseded saves and the registrations; then saves the final state, trains two more
gated steps, and checks that the loaded save equals a copy taken before it, bit for bit.

``--device cpu`` is a smoke mode on CPU tensors. The table's targets: steady capture <= 1.1x D2H; enqueued ``save()``
(max) <= 5 ms; restores <= 1.3x H2D; the loop at k=25 <= 1.05x the baseline; no registration after the warm-up (or
``prepare``); no fallback. ``--json`` writes every figure, the device's name, torch's version and the shapes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from memstore.children import child_env, die_with_parent
from memstore.core.sizes import parse_size
from memstore.testing import LocalCluster
from trainer_client import CheckpointClient, Connection
from trainer_client.errors import NotFoundError

JOB = "gpu-capture"
ALIGN = 64  # byte offset of each tensor in the floors' flat buffer (any dtype's view of a slice needs it aligned)
RESULT_TAG = "RESTORE-RESULT "  # the --restore-only process's result line on stdout


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def sync(device: torch.device) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if is_cuda(device) else "cpu"


def map_location(device: torch.device) -> torch.device | None:
    return device if is_cuda(device) else None


# --------------------------------------------------------------------------------------
# state trees
# --------------------------------------------------------------------------------------


def tensors_of(tree: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a nested dict/list/tuple, with its path."""
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from tensors_of(v, f"{path}/{k}")
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            yield from tensors_of(v, f"{path}/{i}")


def tree_map(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: tree_map(fn, v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(tree_map(fn, v) for v in tree)
    return tree


def nbytes_of(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors_of(tree))


def mismatches(expected: Any, got: Any, path: str = "") -> list[str]:
    """Paths where ``got`` differs from ``expected``: tensors by dtype, shape and ``torch.equal`` (on one device),
    other values by ``==``; empty when they are equal bit for bit."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.dtype != expected.dtype or got.shape != expected.shape:
            return [path]
        return [] if torch.equal(expected.to(got.device), got) else [path]
    if isinstance(expected, dict):
        if not isinstance(got, dict) or set(got) != set(expected):
            return [f"{path} (keys)"]
        return [m for k in expected for m in mismatches(expected[k], got[k], f"{path}/{k}")]
    if isinstance(expected, list | tuple):
        if not isinstance(got, list | tuple) or len(got) != len(expected):
            return [f"{path} (length)"]
        return [m for i, (e, g) in enumerate(zip(expected, got, strict=True)) for m in mismatches(e, g, f"{path}/{i}")]
    return [] if expected == got else [path]


# --------------------------------------------------------------------------------------
# the states
# --------------------------------------------------------------------------------------


def build_tensors(size: int, tensors: int, device: torch.device) -> dict[str, torch.Tensor]:
    each = max(1, size // tensors // 4)
    g = torch.Generator(device=device).manual_seed(0)
    return {f"t{i}": torch.randn(each, device=device, generator=g) for i in range(tensors)}


class Transformer(nn.Module):
    """``layers`` pre-norm encoder layers between a fixed token embedding and its tied output projection."""

    embedding: torch.Tensor

    def __init__(self, layers: int, dim: int, heads: int, vocab: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu", batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        # Neither trained nor saved: the state is the layers' (12 tensors a layer) and AdamW's.
        self.register_buffer("embedding", torch.randn(vocab, dim) / math.sqrt(dim), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding[tokens]
        seq = tokens.shape[1]
        mask = torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).triu(1)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return x @ self.embedding.T


class Trainer:
    """The transformer, AdamW and random token batches: one ``step()`` is forward, backward, optimizer step."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        torch.manual_seed(0)
        self.device = device
        self.vocab, self.batch, self.seq = args.vocab, args.batch, args.seq
        self.model = Transformer(args.layers, args.dim, args.heads, args.vocab).to(device=device, dtype=torch.bfloat16)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.generator = torch.Generator(device=device).manual_seed(1)

    def step(self) -> None:
        tokens = torch.randint(self.vocab, (self.batch, self.seq + 1), device=self.device, generator=self.generator)
        logits = self.model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}


def describe(args: argparse.Namespace, state: Any, trainer: Trainer | None) -> dict[str, Any]:
    tensors = [t for _, t in tensors_of(state)]
    dtypes: dict[str, int] = {}
    for t in tensors:
        dtypes[str(t.dtype).removeprefix("torch.")] = dtypes.get(str(t.dtype).removeprefix("torch."), 0) + 1
    shape: dict[str, Any] = {
        "kind": args.state, "tensors": len(tensors), "bytes": nbytes_of(state), "dtypes": dtypes,
        "device_tensors": sum(1 for t in tensors if t.device.type != "cpu"),
        "largest_tensor_bytes": max((t.numel() * t.element_size() for t in tensors), default=0),
    }  # fmt: skip
    if trainer is not None:
        shape.update(layers=args.layers, dim=args.dim, heads=args.heads, vocab=args.vocab, param_dtype="bfloat16",
                     params=sum(p.numel() for p in trainer.model.parameters()), optimizer="AdamW")  # fmt: skip
    else:
        shape.update(size=args.size, float32_tensors=args.tensors)
    return shape


# --------------------------------------------------------------------------------------
# floors
# --------------------------------------------------------------------------------------


class Floors:
    """The state's tensors laid out in one host buffer (pinned on CUDA, plain on CPU) at aligned offsets."""

    def __init__(self, state: Any, device: torch.device) -> None:
        self.device = device
        self.tensors = [t for _, t in tensors_of(state)]
        self.slots: list[tuple[int, int]] = []
        offset = 0
        for t in self.tensors:
            n = t.numel() * t.element_size()
            self.slots.append((offset, n))
            offset += (n + ALIGN - 1) // ALIGN * ALIGN
        self.buffer = torch.empty(max(1, offset), dtype=torch.uint8, pin_memory=is_cuda(device))
        # Each tensor's slot as a tensor of its dtype and shape, made once: the floors time the copies alone.
        self.views = [self.buffer[o : o + n].view(t.dtype).view(t.shape) for (o, n), t in zip(self.slots, self.tensors, strict=True)]

    def _median(self, copy: Callable[[], None], reps: int) -> float:
        times = []
        for _ in range(reps):
            sync(self.device)
            started = time.perf_counter()
            copy()
            sync(self.device)
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    def d2h(self, reps: int = 5) -> float:
        """Every tensor into its slot of the host buffer, then a synchronize."""

        def copy() -> None:
            for view, t in zip(self.views, self.tensors, strict=True):
                view.copy_(t, non_blocking=True)

        return self._median(copy, reps)

    def h2d(self, reps: int = 5) -> float:
        """Every slot of the host buffer into a preallocated tensor of its shape on the device, then a synchronize."""
        dests = [torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in self.tensors]

        def copy() -> None:
            for dest, view in zip(dests, self.views, strict=True):
                dest.copy_(view, non_blocking=True)

        return self._median(copy, reps)


# --------------------------------------------------------------------------------------
# capture and restore
# --------------------------------------------------------------------------------------


class Steps:
    """Step numbers of the run's one job: increasing across every client of the run."""

    def __init__(self) -> None:
        self.last = 0

    def next(self) -> int:
        self.last += 1
        return self.last


class Outcomes:
    """How a run's saves ended: ``handle.wait()`` on each, as soon as it is done (``poll``) or at the end.

    A handle must be asked before retention (``--keep`` steps) drops its step from the store, so the loop polls
    its pending handles between steps (untimed); a step dropped before it was asked counts as ``gone``.
    """

    def __init__(self) -> None:
        self.pending: list[Any] = []
        self.saves = self.superseded = self.failed = self.gone = 0
        self.errors: list[str] = []

    def add(self, handle: Any) -> None:
        self.saves += 1
        self.pending.append(handle)

    def settle(self, handle: Any) -> None:
        if handle in self.pending:
            self.pending.remove(handle)
        try:
            handle.wait(timeout=600)
        except NotFoundError as exc:
            self.gone += 1
            self.errors.append(f"step {handle.step}: {exc}")
        except Exception as exc:  # reported, not raised: the other figures still count
            if handle.superseded:  # skipped in favour of a newer save: an outcome, not a failure
                self.superseded += 1
                return
            self.failed += 1
            self.errors.append(f"step {handle.step}: {exc}")
        else:
            self.superseded += bool(handle.superseded)

    def wait(self, handle: Any) -> None:
        """Count ``handle`` and wait for it now."""
        self.add(handle)
        self.settle(handle)

    def poll(self) -> None:
        for handle in list(self.pending):
            try:
                done = handle.done()
            except Exception:  # wait() says what it was
                done = True
            if done:
                self.settle(handle)

    def finish(self) -> dict[str, Any]:
        for handle in list(self.pending):
            self.settle(handle)
        return {"saves": self.saves, "superseded": self.superseded, "failed_saves": self.failed, "gone_saves": self.gone,
                "save_errors": self.errors[:5]}  # fmt: skip


def copied_save(client: CheckpointClient, step: int, state: Any, device: torch.device) -> tuple[float, Any]:
    sync(device)
    started = time.perf_counter()
    handle = client.save(step, state, capture="copied")
    return time.perf_counter() - started, handle


def measure_capture(args: argparse.Namespace, state: Any, device: torch.device, address: str, steps: Steps, out: dict[str, Any]) -> None:
    nbytes, floor = out["bytes"], out["floor_seconds"]
    outcomes = Outcomes()
    fallbacks = 0
    with CheckpointClient(JOB, 0, 1, connection=Connection(address)) as client:
        first, handle = copied_save(client, steps.next(), state, device)
        outcomes.wait(handle)
        for _ in range(args.warmup):
            _, handle = copied_save(client, steps.next(), state, device)
            outcomes.wait(handle)
        before = client.stats().capture.registrations
        stalls = []
        for _ in range(args.saves):
            stall, handle = copied_save(client, steps.next(), state, device)
            stalls.append(stall)
            outcomes.wait(handle)
        registrations_copied = client.stats().capture.registrations - before

        returned, captured = [], []
        for i in range(args.warmup + args.saves):
            if i == args.warmup:
                before = client.stats().capture.registrations
            sync(device)
            started = time.perf_counter()
            handle = client.save(steps.next(), state, capture="enqueued")
            ret = time.perf_counter() - started
            handle.wait_captured(block=True)
            cap = time.perf_counter() - started
            outcomes.wait(handle)
            if i >= args.warmup:
                returned.append(ret)
                captured.append(cap)
        registrations_enqueued = client.stats().capture.registrations - before
        stats = client.stats().capture
        fallbacks += stats.fallbacks
        out.update(registrations=stats.registrations, last_fallback=stats.last_fallback)

    steady = statistics.median(stalls)
    enq_captured = statistics.median(captured)
    out.update(
        copied_first_seconds=first, copied_first_gbps=gbps(nbytes, first), copied_first_vs_floor=first / floor,
        copied_steady_seconds=steady, copied_steady_gbps=gbps(nbytes, steady), copied_steady_vs_floor=steady / floor,
        copied_steady_max_seconds=max(stalls),
        enqueued_return_seconds=statistics.median(returned), enqueued_return_max_seconds=max(returned),
        enqueued_captured_seconds=enq_captured, enqueued_captured_gbps=gbps(nbytes, enq_captured),
        enqueued_captured_vs_floor=enq_captured / floor,
        registrations_steady_copied=registrations_copied, registrations_steady_enqueued=registrations_enqueued,
        registrations_steady=registrations_copied + registrations_enqueued,
    )  # fmt: skip

    # A fresh client, its first save after prepare(); then the restores of that save.
    with CheckpointClient(JOB, 0, 1, connection=Connection(address)) as client:
        sync(device)
        started = time.perf_counter()
        client.prepare(state)
        prepare = time.perf_counter() - started
        step = steps.next()
        prepared, handle = copied_save(client, step, state, device)
        outcomes.wait(handle)
        stats = client.stats().capture
        fallbacks += stats.fallbacks
        out["last_fallback"] = stats.last_fallback or out["last_fallback"]
        out.update(
            prepare_seconds=prepare, prepared_first_seconds=prepared, prepared_first_gbps=gbps(nbytes, prepared),
            prepared_first_vs_floor=prepared / floor, restored_step=step,
        )  # fmt: skip
        measure_restore(client, step, state, device, out)

    out.update(fallbacks=fallbacks, **outcomes.finish())


def measure_restore(client: CheckpointClient, step: int, state: Any, device: torch.device, out: dict[str, Any]) -> None:
    nbytes, h2d = out["bytes"], out["h2d_floor_seconds"]
    loads, pageable = [], []
    for rep in range(3):
        sync(device)
        started = time.perf_counter()
        restored = client.load(step, map_location=map_location(device))
        sync(device)  # load() returns once its copies are done; this only makes sure
        loads.append(time.perf_counter() - started)
        if rep == 0:
            bad = mismatches(state, restored)
            out.update(restore_bit_exact=not bad, restore_mismatches=bad[:10])
        del restored
        started = time.perf_counter()
        on_cpu = client.load(step)
        moved = tree_map(lambda t: t.to(device), on_cpu)
        sync(device)
        pageable.append(time.perf_counter() - started)
        del on_cpu, moved
    load, then_to = statistics.median(loads), statistics.median(pageable)
    out.update(
        load_seconds=load, load_gbps=gbps(nbytes, load), load_vs_h2d_floor=load / h2d,
        load_cpu_then_to_seconds=then_to, load_cpu_then_to_gbps=gbps(nbytes, then_to),
    )  # fmt: skip


def fresh_restore(args: argparse.Namespace, address: str, step: int, device: torch.device, out: dict[str, Any]) -> None:
    """This script with --restore-only in a new process: connect to the running cluster and load ``step``."""
    cmd = [sys.executable, os.path.abspath(__file__), "--restore-only", "--store", address, "--step", str(step), "--device", str(device)]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **child_env()})
    total = time.perf_counter() - started
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"--restore-only exited with {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    child = json.loads(lines[-1][len(RESULT_TAG) :])
    out["fresh_restore"] = {**child, "process_seconds": total}
    out.update(
        fresh_load_seconds=child["load_seconds"], fresh_load_gbps=gbps(out["bytes"], child["load_seconds"]),
        fresh_load_vs_h2d_floor=child["load_seconds"] / out["h2d_floor_seconds"], fresh_process_seconds=total,
        fresh_restore_complete=child["tensors"] == out["state"]["tensors"] and child["bytes"] == out["bytes"],
    )  # fmt: skip


def restore_only(args: argparse.Namespace) -> None:
    """The --restore-only process: what a restarted trainer does, timed, with the result as one JSON line."""
    die_with_parent()
    device = resolve_device(args.device)
    started = time.perf_counter()
    if is_cuda(device):
        torch.empty(1, device=device)  # CUDA's context, before the load is timed
    cuda_init = time.perf_counter() - started
    started = time.perf_counter()
    with CheckpointClient(JOB, 0, 1, connection=Connection(args.store)) as client:
        connect = time.perf_counter() - started
        sync(device)
        started = time.perf_counter()
        restored = client.load(args.step, map_location=map_location(device))
        sync(device)
        load = time.perf_counter() - started
        result = {"load_seconds": load, "connect_seconds": connect, "cuda_init_seconds": cuda_init, "step": args.step,
                  "tensors": sum(1 for _ in tensors_of(restored)), "bytes": nbytes_of(restored),
                  "source": client.stats().last_load_source}  # fmt: skip
    print(RESULT_TAG + json.dumps(result), flush=True)


# --------------------------------------------------------------------------------------
# the training loop
# --------------------------------------------------------------------------------------


def timed_steps(trainer: Trainer, steps: int, every: int, client: CheckpointClient | None, step_no: Steps) -> dict[str, Any]:
    """``steps`` training steps, each timed to a synchronize of the trainer's stream, with an enqueued save
    every ``every`` steps (0: none)."""
    device = trainer.device
    stream = torch.cuda.current_stream(device) if is_cuda(device) else None
    times, returns = [], []
    outcomes = Outcomes()
    for i in range(steps):
        started = time.perf_counter()
        trainer.step()
        if every and client is not None and (i + 1) % every == 0:
            saving = time.perf_counter()
            outcomes.add(client.save(step_no.next(), trainer.state(), capture="enqueued"))
            returns.append(time.perf_counter() - saving)
        if stream is not None:
            stream.synchronize()  # for timing only: the trainer's stream, not the capture's side stream
        times.append(time.perf_counter() - started)
        outcomes.poll()  # untimed: a save's outcome must be read before retention drops its step
    run: dict[str, Any] = {
        "every": every, "steps": steps, "median_step_seconds": statistics.median(times),
        "mean_step_seconds": statistics.fmean(times), "max_step_seconds": max(times), **outcomes.finish(),
    }  # fmt: skip
    if returns:
        run.update(save_return_median_seconds=statistics.median(returns), save_return_max_seconds=max(returns))
    return run


def measure_loop(args: argparse.Namespace, trainer: Trainer, address: str, steps: Steps, out: dict[str, Any]) -> None:
    loop: dict[str, Any] = {"batch": args.batch, "seq": args.seq, "steps": args.steps, "every": args.every, "warmup_steps": args.warmup}
    with CheckpointClient(JOB, 0, 1, connection=Connection(address)) as client:
        gate = client.gate(trainer.optimizer)
        for _ in range(args.warmup):
            trainer.step()
        sync(trainer.device)
        baseline = timed_steps(trainer, args.steps, 0, None, steps)
        loop["baseline"] = baseline
        client.prepare(trainer.state())
        before = client.stats().capture.registrations
        loop["runs"] = []
        for k in args.every:
            run = timed_steps(trainer, args.steps, k, client, steps)
            run.update(ratio_median=run["median_step_seconds"] / baseline["median_step_seconds"],
                       ratio_mean=run["mean_step_seconds"] / baseline["mean_step_seconds"])  # fmt: skip
            loop["runs"].append(run)
        loop["registrations_during_runs"] = client.stats().capture.registrations - before  # after prepare(): target 0

        # The final state: saved enqueued, two more gated steps, then the save must equal the copy taken before it.
        expected = tree_map(lambda t: t.detach().clone(), trainer.state())
        step = steps.next()
        handle = client.save(step, trainer.state(), capture="enqueued")
        for _ in range(2):
            trainer.step()
        handle.wait(timeout=600)
        restored = client.load(step, map_location=map_location(trainer.device))
        bad = mismatches(expected, restored)
        loop.update(final_step=step, final_bit_exact=not bad, final_mismatches=bad[:10],
                    final_tensors_compared=sum(1 for _ in tensors_of(expected)))  # fmt: skip
        del restored, expected
        stats = client.stats().capture
        loop.update(registrations=stats.registrations, fallbacks=stats.fallbacks)
        out["fallbacks"] += stats.fallbacks
        out["last_fallback"] = stats.last_fallback or out["last_fallback"]
        gate.remove()
    out["loop"] = loop


# --------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[tuple[str, float, str, bool | None]] = [
        ("steady capture (copied) / D2H floor", r["copied_steady_vs_floor"], "<= 1.1x", r["copied_steady_vs_floor"] <= 1.1),
        ("enqueued save() returns, max (ms)", r["enqueued_return_max_seconds"] * 1e3, "<= 5 ms", r["enqueued_return_max_seconds"] <= 0.005),
        ("restore, this process / H2D floor", r["load_vs_h2d_floor"], "<= 1.3x", r["load_vs_h2d_floor"] <= 1.3),
        ("restore, fresh process / H2D floor", r["fresh_load_vs_h2d_floor"], "<= 1.3x", r["fresh_load_vs_h2d_floor"] <= 1.3),
    ]
    for run in r.get("loop", {}).get("runs", []):
        k = run["every"]
        judged = k == 25 and run["saves"] > 0  # (a run shorter than k saves nothing)
        rows.append(
            (
                f"loop k={k}, mean step / baseline",
                run["ratio_mean"],
                "<= 1.05x" if judged else "",
                run["ratio_mean"] <= 1.05 if judged else None,
            )
        )
    if "loop" in r:
        during = r["loop"]["registrations_during_runs"]
        rows.append(("loop: registrations after prepare()", during, "== 0", during == 0))
    rows += [
        ("registrations after the warm-up", r["registrations_steady"], "== 0", r["registrations_steady"] == 0),
        ("fallbacks to pageable memory", r["fallbacks"], "== 0", r["fallbacks"] == 0),
    ]
    return [{"figure": f, "value": v, "target": t, "pass": p} for f, v, t, p in rows]


def run(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    trainer = None
    if args.state == "model":
        trainer = Trainer(args, device)
        trainer.step()  # one real optimizer step: AdamW's moments and step counts exist
        state: Any = trainer.state()
    else:
        state = build_tensors(parse_size(args.size), args.tensors, device)
    sync(device)
    nbytes = nbytes_of(state)
    shape = describe(args, state, trainer)
    print(f"state: {shape['tensors']} tensors, {nbytes / 1e9:.3f} GB ({nbytes / (1 << 20):.1f} MiB) on {device}", flush=True)
    floors = Floors(state, device)
    d2h, h2d = floors.d2h(), floors.h2d()
    del floors
    capacity = args.capacity or str(12 * nbytes + (512 << 20))  # the capture ring (--keep + 4 segments) and the peers' copies
    out: dict[str, Any] = {
        "device": device_name(device), "device_type": device.type, "torch": torch.__version__, "python": platform.python_version(),
        "config": {k: v for k, v in vars(args).items() if k not in ("restore_only", "store", "step")},
        "cluster": {"hosts": args.hosts, "replicas": args.replicas, "capacity": capacity},
        "state": shape, "bytes": nbytes, "tensors": shape["tensors"],
        "floor_seconds": d2h, "floor_gbps": gbps(nbytes, d2h), "h2d_floor_seconds": h2d, "h2d_floor_gbps": gbps(nbytes, h2d),
        "floor_kind": "pinned" if is_cuda(device) else "plain",
    }  # fmt: skip
    steps = Steps()
    with LocalCluster(hosts=args.hosts, replicas=args.replicas, capacity=capacity) as cluster:
        address = cluster.address("h0")
        measure_capture(args, state, device, address, steps, out)
        fresh_restore(args, address, out["restored_step"], device, out)
        if args.loop:
            if trainer is None:
                del state
                trainer = Trainer(args, device)
                trainer.step()
            measure_loop(args, trainer, address, steps, out)
    out["targets"] = targets(out)
    out["all_pass"] = all(t["pass"] is not False for t in out["targets"])
    return out


def print_table(r: dict[str, Any]) -> None:
    s = r["state"]
    print(f"{r['device']} (torch {r['torch']}): {s['tensors']} tensors ({s['kind']}), {r['bytes'] / 1e9:.3f} GB; "
          f"cluster {r['cluster']['hosts']} hosts, R={r['cluster']['replicas']}")  # fmt: skip
    floor, h2d = r["floor_seconds"], r["h2d_floor_seconds"]
    rows = [
        (f"floor: D2H into {r['floor_kind']} memory", floor, r["floor_gbps"], 1.0),
        ('save capture="copied", first', r["copied_first_seconds"], r["copied_first_gbps"], r["copied_first_vs_floor"]),
        ("client.prepare(state), fresh client", r["prepare_seconds"], None, None),
        ('  ... then save capture="copied"', r["prepared_first_seconds"], r["prepared_first_gbps"], r["prepared_first_vs_floor"]),
        ('save capture="copied", steady', r["copied_steady_seconds"], r["copied_steady_gbps"], r["copied_steady_vs_floor"]),
        ('save capture="enqueued": returns', r["enqueued_return_seconds"], None, None),
        ("  ... returns, max", r["enqueued_return_max_seconds"], None, None),
        ("  ... wait_captured(block=True)", r["enqueued_captured_seconds"], r["enqueued_captured_gbps"], r["enqueued_captured_vs_floor"]),
        (f"floor: H2D from {r['floor_kind']} memory", h2d, r["h2d_floor_gbps"], 1.0),
        (
            f"load(map_location={'device' if r['device_type'] == 'cuda' else 'None'})",
            r["load_seconds"],
            r["load_gbps"],
            r["load_vs_h2d_floor"],
        ),
        ("  ... in a fresh process", r["fresh_load_seconds"], r["fresh_load_gbps"], r["fresh_load_vs_h2d_floor"]),
        (
            "load() then .to(device) (pageable)",
            r["load_cpu_then_to_seconds"],
            r["load_cpu_then_to_gbps"],
            h2d and r["load_cpu_then_to_seconds"] / h2d,
        ),
    ]
    print(f"{'':40} {'ms':>10} {'GB/s':>8} {'x floor':>8}")
    for name, seconds, rate, ratio in rows:
        rate_s = f"{rate:8.2f}" if rate is not None else f"{'':8}"
        ratio_s = f"{ratio:8.2f}" if ratio is not None else f"{'':8}"
        print(f"{name:40} {seconds * 1e3:10.2f} {rate_s} {ratio_s}")
    fresh = r["fresh_restore"]
    print(f"fresh process: {r['fresh_process_seconds']:.2f} s in all (CUDA init {fresh['cuda_init_seconds'] * 1e3:.0f} ms, "
          f"connect {fresh['connect_seconds'] * 1e3:.0f} ms); restored state complete: {r['fresh_restore_complete']}")  # fmt: skip
    print(f"registrations (cudaHostRegister): {r['registrations']} by the first client, {r['registrations_steady']} after the "
          f"warm-up; fallbacks: {r['fallbacks']}{' (last: ' + r['last_fallback'] + ')' if r['last_fallback'] else ''}")  # fmt: skip
    print(f"saves: {r['saves']}, superseded {r['superseded']}, failed {r['failed_saves']}; restore bit-exact: {r['restore_bit_exact']}")
    loop = r.get("loop")
    if loop:
        print(f"\nloop: batch {loop['batch']} x seq {loop['seq']}, {loop['steps']} steps per run")
        print(
            f"{'':14} {'median ms':>10} {'mean ms':>10} {'x median':>9} {'x mean':>8} {'saves':>6} {'superseded':>10} {'save() max ms':>14}"
        )
        b = loop["baseline"]
        print(f"{'no saves':14} {b['median_step_seconds'] * 1e3:10.2f} {b['mean_step_seconds'] * 1e3:10.2f}")
        for run in loop["runs"]:
            print(f"{'every ' + str(run['every']):14} {run['median_step_seconds'] * 1e3:10.2f} {run['mean_step_seconds'] * 1e3:10.2f} "
                  f"{run['ratio_median']:9.3f} {run['ratio_mean']:8.3f} {run['saves']:6d} {run['superseded']:10d} "
                  f"{run.get('save_return_max_seconds', 0.0) * 1e3:14.2f}")  # fmt: skip
        print(f"registrations during the runs (after prepare()): {loop['registrations_during_runs']}; "
              f"final state restores bit-exactly ({loop['final_tensors_compared']} tensors): {loop['final_bit_exact']}")  # fmt: skip
    print(f"\n{'figure':40} {'value':>10} {'target':>9}  result")
    for t in r["targets"]:
        verdict = "" if t["pass"] is None else "PASS" if t["pass"] else "MISS"
        value = f"{t['value']:10d}" if isinstance(t["value"], int) else f"{t['value']:10.3f}"
        print(f"{t['figure']:40} {value} {t['target']:>9}  {verdict}")


def resolve_device(text: str) -> torch.device:
    device = torch.device(text)
    if is_cuda(device):
        if not torch.cuda.is_available():
            sys.exit("benchmarks/gpu_capture.py needs a CUDA device, and torch.cuda.is_available() is False here")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        sys.exit(f"--device {text}: expected cuda, cuda:N or cpu")
    return device


def every_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--every {text!r}: expected positive step counts, e.g. 25 or 2,10,25")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (a smoke mode without CUDA)")
    p.add_argument("--state", choices=("tensors", "model"), default="tensors")
    p.add_argument("--size", default="1GiB", help="--state tensors: bytes of state (suffixes: MiB, GiB)")
    p.add_argument("--tensors", type=int, default=64, help="--state tensors: how many float32 tensors")
    p.add_argument("--layers", type=int, default=12, help="transformer layers (--state model, --loop)")
    p.add_argument("--dim", type=int, default=2048, help="transformer width d")
    p.add_argument("--heads", type=int, help="attention heads (default: d/128, at least 1)")
    p.add_argument("--vocab", type=int, default=8192, help="token vocabulary of the fixed embedding")
    p.add_argument("--hosts", type=int, default=1, help="stores of the local cluster")
    p.add_argument("--replicas", type=int, default=1, help="R: copies of each save")
    p.add_argument("--capacity", help="each store's --capacity (default: 12x the state + 512 MiB: the capture ring and the peers' copies)")
    p.add_argument("--saves", type=int, default=50, help="steady saves per capture mode, after the warm-up")
    p.add_argument("--warmup", type=int, default=5, help="warm-up saves per capture mode (and untimed loop steps)")
    p.add_argument("--loop", action="store_true", help="also run the training loop benchmark")
    p.add_argument("--steps", type=int, default=200, help="--loop: timed steps per run")
    p.add_argument("--every", type=every_list, default=[25], help="--loop: save every k steps; a list runs each (2,10,25)")
    p.add_argument("--batch", type=int, help="--loop: sequences per batch (default: 8 on CUDA, 4 on CPU)")
    p.add_argument("--seq", type=int, help="--loop: tokens per sequence (default: 1024 on CUDA, 64 on CPU)")
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--restore-only", action="store_true", help=argparse.SUPPRESS)  # the fresh process of the restore
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--step", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.saves < 1 or args.warmup < 0 or args.steps < 1 or args.layers < 1 or args.dim < 1:
        p.error("--saves, --steps, --layers and --dim must be >= 1, --warmup >= 0")
    args.heads = args.heads or max(1, args.dim // 128)
    if args.dim % args.heads:
        p.error(f"--dim {args.dim} is not a multiple of --heads {args.heads}")
    cpu = args.device == "cpu"
    args.batch = args.batch or (4 if cpu else 8)
    args.seq = args.seq or (64 if cpu else 1024)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a terminated run still stops its cluster
    if args.restore_only:
        restore_only(args)
        return
    device = resolve_device(args.device)
    result = run(args, device)
    print_table(result)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
