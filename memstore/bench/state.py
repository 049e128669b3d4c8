"""The benchmarked training state, its fingerprint, and the copy every ratio is measured against."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MiB = 1 << 20
GiB = 1 << 30
LAYOUT = "4 layers x (weight, exp_avg, exp_avg_sq) + 4 scalar step tensors, float32, torch.rand; one rank of world size 1"


def make_state(nbytes: int, seed: int) -> dict[str, Any]:
    """A model + Adam-like state of ``nbytes`` float32 bytes: 4 layers x (weight, exp_avg, exp_avg_sq), random."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    layers = 4
    total = max(nbytes // 4, 3 * layers)
    base = total // (3 * layers)
    sizes = [base] * (3 * layers)
    sizes[-1] += total - base * 3 * layers
    made = iter([torch.rand(n, generator=gen) for n in sizes])
    model = {f"layers.{i}.weight": next(made) for i in range(layers)}
    optim_state = {i: {"step": torch.tensor(100.0), "exp_avg": next(made), "exp_avg_sq": next(made)} for i in range(layers)}
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": list(range(layers))}]
    return {"model": model, "optim": {"state": optim_state, "param_groups": groups}, "step": 100}


def tensors_of(state: Any) -> list[torch.Tensor]:
    """Every tensor of a nested dict/list state, in order."""
    import torch

    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in tensors_of(v)]
    if isinstance(state, list | tuple):
        return [t for v in state for t in tensors_of(v)]
    return []


def nbytes_of(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def prefaulted(nbytes: int) -> torch.Tensor:
    """A uint8 buffer whose every page is touched once: pre-faulted, like the store's pooled segments."""
    import torch

    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.fill_(1)
    return dst


def copy_all(dst: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """torch ``copy_`` of every tensor, back to back, into the uint8 buffer ``dst``: the memcpy baseline."""
    off = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        dst[off : off + n].view(t.dtype).copy_(t.reshape(-1))
        off += n


def fingerprint(state: Any) -> str:
    """xxh3-128 over the state's structure, non-tensor leaves and every tensor's dtype, shape and bytes: a restore in
    another process is verified by comparing fingerprints, without shipping the tensors back."""
    import torch
    import xxhash

    h = xxhash.xxh3_128()

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            t = v.detach().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)};".encode())
            if t.numel():
                h.update(t.reshape(-1).view(torch.uint8).numpy().data)
        elif isinstance(v, dict):
            h.update(f"{{{len(v)};".encode())
            for k, x in v.items():
                h.update(f"{type(k).__name__}:{k!r}=".encode())
                walk(x)
        elif isinstance(v, list | tuple):
            h.update(f"{type(v).__name__}[{len(v)};".encode())
            for x in v:
                walk(x)
        else:
            h.update(f"{type(v).__name__}:{v!r};".encode())

    walk(state)
    return h.hexdigest()


def p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def short_size(n: int) -> str:
    for unit, name in ((GiB, "GiB"), (MiB, "MiB")):
        if n % unit == 0:
            return f"{n // unit}{name}"
    return f"{n}B"


def module_env() -> dict[str, str]:
    """Environment for the bench's child processes (``python -m memstore.bench.X``): this memstore importable first."""
    import os
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env
