"""The figures of a run (matplotlib, the ``[bench]`` extra): the saves from the first and the fixed costs
(:mod:`memstore.bench.plot_first_save`), bars of memstore vs the baselines for stall and restore (headline), throughput
and stall vs size, store memory vs bytes held, and RSS over the leak check's saves."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memstore.bench.fmt import fmt_pct, fmt_share
from memstore.bench.plot_common import BASELINE, FLOOR, MEMSTORE, Bar, bars, log_seconds
from memstore.bench.plot_first_save import fixed_costs_panel, series_panel
from memstore.bench.scenario_results import LeakCheck
from memstore.bench.units import GiB, MiB, fmt_bytes, short_size

if TYPE_CHECKING:
    from memstore.bench.results import Floors
    from memstore.bench.run_result import BenchResult


def _size_axis(ax: Any, sizes: list[int]) -> None:
    from matplotlib.ticker import NullFormatter

    ax.set_xscale("log", base=2)
    ax.set_xticks([x / MiB for x in sizes], [short_size(x) for x in sizes])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlim(sizes[0] / MiB / 1.5, sizes[-1] / MiB * 1.5)
    ax.set_xlabel("state size")


def _stall_bars(ax: Any, result: BenchResult) -> None:
    head = result.cluster.measured
    fl = result.size_of(result.cluster).floors
    dcp = fl.dcp
    items: list[Bar] = [
        ("memstore save 1 stall (fresh job, fresh stores)", head.first_save.save_wall_seconds, MEMSTORE),
        ("memstore save() stall p50 (steady)", head.stall_seconds.p50, MEMSTORE),
        ("memstore save() stall p95 (steady)", head.stall_seconds.p95, MEMSTORE),
        ("torch copy_ pre-faulted (paired)", head.paired_memcpy_seconds.p50, FLOOR),
        ("DCP async_save blocking (default)", dcp.default.blocking_p50, BASELINE),  # None (no bar): unavailable on this torch
        ("DCP async_save blocking (reused stager)", dcp.reused_stager.blocking_p50, BASELINE),
        ("torch.save + fsync", fl.disk.save_fsync_seconds, BASELINE),
        ("memstore save 1: call -> committed", head.first_save.committed_seconds, MEMSTORE),
        ("memstore call -> committed p50 (steady)", head.committed_seconds.p50, MEMSTORE),
        ("DCP async_save total (fsynced)", dcp.default.total_p50, BASELINE),
    ]
    bars(ax, items, f"trainer stall [{head.name}]")


def _restore_bars(ax: Any, result: BenchResult) -> None:
    head = result.cluster.measured
    fl = result.size_of(result.cluster).floors
    durable = head.restore_durable.restore
    ns = result.from_first_save.no_shared_memory if result.from_first_save else None
    items: list[Bar] = [
        ("local RAM, new process, zero-copy", head.restore_local.seconds.p50, MEMSTORE),
        ("local RAM, new process, copy", head.restore_local_copy.seconds.p50, MEMSTORE),
        ("peer RAM after host loss", head.restore_peer.seconds.p50 if head.restore_peer else None, MEMSTORE),
        ("peer RAM, owner's copy deleted", head.restore_peer_deleted.seconds.p50 if head.restore_peer_deleted else None, MEMSTORE),
        ("store pull alone (Fetch)", head.peer_pull.seconds.p50 if head.peer_pull else None, MEMSTORE),
        ("durable storage (file:// spill), new process", durable.seconds.p50 if durable else None, MEMSTORE),
        ("no shared memory: connect + load", ns.measured.load_seconds.p50 if ns else None, MEMSTORE),
        ("raw TCP, same bytes", fl.tcp.seconds.p50, FLOOR),
        ("torch.load, page cache warm", fl.disk.load_warm_seconds.p50, BASELINE),
        ("torch.load, page cache evicted", fl.disk.load_cold_seconds.p50, BASELINE),
    ]
    bars(ax, items, f"restore [{head.name}] (peer: first restore after a host replacement, from the load call)")


def _throughput_vs_size(ax: Any, result: BenchResult, sizes: list[int]) -> None:
    """Replication (and peer restore after a host loss) per (hosts, R), against raw TCP."""
    series: dict[str, list[tuple[int, float, float | None]]] = {}
    for s in result.scenarios:
        m = s.measured
        snb = result.size_of(s).state.shard_bytes
        repl = m.replication_bytes_per_second.p50 if m.replicas >= 2 else None
        p = m.restore_peer
        series.setdefault(f"{m.hosts}h R={m.replicas}", []).append((m.size, repl or 0.0, snb / p.seconds.p50 if p else None))
    for label, pts in sorted(series.items()):
        pts.sort(key=lambda pt: (pt[0], pt[1], pt[2] or 0.0))
        if any(r for _, r, _ in pts):
            line = ax.plot([x / MiB for x, _, _ in pts], [r / GiB for _, r, _ in pts], marker="o", label=f"replication {label}")[0]
            peer_pts = [(x, pr) for x, _, pr in pts if pr]
            if peer_pts:
                ax.plot([x / MiB for x, _ in peer_pts], [v / GiB for _, v in peer_pts], marker="x", ls="--", color=line.get_color(),
                        label=f"peer restore {label}")  # fmt: skip
    ax.plot([x / MiB for x in sizes], [result.sizes[str(x)].floors.tcp.bytes_per_second.p50 / GiB for x in sizes],
            color="k", marker="s", lw=2, label="raw TCP loopback")  # fmt: skip
    _size_axis(ax, sizes)
    ax.set_ylabel("GiB/s")
    ax.set_ylim(bottom=0)
    ax.set_title("throughput vs size (x: peer restore after a host loss)", fontsize=10)
    ax.legend(fontsize=6, ncol=2, loc="lower left")


def _stall_vs_size(ax: Any, result: BenchResult, sizes: list[int]) -> None:
    stall_series: dict[str, list[tuple[int, float]]] = {}
    for s in result.scenarios:
        m = s.measured
        stall_series.setdefault(f"{m.hosts}h R={m.replicas}", []).append((m.size, m.stall_seconds.p50))
    for label, spts in sorted(stall_series.items()):
        spts.sort()
        ax.plot([x / MiB for x, _ in spts], [v for _, v in spts], marker="o", label=f"memstore stall {label}")
    floors: tuple[tuple[Callable[[Floors], float | None], str, str], ...] = (
        (lambda f: f.memcpy.torch_copy_seconds.p50, "torch copy_ pre-faulted", FLOOR),
        (lambda f: f.dcp.default.blocking_p50, "DCP async_save blocking", BASELINE),  # None: unavailable on this torch
        (lambda f: f.disk.save_fsync_seconds, "torch.save + fsync", "k"),
    )
    for value, label, color in floors:
        ys = [value(result.sizes[str(x)].floors) for x in sizes]
        if all(y is None for y in ys):
            continue
        ax.plot([x / MiB for x in sizes], [math.nan if y is None else y for y in ys], color=color, marker="s", lw=2, label=label)
    _size_axis(ax, sizes)
    ax.set_yscale("log")
    log_seconds(ax.yaxis)
    ax.set_ylabel("seconds (log)")
    ax.set_title("stall vs size", fontsize=10)
    ax.legend(fontsize=7)


def _store_memory(ax: Any, result: BenchResult) -> None:
    head = result.cluster.measured
    mem = head.store_memory.stores
    hosts = list(mem)
    xs = list(range(len(hosts)))
    w = 0.2
    kinds = (
        ("held", "shard bytes held", "#2ca02c"),
        ("used", "held + pooled (used_bytes)", "#98df8a"),
        ("rss", "VmRSS", MEMSTORE),
        ("pss", "Pss", "#aec7e8"),
    )
    for i, (kind, label, color) in enumerate(kinds):
        vals = []
        for h in hosts:
            e = mem[h]
            held, m = e.held, e.memory
            v = {
                "held": held.shard_bytes_held if held else None,
                "used": held.used_bytes if held else None,
                "rss": m.rss if m else None,
                "pss": m.pss if m else None,
            }[kind]
            vals.append((v or 0) / GiB)
        ax.bar([x + (i - 1.5) * w for x in xs], vals, w, label=label, color=color)
    ax.set_xticks(xs, hosts)
    ax.set_ylabel("GiB")
    ax.set_title(f"store memory after the saves [{head.name}]", fontsize=10)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.06), ncol=4)


def _leak(ax: Any, result: BenchResult) -> None:
    leak = result.leak_check
    if not isinstance(leak, LeakCheck) or not leak.processes:
        ax.set_axis_off()
        ax.set_title("leak check skipped", fontsize=10)
        return
    for label, v in leak.processes.items():
        ys = [(x or 0) / MiB for x in v.rss_series]
        ax.plot(range(1, len(ys) + 1), ys, label=f"{label} ({fmt_pct(v.growth_percent)})")
    ax.axvline(leak.reference_save, color=FLOOR, ls=":")
    ax.set_xlabel("save #")
    ax.set_ylabel("VmRSS (MiB)")
    ax.set_title(f"RSS over {leak.saves} saves of {short_size(leak.size)} (leak check)", fontsize=10)
    ax.legend(fontsize=7)


def write_plot(result: BenchResult, path: str) -> None:
    """Eight panels into ``path`` (PNG): the saves from the first and the fixed costs (issue 16) on top, then stall and
    restore bars, throughput and stall vs size, store memory and the leak check; ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    head = result.cluster.measured
    nb = result.size_of(result.cluster).state.shard_bytes
    sizes = sorted(int(k) for k in result.sizes)
    fig = plt.figure(figsize=(19, 16))
    grid = fig.add_gridspec(3, 3)
    series_panel(fig.add_subplot(grid[0, 0:2]), result)
    fixed_costs_panel(fig.add_subplot(grid[0, 2]), result)
    _stall_bars(fig.add_subplot(grid[1, 0]), result)
    _restore_bars(fig.add_subplot(grid[1, 1]), result)
    _throughput_vs_size(fig.add_subplot(grid[1, 2]), result, sizes)
    _stall_vs_size(fig.add_subplot(grid[2, 0]), result, sizes)
    _store_memory(fig.add_subplot(grid[2, 1]), result)
    _leak(fig.add_subplot(grid[2, 2]), result)
    m = result.machine
    fig.suptitle(
        f"memstore bench: headline {head.name} ({fmt_bytes(nb)} shard), {len(result.scenarios)} scenario(s); "
        f"{m.cpu_count} CPUs, {fmt_bytes(m.ram_bytes)} RAM, torch {m.torch}; CPU pressure "
        f"{fmt_share(result.conditions.cpu_pressure_some_share_during_run)}",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
