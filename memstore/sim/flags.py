"""Argument types of the ``memstore simulate`` flags: each error message is printed after "argument --flag:".

Shared by the ETTR sweep (:mod:`memstore.sim.cli`) and the protocol model (:mod:`memstore.sim.protocol_cli`).
"""

from __future__ import annotations

import argparse
import math

#: Largest host count a flag accepts.
MAX_HOSTS = 1 << 18


def finite_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return v


def integer(text: str) -> int:
    try:
        return int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive_float(text: str) -> float:
    v = finite_float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def nonnegative_float(text: str) -> float:
    v = finite_float(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def fraction(text: str) -> float:
    v = finite_float(text)
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return v


def positive_int(text: str) -> int:
    v = integer(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return v


def nonnegative_int(text: str) -> int:
    v = integer(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def host_list(text: str) -> list[int]:
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of host counts like 16,128,1000, got {text!r}")
    out: list[int] = []
    for p in parts:
        try:
            n = int(p.replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{p!r} is not an integer host count (in {text!r})") from None
        if not 1 <= n <= MAX_HOSTS:
            raise argparse.ArgumentTypeError(f"host counts must be between 1 and {MAX_HOSTS:,}, got {n}")
        if n not in out:
            out.append(n)
    return sorted(out)


def interval(text: str) -> float | None:
    if text.strip().lower() in ("auto", "young-daly", "daly", "young"):
        return None
    return positive_float(text)
