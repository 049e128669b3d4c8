"""How the tables and figures print times, throughputs, ratios and verdicts."""

from __future__ import annotations

from memstore.bench.targets import Target
from memstore.bench.units import GiB


def fmt_s(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.1f} ms" if v < 1 else f"{v:.3f} s"


def fmt_bps(v: float | None) -> str:
    return "-" if v is None else f"{v / GiB:.2f} GiB/s"


def fmt_ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def fmt_ratio_over(v: float | None, unavailable: str | None) -> str:
    """A ratio over a baseline this torch may not have measured (a DCP staging): "n/a" then, the reason printed beside."""
    return "n/a" if unavailable else fmt_ratio(v)


def fmt_faster(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}x faster" if v >= 1 else f"{1 / v:.1f}x slower"


def fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.1f}%"


def fmt_share(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.0f}%"


def verdict(t: Target) -> str:
    if t.passed is None:
        return "n/a"
    return "[bold green]PASS[/]" if t.passed else "[bold red]MISS[/]"
