"""The erasure codec's speed on one thread, against a numpy copy of the same bytes (the memory floor).

    python benchmarks/erasure_codec.py [--size 256] [--block 1] [--k 4] [--m 2] [--repeat 3] [--heap-malloc] [--json PATH]

Makes ``--k`` data columns of ``--size`` MiB of random bytes and reports, each the best of ``--repeat`` runs:

- ``copy``: ``numpy.copyto`` of the k columns' bytes, the floor every figure is a ratio against;
- ``xor encode``: ec:k+1's parity of the k columns (:meth:`Codec.encode`, one call over the whole columns, into a
  parity already mapped, as the copy);
- ``xor accumulate``: one column added into a parity in place (what a parity host does per contribution);
- ``rs encode``: ec:k+m's parities, ``--block`` MiB blocks at a time (the engine's unit), all positions, written into
  the parity columns;
- ``rs decode, 1 lost`` and ``m lost``: the lost data columns rebuilt from k survivors, every position (checked);
- ``rs contribution``: one column's contribution to the m parities, one block per call, and 16 blocks per call.

Throughput is GB/s (1e9 bytes) of data columns read (for a contribution, of the one column). Memory: about
``(2k + m + 2) x size``.

pyeclib allocates its fragments afresh on every call (several MiB per 1 MiB-block stripe), and glibc's default
returns such blocks to the kernel when freed, so every call pays page faults for them again: on a virtual machine
most of the Reed-Solomon time. ``--heap-malloc`` first sets glibc's ``M_MMAP_THRESHOLD`` (256 MiB) and
``M_TRIM_THRESHOLD`` (1 GiB) through ``mallopt``, so freed blocks are reused: what a store process that codes with
``m >= 2`` would do. The XOR path allocates nothing per call in the engine (it adds into parity in place).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from memstore.erasure.codec import MAX_COLUMNS, Codec

MiB = 1 << 20


def heap_malloc() -> None:
    """Keep freed blocks up to 256 MiB in glibc's heap (no unmapping, no trimming), so they are reused."""
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    if not (libc.mallopt(m_mmap_threshold, 256 * MiB) and libc.mallopt(m_trim_threshold, 1024 * MiB)):
        raise SystemExit("mallopt refused the thresholds (not glibc?)")


def best(fn: Callable[[], object], repeat: int) -> float:
    """The shortest of ``repeat`` timed calls of ``fn``, in seconds (after one untimed call)."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def gbs(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def copy_gbs(data: list[np.ndarray], repeat: int) -> float:
    """The memory floor: ``numpy.copyto`` of the same bytes, into memory already mapped."""
    joined = np.concatenate(data)
    target = np.empty_like(joined)
    return gbs(len(joined), best(lambda: np.copyto(target, joined), repeat))


def xor_figures(data: list[np.ndarray], repeat: int) -> dict[str, float]:
    k, size = len(data), len(data[0])
    copy = copy_gbs(data, repeat)
    codec = Codec(k, 1)
    parity = np.empty(size, np.uint8)
    encode = gbs(k * size, best(lambda: codec.encode(data, out=[parity]), repeat))
    one_copy = copy_gbs(data[:1], repeat)
    accumulate = gbs(size, best(lambda: codec.accumulate(parity, data[0]), repeat))
    return {"copy_gbs": copy, "xor_encode_gbs": encode, "column_copy_gbs": one_copy, "xor_accumulate_gbs": accumulate}


def rs_figures(data: list[np.ndarray], m: int, block: int, repeat: int) -> dict[str, float]:
    k, size = len(data), len(data[0])
    codec = Codec(k, m)
    positions = range(0, size, block)
    parity = [np.empty(size, np.uint8) for _ in range(m)]

    def encode() -> None:
        for start in positions:
            codec.encode([d[start : start + block] for d in data], out=[p[start : start + block] for p in parity])

    figures = {"rs_encode_gbs": gbs(k * size, best(encode, repeat))}
    encode()
    for lost in sorted({1, m}):
        survivors = list(range(lost, k + m))[:k]  # data columns 0..lost-1 gone: the others, then parity

        def decode(lost: int = lost, survivors: list[int] = survivors) -> None:
            for start in positions:
                present = {c: (data[c] if c < k else parity[c - k])[start : start + block] for c in survivors}
                rebuilt = codec.decode(present, len(present[survivors[0]]))
                if start == 0 and not all(np.array_equal(b, data[c][: len(b)]) for c, b in rebuilt.items()):
                    raise SystemExit(f"rs decode with {lost} lost: a rebuilt block differs")

        figures[f"rs_decode_{lost}_lost_gbs"] = gbs(k * size, best(decode, repeat))
    column = data[k - 1]
    figures["rs_contribution_gbs"] = gbs(size, best(lambda: [codec.contribution(k - 1, column[s : s + block]) for s in positions], repeat))
    wide = 16 * block
    figures["rs_contribution_16_blocks_gbs"] = gbs(
        size, best(lambda: [codec.contribution(k - 1, column[s : s + wide]) for s in range(0, size, wide)], repeat)
    )
    return figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=256, help="MiB per data column")
    p.add_argument("--block", type=int, default=1, help="MiB per block for Reed-Solomon (the engine's unit)")
    p.add_argument("--k", type=int, default=4, help="data columns")
    p.add_argument("--m", type=int, default=2, help="parity columns of the Reed-Solomon code (2 or more)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs of each figure (the best is kept)")
    p.add_argument("--heap-malloc", action="store_true", help="reuse freed blocks (glibc mallopt) instead of re-mapping them")
    p.add_argument("--json", default="", help="also write the results here")
    args = p.parse_args()
    for name in ("size", "block", "k", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.m < 2:
        p.error(f"--m must be at least 2 (m=1 is the XOR figures), got {args.m}")
    if args.k + args.m > MAX_COLUMNS:
        p.error(f"--k plus --m must be at most {MAX_COLUMNS}, got {args.k} + {args.m}")
    if args.block > args.size:
        p.error(f"--block ({args.block} MiB) must be at most --size ({args.size} MiB)")
    if args.heap_malloc:
        heap_malloc()
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 256, args.size * MiB, dtype=np.uint8) for _ in range(args.k)]
    figures = xor_figures(data, args.repeat) | rs_figures(data, args.m, args.block * MiB, args.repeat)
    copy = figures["copy_gbs"]
    malloc = "heap malloc" if args.heap_malloc else "default malloc"
    print(f"{args.k} columns x {args.size} MiB, one thread, {malloc}; copy of the same bytes {copy:.2f} GB/s")
    for name, value in figures.items():
        if name not in ("copy_gbs", "column_copy_gbs"):
            floor = figures["column_copy_gbs"] if name == "xor_accumulate_gbs" else copy  # one column against one column
            print(f"  {name[:-4].replace('_', ' '):32s} {value:6.2f} GB/s   {value / floor:5.2f} x copy")
    result = {"k": args.k, "m": args.m, "size_mib": args.size, "block_mib": args.block, "repeat": args.repeat}
    result |= {"heap_malloc": args.heap_malloc, **figures}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
