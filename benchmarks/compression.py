"""Spill codecs on real-looking training state: compression ratio and single-core throughput.

    python benchmarks/compression.py [--mib 64] [--json PATH]

"Real-looking": the weights of a transformer LM after a few hundred AdamW steps (trained here on
synthetic text, so nothing is downloaded), its AdamW moments, and the same weights in bf16. Random
normal data is shown as the incompressible worst case. Each codec runs on 4 MiB chunks, as the
spiller does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CHUNK = 4 << 20  # what the spiller encodes at a time

if TYPE_CHECKING:
    import torch


@dataclass
class CodecResult:
    ratio: float
    encode_GiBps: float  # the JSON key
    decode_GiBps: float  # the JSON key


def trained_state(mib: int) -> dict[str, torch.Tensor]:
    import torch

    torch.manual_seed(0)
    d = 256
    model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(d, 8, 4 * d, batch_first=True), 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(200):
        x = torch.randn(8, 16, d)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    exp_avg_sq = torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1) for p in model.parameters()])
    reps = max(1, (mib << 20) // (weights.numel() * 4))
    return {
        "fp32 weights (trained)": weights.repeat(reps),
        "bf16 weights (trained)": weights.to(torch.bfloat16).repeat(reps),
        "fp32 AdamW exp_avg_sq": exp_avg_sq.repeat(reps),
        "fp32 random normal": torch.randn(weights.numel() * reps),
    }


def measure(data: bytes) -> dict[str, CodecResult]:
    """Every spill codec over ``data`` in 4 MiB chunks: ratio, encode and decode throughput on one core."""
    from memstore.spill import codec

    out = {}
    mv = memoryview(data)
    for name in codec.CODECS:
        t0 = time.perf_counter()
        stored = [codec.encode(name, mv[o : o + CHUNK]) for o in range(0, len(mv), CHUNK)]
        enc = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i, piece in enumerate(stored):
            codec.decode(name, piece, min(CHUNK, len(mv) - i * CHUNK))
        dec = time.perf_counter() - t0
        size = sum(len(p) for p in stored)
        out[name] = CodecResult(ratio=len(data) / size, encode_GiBps=len(data) / enc / 2**30, decode_GiBps=len(data) / dec / 2**30)
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser(prog="python benchmarks/compression.py", description="spill codecs on real-looking training state")
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    results: dict[str, dict[str, CodecResult]] = {}
    for label, tensor in trained_state(args.mib).items():
        raw = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        results[label] = measure(raw)
        for name, r in results[label].items():
            enc, dec = r.encode_GiBps, r.decode_GiBps
            print(f"{label:<26} {name:<14} ratio {r.ratio:5.2f}  encode {enc:5.2f} GiB/s  decode {dec:5.2f} GiB/s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({k: {n: asdict(r) for n, r in v.items()} for k, v in results.items()}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
