"""Deterministic training-like states for tests: the same (rank, step) always gives the same bytes."""

from __future__ import annotations

import collections
from typing import Any

import torch


def rank_state(rank: int, step: int, scale: int = 1) -> dict[str, Any]:
    g = torch.Generator().manual_seed(rank * 100_003 + step)
    model = collections.OrderedDict(
        weight=torch.randn(64 * scale, 32, generator=g),
        bias=torch.randn(32, generator=g).to(torch.bfloat16),
        embed=torch.randint(-1000, 1000, (16, 8), generator=g, dtype=torch.int64).t(),  # non-contiguous
        empty=torch.zeros(0, 3),
        mask=torch.rand(10, generator=g) > 0.5,
    )
    optim = {
        "state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(64 * scale, 32, generator=g)}},
        "param_groups": [{"lr": 1e-3, "params": [0]}],
    }
    return {"model": model, "optim": optim, "step": step, "rank": rank, "name": f"r{rank}", "blob": bytes([rank, step % 256])}


def assert_same(a: Any, b: Any, path: str = "state") -> None:
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        if a.numel():
            assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)), path
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys differ"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length differs"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def mixed_tensors(seed: int, scale: int = 1, big: int = 4 << 20, scalar: float = 3.5) -> dict[str, torch.Tensor]:
    """The CPU tensors of the GPU tests' mixed state (small, a non-contiguous one, empty, 0-d, bool, fp8, complex for
    conj and neg views, one ``big`` of float32 elements): what :func:`mixed_expected` is built from."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(256 * scale, 128, generator=g),
        "bf16": torch.randn(1024 * scale, generator=g).to(torch.bfloat16),
        "int_t": torch.randint(-1000, 1000, (64, 32), generator=g),
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(scalar),
        "mask": torch.rand(10, generator=g) > 0.5,
        "fp8": torch.randn(64, generator=g).to(torch.float8_e4m3fn),
        "complex": torch.randn(8, dtype=torch.complex64, generator=g),
        "big": torch.randn(big, generator=g),
        "on_cpu": torch.randn(100, generator=g),
    }


def mixed_expected(cpu: dict[str, torch.Tensor], step: int) -> dict[str, Any]:
    """What a restore of the mixed state built from ``cpu`` (:func:`mixed_tensors`) gives back: views resolved."""
    return {
        "w": cpu["w"],
        "bf16": cpu["bf16"],
        "int_t": cpu["int_t"].t().contiguous().t(),
        "empty": cpu["empty"],
        "scalar": cpu["scalar"],
        "mask": cpu["mask"],
        "fp8": cpu["fp8"],
        "conj": cpu["complex"].conj().resolve_conj(),
        "neg": cpu["complex"].conj().imag.resolve_neg(),
        "big": cpu["big"],
        "param": torch.nn.Parameter(cpu["w"][:4].clone()),
        "on_cpu": cpu["on_cpu"],
        "step": step,
    }
