"""The deterministic state of one rank at one step, and a byte-for-byte comparison of two states."""

from __future__ import annotations

from typing import Any

import torch


def make_state(rank: int, step: int, kib: int = 64) -> dict[str, Any]:
    """About ``kib`` KiB of tensors plus plain values; the same (rank, step) always gives the same bytes."""
    g = torch.Generator().manual_seed(rank * 100_003 + step)
    return {
        "model": {"weight": torch.randn(kib * 128, 2, generator=g), "bias": torch.randn(16, generator=g).to(torch.bfloat16)},
        "optim": {"exp_avg": torch.randn(kib * 64, 2, generator=g), "step": torch.tensor(float(step))},
        "step": step,
        "rank": rank,
    }


def difference(a: Any, b: Any, path: str = "state") -> str | None:
    """Where ``a`` and ``b`` differ (dtype, shape, a byte, a key, a value), or None if they are the same bytes."""
    if type(a) is not type(b):
        return f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        if a.numel() and not torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)):
            return f"{path}: bytes differ"
        return None
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{path}: keys {list(a)} != {list(b)}"
        return next((d for k in a if (d := difference(a[k], b[k], f"{path}[{k!r}]"))), None)
    return None if a == b else f"{path}: {a!r} != {b!r}"
