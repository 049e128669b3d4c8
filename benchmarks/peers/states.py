"""The two states every system saves, built by the code ``benchmarks/gpu_capture.py`` builds them with.

``tensors``: ``--tensors`` float32 tensors of ``--size`` bytes in all (default 64 of 1 GiB), random.
``model``: ``{"model": ..., "optim": ...}`` of gpu_capture's pre-norm transformer (``--layers`` x
``nn.TransformerEncoderLayer``, d=``--dim``) in bf16 with AdamW after one real step: 48 tensors per layer.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Any

KINDS = ("tensors", "model")


@dataclass(frozen=True)
class StateSpec:
    """What to build: a child process rebuilds nothing from it, it only names the state in the report."""

    kind: str
    size: int = 1 << 30
    tensors: int = 64
    layers: int = 8
    dim: int = 1024
    heads: int = 8
    vocab: int = 1024

    def describe(self) -> dict[str, Any]:
        return asdict(self)


def build(spec: StateSpec) -> Any:
    """The state of ``spec`` on the CPU."""
    import torch

    from benchmarks.gpu_capture import Trainer, build_tensors

    cpu = torch.device("cpu")
    if spec.kind == "tensors":
        return build_tensors(spec.size, spec.tensors, cpu)
    if spec.kind != "model":
        raise ValueError(f"unknown state kind {spec.kind!r}: expected one of {KINDS}")
    args = argparse.Namespace(layers=spec.layers, dim=spec.dim, heads=spec.heads, vocab=spec.vocab, batch=1, seq=16)
    trainer = Trainer(args, cpu)
    trainer.step()  # one real optimizer step: AdamW's moments and step counts exist
    return trainer.state()


def shape_of(state: Any) -> dict[str, Any]:
    """Tensors, bytes and dtypes of ``state``."""
    from memstore.bench.state import nbytes_of, tensors_of

    tensors = tensors_of(state)
    dtypes: dict[str, int] = {}
    for t in tensors:
        name = str(t.dtype).removeprefix("torch.")
        dtypes[name] = dtypes.get(name, 0) + 1
    return {"tensors": len(tensors), "bytes": nbytes_of(tensors), "dtypes": dtypes}
