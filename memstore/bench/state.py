"""The benchmarked training state, its fingerprint, and the buffers and copies the baselines use."""

from __future__ import annotations

import mmap
import os
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from memstore.bench.units import CHUNK

if TYPE_CHECKING:
    import torch


def make_state(nbytes: int, seed: int) -> dict[str, Any]:
    """A model + Adam-like state of ``nbytes`` float32 bytes: 4 layers x (weight, exp_avg, exp_avg_sq), random."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    layers = 4
    total = nbytes // 4
    base = total // (3 * layers)
    sizes = [base] * (3 * layers)
    sizes[-1] += total - base * 3 * layers
    made = iter([torch.rand(n, generator=gen) for n in sizes])
    model = {f"layers.{i}.weight": next(made) for i in range(layers)}
    optim_state = {i: {"step": torch.tensor(100.0), "exp_avg": next(made), "exp_avg_sq": next(made)} for i in range(layers)}
    return {
        "model": model,
        "optim": {
            "state": optim_state,
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": list(range(layers))}],
        },
        "step": 100,
    }


def state_tensors(state: Any) -> list[torch.Tensor]:
    import torch

    out: list[torch.Tensor] = []

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list | tuple):
            for x in v:
                walk(x)

    walk(state)
    return out


def nbytes_of(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def states_equal(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(states_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(states_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def state_fingerprint(state: Any) -> str:
    """xxh3-128 over the state's structure, every non-tensor leaf and every tensor's dtype, shape and bytes: a
    restore in another process is verified by comparing fingerprints, without shipping the tensors back."""
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
            h.update(f"{type(v).__name__}{{{len(v)};".encode())
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


def byte_views(tensors: list[torch.Tensor]) -> list[memoryview]:
    import torch

    return [t.detach().reshape(-1).view(torch.uint8).numpy().data for t in tensors]


def chunks(views: list[memoryview], chunk: int = CHUNK) -> Iterator[memoryview]:
    for mv in views:
        for off in range(0, len(mv), chunk):
            yield mv[off : off + chunk]


def prefaulted(nbytes: int) -> bytearray:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    zeros = bytes(min(CHUNK, nbytes))
    for off in range(0, nbytes, CHUNK):
        view[off : off + CHUNK] = zeros[: min(CHUNK, nbytes - off)]
    view.release()
    return buf


def copy_all(dst: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """torch ``copy_`` of every tensor, back to back, into the uint8 buffer ``dst``."""
    off = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        dst[off : off + n].view(t.dtype).copy_(t.reshape(-1))
        off += n


def shared_mapping(nbytes: int, directory: str | None) -> mmap.mmap:
    """An unlinked, pre-populated MAP_SHARED file mapping: the kind of memory a save writes into."""
    fd, path = tempfile.mkstemp(prefix="memstore-bench-", dir=directory)
    try:
        os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
        os.unlink(path)
