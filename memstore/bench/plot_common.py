"""What the figures share (matplotlib, imported by the callers): colours, log-seconds axes, horizontal bars."""

from __future__ import annotations

from typing import Any

from memstore.bench.fmt import fmt_s

MEMSTORE, BASELINE, FLOOR = "#1f77b4", "#ff7f0e", "#7f7f7f"

Bar = tuple[str, float | None, str]


def log_seconds(axis: Any) -> None:
    from matplotlib.ticker import FuncFormatter, NullFormatter

    axis.set_major_formatter(FuncFormatter(lambda v, _pos: fmt_s(v)))
    axis.set_minor_formatter(NullFormatter())


def bars(ax: Any, items: list[Bar], title: str) -> None:
    shown = [(n, float(v), c) for n, v, c in items if v]
    ys = list(range(len(shown)))
    ax.barh(ys, [v for _, v, _ in shown], color=[c for _, _, c in shown])
    ax.set_yticks(ys, [n for n, _, _ in shown], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    log_seconds(ax.xaxis)
    ax.set_xlim(min(v for _, v, _ in shown) / 2, max(v for _, v, _ in shown) * 4)
    ax.set_xlabel("seconds (log); blue: memstore, orange: baselines, grey: hardware floor")
    ax.set_title(title, fontsize=10)
    for y, (_, v, _) in zip(ys, shown, strict=True):
        ax.text(v, y, f" {fmt_s(v)}", va="center", fontsize=7)
