"""Units, sizes and the small numeric helpers every part of the bench shares (standard library only)."""

from __future__ import annotations

import os
from pathlib import Path

MiB = 1 << 20
GiB = 1 << 30
CHUNK = 4 * MiB  # TCP/gRPC floor message size and cost-model chunk (= memstore's default chunk size)


def short_size(n: int) -> str:
    if n % GiB == 0:
        return f"{n // GiB}GiB"
    if n % MiB == 0:
        return f"{n // MiB}MiB"
    return f"{n}B"


def round_page(n: int) -> int:
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    return -(-n // page) * page


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), without numpy."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def fmt_bytes(n: int | None) -> str:
    from memstore.core.sizes import format_size

    return "-" if n is None else format_size(n)


def child_env() -> dict[str, str]:
    """Environment for helper processes (``python -m memstore.bench.<module>``): this memstore importable first."""
    root = str(Path(__file__).resolve().parent.parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env
