"""The figures of what a user sees from the first save (issue 16): the stall and call -> committed of every save,
1..N, against the paired memcpy and raw TCP; and the fixed costs (small states, per tensor, no shared memory)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memstore.bench.fmt import fmt_s
from memstore.bench.plot_common import FLOOR, MEMSTORE, Bar, bars, log_seconds
from memstore.bench.units import short_size

if TYPE_CHECKING:
    from memstore.bench.first_save import FirstSaveResult
    from memstore.bench.run_result import BenchResult

SERIES_COLORS = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b")


def series_panel(ax: Any, result: BenchResult) -> None:
    """Per save of each series: stall (solid) and save() call -> committed (dashed), with the paired memcpy of each save
    and the raw TCP time of the state's bytes."""
    first: FirstSaveResult | None = result.from_first_save
    info = result.size_of(result.cluster)
    series = first.series if first else []
    n = 0
    for color, s in zip(SERIES_COLORS, series, strict=False):
        saves = s.measured.saves
        if not saves:
            continue
        xs = [x.step for x in saves]
        n = max(n, len(xs))
        ax.plot(xs, [x.save_wall_seconds for x in saves], marker="o", color=color, label=f"stall, {s.measured.label}")
        ax.plot(xs, [x.committed_seconds for x in saves], marker="s", ls="--", color=color, label=f"call -> committed, {s.measured.label}")
        if s is series[0]:
            paired = [(x.step, x.paired_memcpy_seconds) for x in saves if x.paired_memcpy_seconds]
            ax.plot([p for p, _ in paired], [v for _, v in paired], marker=".", ls=":", color=FLOOR, label="memcpy pre-faulted, paired")
    if not n:
        ax.set_axis_off()
        ax.set_title("saves from the first: not measured", fontsize=10)
        return
    tcp = info.state.bytes / info.floors.tcp.bytes_per_second.p50
    ax.axhline(tcp, color="k", lw=1.5, label=f"raw TCP, same bytes ({fmt_s(tcp)})")
    ax.axhline(tcp / 0.7, color="k", lw=0.8, ls=":", label="raw TCP / 0.7 (call -> committed target)")
    keep = result.config.keep
    ax.axvspan(1.5, keep + 2.5, color="#eeeeee", zorder=0)
    ax.set_xticks(range(1, n + 1))
    ax.set_xlabel(f"save # (1: fresh job on fresh stores; shaded: saves 2..{keep + 2}; then the steady state)")
    ax.set_yscale("log")
    log_seconds(ax.yaxis)
    ax.set_ylabel("seconds from the save() call (log)")
    ax.set_title(f"saves from the first [{result.cluster.measured.name}]: stall and call -> committed per save", fontsize=10)
    ax.legend(fontsize=7, ncol=2)


def fixed_costs_panel(ax: Any, result: BenchResult) -> None:
    """Bars: small states' stall and call -> committed, the per-tensor states' save stall and load, the path without
    shared memory against raw TCP."""
    first = result.from_first_save
    items: list[Bar] = []
    if first:
        for r in first.small_states:
            label = short_size(r.measured.size)
            items.append((f"{label} state: stall p50", r.stall_seconds.p50, MEMSTORE))
            items.append((f"{label} state: call -> committed p50", r.committed_seconds.p50 if r.committed_seconds else None, MEMSTORE))
            items.append((f"{label} state: memcpy p50", r.paired_memcpy_seconds.p50 if r.paired_memcpy_seconds else None, FLOOR))
        pt = first.per_tensor
        if pt:
            count = pt.measured.count
            items += [
                (f"{count:,} tensors: save stall p50 ({pt.save_stall_us_per_tensor:.1f} us/tensor)", pt.many_save_stall_seconds, MEMSTORE),
                ("1 tensor, same bytes: save stall p50", pt.one_save_stall_seconds, MEMSTORE),
                (f"{count:,} tensors: load p50 ({pt.load_us_per_tensor:.1f} us/tensor)", pt.many_load_seconds, MEMSTORE),
                ("1 tensor, same bytes: load p50", pt.one_load_seconds, MEMSTORE),
            ]
        ns = first.no_shared_memory
        if ns:
            info = result.size_of(result.cluster)
            items += [
                ("no shared memory: save stall p50", ns.stall_seconds.p50, MEMSTORE),
                ("no shared memory: call -> committed p50", ns.committed_seconds.p50 if ns.committed_seconds else None, MEMSTORE),
                ("no shared memory: connect + load p50", ns.measured.load_seconds.p50, MEMSTORE),
                (f"raw TCP, {short_size(info.state.shard_bytes) if info.state.shard_bytes % 1024 == 0 else 'same'} bytes",
                 info.floors.tcp.seconds.p50, FLOOR),
            ]  # fmt: skip
    if not any(v for _, v, _ in items):
        ax.set_axis_off()
        ax.set_title("fixed costs: not measured", fontsize=10)
        return
    bars(ax, items, "fixed costs (small states, per tensor, no shm)")
