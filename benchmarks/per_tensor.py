"""Per-tensor cost of the shard serializer: ``python benchmarks/per_tensor.py [--count 10000] [--repeat 7]``.

For each state (a flat dict of ``count`` float32 tensors of 1024 elements, and an optimizer-like
nesting ``{"state": {i: {"exp_avg", "exp_avg_sq", "step"}}}``) it times

* save: ``serialization.plan(state)`` + ``layout.write_into(buf)`` into a preallocated, pre-faulted buffer;
* restore: ``serialization.decode(buf, zero_copy=False)`` and ``zero_copy=True`` (which copies blobs of
  up to 64 KiB too, so its many-tensor figure includes their bytes while its one-tensor baseline is a
  view), with glibc's malloc set to reuse freed memory for every size (see ``steady_malloc``);

and the same for a baseline state of ONE float32 tensor holding the same total bytes, measured in the
same run. The figure printed is ``(t_many - t_one) / tensor_count`` in microseconds: what each extra
tensor costs beyond its bytes. Times are the best of ``--repeat`` runs (the machine is shared).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from trainer_client import serialization


def flat_state(count: int) -> dict[str, torch.Tensor]:
    return {f"p{i}": torch.randn(1024) for i in range(count)}


def optimizer_state(count: int) -> dict[str, Any]:
    """``count`` tensors in all: per parameter exp_avg, exp_avg_sq (1024 floats each) and a 0-d step."""
    params = count // 3
    return {
        "state": {i: {"exp_avg": torch.randn(1024), "exp_avg_sq": torch.randn(1024), "step": torch.tensor(1.0)} for i in range(params)},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": list(range(params))}],
    }


def count_tensors(state: object) -> tuple[int, int]:
    """(number of tensors, total tensor bytes) reachable in ``state``."""
    if isinstance(state, torch.Tensor):
        return 1, state.numel() * state.element_size()
    items: Any = state.values() if isinstance(state, dict) else state if isinstance(state, list | tuple) else ()
    n = b = 0
    for item in items:
        dn, db = count_tensors(item)
        n, b = n + dn, b + db
    return n, b


def steady_malloc() -> bool:
    """Make glibc's malloc reuse freed memory for every size (no mmap, no trimming); False if not glibc.

    Otherwise a restored tensor over 32 MiB gets a fresh mapping, page faults included, on every
    call, while 10k small ones reuse the heap the previous call freed: the baseline would pay for
    the kernel, not the serializer. With this, neither does.
    """
    try:
        libc = ctypes.CDLL(None)
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 1 << 40))
    except (OSError, AttributeError):
        return False


def best_of(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up (caches, lazily built tables, the heap)
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(state: object, repeat: int) -> dict[str, float]:
    layout = serialization.plan(state)
    buf = bytearray(layout.nbytes)  # pre-faulted: bytearray zero-fills it
    layout.write_into(buf)
    ro = bytes(buf)

    def save() -> None:
        serialization.plan(state).write_into(buf)

    return {
        "save": best_of(save, repeat),
        "decode": best_of(lambda: serialization.decode(ro), repeat),
        "decode_zc": best_of(lambda: serialization.decode(buf, zero_copy=True), repeat),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=10000, help="tensors per state (default 10000)")
    parser.add_argument("--repeat", type=int, default=7, help="timed runs per figure; the best counts (default 7)")
    args = parser.parse_args()
    torch.manual_seed(0)
    steady = steady_malloc()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads; best of {args.repeat}; "
        f"malloc reuses freed memory: {'yes' if steady else 'no (not glibc)'}"
    )
    print(f"{'state':<34} {'tensors':>8} {'MB':>7} {'op':>16} {'many ms':>9} {'one ms':>8} {'us/tensor':>10}")
    for name, make in (("dict of 1024-float tensors", flat_state), ("optimizer-like nesting", optimizer_state)):
        state = make(args.count)
        n, nbytes = count_tensors(state)
        many = measure(state, args.repeat)
        del state
        one = measure({"p": torch.randn(nbytes // 4)}, args.repeat)
        for op in ("save", "decode", "decode_zc"):
            label = {"save": "plan+write_into", "decode": "decode", "decode_zc": "decode zero_copy"}[op]
            per = (many[op] - one[op]) / n * 1e6
            print(f"{name:<34} {n:>8} {nbytes / 1e6:>7.1f} {label:>16} {many[op] * 1e3:>9.2f} {one[op] * 1e3:>8.2f} {per:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
