"""Rendering simulation results: a rich table on the terminal, a JSON document, a matplotlib PNG; and the tables of
``memstore simulate protocol`` (:mod:`memstore.sim.protocol`).

rich and matplotlib are imported where used, so importing this module stays cheap.
"""

from __future__ import annotations

import itertools
import json
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memstore.sim.protocol import COMPLEXITY, PROTOCOL_LABELS, PROTOCOLS, ProtocolConfig, ProtocolCost, ProtocolPoint, growth
from memstore.sim.redundancy_compare import SchemeResult
from memstore.sim.replay import STRATEGIES, PointResult
from memstore.sim.save_path_model import SAVE_METRICS, SaveCost, save_growth

if TYPE_CHECKING:
    from rich.console import Console

JSON_VERSION = 1
STRATEGY_LABELS = {"memstore": "memstore (RAM every iteration)", "baseline": "baseline (remote storage)"}
WASTE_CAUSES = (("checkpoint_stall", "checkpoint stalls"), ("lost_work", "lost work"), ("restart_recovery", "restart + recovery"))


def to_json(points: Sequence[PointResult], parameters: dict[str, Any], comparison: Sequence[SchemeResult] = ()) -> dict[str, Any]:
    """The JSON document ``--json`` writes: parameters, one entry per host count, and a compact summary; with
    ``--compare-redundancy`` the schemes side by side (``redundancy_comparison``)."""
    return {
        "tool": "memstore simulate",
        "version": JSON_VERSION,
        "parameters": parameters,
        "points": [p.to_dict() for p in points],
        "summary": {
            "hosts": [p.config.hosts for p in points],
            "gpus": [p.config.gpus for p in points],
            **{f"{s}_ettr": [p.strategies[s].ettr_mean for p in points] for s in STRATEGIES},
            **{f"{s}_wasted_gpu_hours": [p.strategies[s].wasted_gpu_hours["total"] for p in points] for s in STRATEGIES},
        },
        **({"redundancy_comparison": [r.to_dict() for r in comparison]} if comparison else {}),
    }


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path``, making its folder; returns the path (for the "wrote ..." line)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out


def write_json(path: str | Path, doc: dict[str, Any]) -> Path:
    return write_text(path, json.dumps(doc, indent=2, sort_keys=False) + "\n")


def _gpuh(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:,.1f}"


#: (header, right-aligned) of the results table, shared by the terminal and Markdown renderings.
RESULT_COLUMNS: tuple[tuple[str, bool], ...] = (
    ("hosts", True),
    ("GPUs", True),
    ("failures/run", True),
    ("strategy", False),
    ("ETTR", True),
    ("ETTR min-max", True),
    ("stall GPU-h", True),
    ("lost GPU-h", True),
    ("restart GPU-h", True),
    ("wasted GPU-h", True),
    ("RAM / durable restores", True),
    ("wasted s/failure", True),
)


def result_rows(points: Sequence[PointResult]) -> list[list[str]]:
    """One row per (host count, strategy); GPU-hours are per run (mean over trials), restores are totals."""
    rows = []
    for p in points:
        for j, name in enumerate(STRATEGIES):
            s = p.strategies[name]
            w = s.wasted_gpu_hours
            restores = f"{s.ram_recoveries:,} / {s.durable_fallbacks:,}" if name == "memstore" else f"- / {s.durable_fallbacks:,}"
            rows.append(
                [
                    f"{p.config.hosts:,}" if j == 0 else "",
                    f"{p.config.gpus:,}" if j == 0 else "",
                    f"{s.failures_per_run:.1f}" if j == 0 else "",
                    name,
                    f"{s.ettr_mean:.2%}",
                    f"{s.ettr_min:.1%}-{s.ettr_max:.1%}",
                    _gpuh(w["checkpoint_stall"]),
                    _gpuh(w["lost_work"]),
                    _gpuh(w["restart_recovery"]),
                    _gpuh(w["total"]),
                    restores,
                    f"{s.seconds_lost_per_failure:,.0f}" if s.failure_events else "-",
                ]
            )
    return rows


def render_table(points: Sequence[PointResult], console: Console, title: str) -> None:
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for name, right in RESULT_COLUMNS:
        t.add_column(name, justify="right" if right else "left")
    n = len(STRATEGIES)
    for i, row in enumerate(result_rows(points)):
        memstore = row[3] == "memstore"
        t.add_row(*row, style="green" if memstore else None, end_section=(i % n == n - 1 and i < len(points) * n - 1))
    console.print(t)


DERIVED_COLUMNS: tuple[str, ...] = (
    "hosts",
    "job failures/day",
    "job MTTF h",
    "ckpt GB/host",
    "storage write/read s",
    "RAM load s",
    "replication lag s",
    "memstore ckpt every",
    "baseline interval min",
    "baseline stall s",
)


def derived_rows(points: Sequence[PointResult]) -> list[list[str]]:
    rows = []
    for p in points:
        d = p.config.derived()
        rows.append(
            [
                f"{p.config.hosts:,}",
                f"{d['job_failures_per_day']:.2f}",
                f"{d['job_mttf_hours']:.2f}",
                f"{d['checkpoint_gb_per_host']:.3g}",
                f"{d['storage_transfer_seconds']:.0f}",
                f"{d['ram_load_seconds']:.2g}",
                f"{d['replication_lag_seconds']:.2g}",
                f"{d['memstore_every_iterations']} it",
                f"{d['baseline_interval_minutes']:.1f}",
                f"{d['baseline_stall_seconds']:.0f}",
            ]
        )
    return rows


def render_derived(points: Sequence[PointResult], console: Console) -> None:
    from rich.table import Table

    t = Table(title="derived per host count", title_justify="left")
    for name in DERIVED_COLUMNS:
        t.add_column(name, justify="right")
    for row in derived_rows(points):
        t.add_row(*row)
    console.print(t)


def _markdown(headers: Sequence[str], rights: Sequence[bool], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" if r else "---" for r in rights) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


#: The columns of ``--compare-redundancy``'s table (all right-aligned but the scheme).
COMPARE_COLUMNS: tuple[str, ...] = (
    "hosts",
    "redundancy",
    "RAM x state",
    "RAM GB/host/step",
    "group survives",
    "P(RAM) 1 host",
    "P(RAM) burst",
    "restore s",
    "replication lag s",
    "ETTR",
    "wasted GPU-h",
    "RAM / durable restores",
)


def compare_rows(results: Sequence[SchemeResult]) -> list[list[str]]:
    """One row per (host count, scheme), memstore on the same traces."""
    return [
        [
            f"{r.hosts:,}",
            r.redundancy,
            f"{r.ram_multiple:.2f}x",
            f"{r.ram_gb_per_host:.3g}",
            f"{r.survives} host(s)",
            f"{r.p_recover_one:.2%}",
            f"{r.p_recover_burst:.2%}",
            f"{r.restore_seconds:.2g}",
            f"{r.replication_lag_seconds:.2g}",
            f"{r.memstore.ettr_mean:.2%}",
            _gpuh(r.memstore.wasted_gpu_hours["total"]),
            f"{r.memstore.ram_recoveries:,} / {r.memstore.durable_fallbacks:,}",
        ]
        for r in results
    ]


def render_compare(results: Sequence[SchemeResult], console: Console) -> None:
    from rich.table import Table

    t = Table(title="redundancy schemes on the same traces (memstore)", title_justify="left")
    for name in COMPARE_COLUMNS:
        t.add_column(name, justify="left" if name == "redundancy" else "right")
    rows = compare_rows(results)
    for i, row in enumerate(rows):
        t.add_row(*row, end_section=i + 1 < len(rows) and results[i + 1].hosts != results[i].hosts)
    console.print(t)


def markdown(points: Sequence[PointResult], title: str, comparison: Sequence[SchemeResult] = ()) -> str:
    """Both tables as Markdown (``--markdown``), for docs; and the schemes side by side with ``--compare-redundancy``."""
    results = _markdown([c for c, _ in RESULT_COLUMNS], [r for _, r in RESULT_COLUMNS], result_rows(points))
    derived = _markdown(DERIVED_COLUMNS, [True] * len(DERIVED_COLUMNS), derived_rows(points))
    text = f"{title}\n\n{results}\n\nDerived per host count:\n\n{derived}\n"
    if comparison:
        rights = [name != "redundancy" for name in COMPARE_COLUMNS]
        text += f"\nRedundancy schemes on the same traces (memstore):\n\n{_markdown(COMPARE_COLUMNS, rights, compare_rows(comparison))}\n"
    return text


def plot(points: Sequence[PointResult], path: str | Path, title: str) -> Path:
    """ETTR vs hosts (with the min-max over trials), wasted GPU-hours per run, and the waste by cause."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hosts = [p.config.hosts for p in points]
    colors = {"memstore": "tab:green", "baseline": "tab:red"}
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    ax_ettr, ax_waste, ax_cause = axes

    for name in STRATEGIES:
        mean = [p.strategies[name].ettr_mean * 100 for p in points]
        lo = [(p.strategies[name].ettr_mean - p.strategies[name].ettr_min) * 100 for p in points]
        hi = [(p.strategies[name].ettr_max - p.strategies[name].ettr_mean) * 100 for p in points]
        ax_ettr.errorbar(hosts, mean, yerr=[lo, hi], marker="o", capsize=3, color=colors[name], label=STRATEGY_LABELS[name])
        for x, y in zip(hosts, mean, strict=True):
            below = name == "baseline"
            ax_ettr.annotate(
                f"{y:.1f}", (x, y), textcoords="offset points", xytext=(5, -12 if below else 6), fontsize=8, color=colors[name]
            )
    ax_ettr.set_xscale("log")
    ax_ettr.set_xlabel("hosts")
    ax_ettr.set_ylabel("ETTR (%) = useful time / wall time")
    ax_ettr.set_title("ETTR (mean; bars: min-max over trials)")
    ax_ettr.set_ylim(0, 102)
    ax_ettr.grid(True, which="both", alpha=0.3)
    ax_ettr.legend(loc="lower left", fontsize=8)

    for name in STRATEGIES:
        total = [max(p.strategies[name].wasted_gpu_hours["total"], 1e-3) for p in points]
        ax_waste.plot(hosts, total, marker="o", color=colors[name], label=STRATEGY_LABELS[name])
    ax_waste.set_xscale("log")
    ax_waste.set_yscale("log")
    ax_waste.set_xlabel("hosts")
    ax_waste.set_ylabel("wasted GPU-hours per run")
    ax_waste.set_title("wasted GPU-hours (mean per run)")
    ax_waste.grid(True, which="both", alpha=0.3)
    ax_waste.legend(loc="upper left", fontsize=8)

    # Waste by cause as a share of all GPU-hours: memstore and baseline side by side per host count.
    width = 0.38
    xs = list(range(len(points)))
    hatches = {"checkpoint_stall": "", "lost_work": "//", "restart_recovery": ".."}
    shades = {"checkpoint_stall": 0.45, "lost_work": 0.7, "restart_recovery": 1.0}
    for k, name in enumerate(STRATEGIES):
        bottom = [0.0] * len(points)
        offset = (k - 0.5) * width
        for cause, label in WASTE_CAUSES:
            share = []
            for p in points:
                total_gpu_hours = p.config.gpus * p.config.duration_seconds / 3600.0
                share.append(p.strategies[name].wasted_gpu_hours[cause] / total_gpu_hours * 100)
            ax_cause.bar(
                [x + offset for x in xs],
                share,
                width,
                bottom=bottom,
                color=colors[name],
                alpha=shades[cause],
                hatch=hatches[cause],
                edgecolor="black",
                linewidth=0.4,
                label=f"{name}: {label}",
            )
            bottom = [b + v for b, v in zip(bottom, share, strict=True)]
    ax_cause.set_xticks(xs, [f"{h:,}" for h in hosts])
    ax_cause.set_xlabel("hosts (left bar memstore, right bar baseline)")
    ax_cause.set_ylabel("% of GPU-hours wasted")
    ax_cause.set_title("where the GPU-hours go")
    ax_cause.grid(True, axis="y", alpha=0.3)
    ax_cause.legend(fontsize=7, loc="upper left")

    fig.suptitle(textwrap.fill(title, 170), fontsize=10)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# --------------------------------------------------------------------------------------------------
# ``memstore simulate protocol``: the restore protocol's messages and restart timeline
# --------------------------------------------------------------------------------------------------

PROTOCOL_JSON_VERSION = 1
PROTOCOL_NOTE = "model outputs (memstore.sim.protocol), not measurements"

#: (header, right-aligned) of the protocol table.
PROTOCOL_COLUMNS: tuple[tuple[str, bool], ...] = (
    ("hosts", True),
    ("ranks", True),
    ("protocol", False),
    ("RPCs/rank", True),
    ("RPCs/restart", True),
    ("ListShards served/store", True),
    ("durable listings", True),
    ("durable LIST requests", True),
    ("collectives", True),
    ("latest_step s", True),
    ("load s", True),
    ("restart s", True),
)

#: (phase key in ProtocolCost.phases, header) of the timeline table, in order.
PROTOCOL_PHASES: tuple[tuple[str, str], ...] = (
    ("start", "start"),
    ("latest_step.local_rpc", "local RPC"),
    ("latest_step.peer_listing", "peer ListShards"),
    ("latest_step.durable_listing", "durable listing"),
    ("latest_step.collectives", "collectives"),
    ("latest_step.fallback", "fallback"),
    ("load.query", "load: query again"),
    ("load.fetch_open", "load: Fetch+Open"),
    ("load.data", "load: bytes"),
)


def _count(v: float) -> str:
    """A message count: whole numbers with separators, a mean with up to 3 decimals."""
    if float(v).is_integer():
        return f"{int(v):,}"
    return f"{v:,.3f}".rstrip("0").rstrip(".")


def _secs(v: float) -> str:
    if v == 0:
        return "0"
    return f"{v:,.0f}" if v >= 1000 else f"{v:.3g}"


def _exponent(e: float | None) -> str:
    return "-" if e is None else f"{e:.2f}"


def _costs(point: ProtocolPoint) -> list[ProtocolCost]:
    return [point.costs[k] for k in (*PROTOCOLS, "group_expected") if k in point.costs]


def _label(cost: ProtocolCost, cfg: ProtocolConfig) -> str:
    label = PROTOCOL_LABELS[cost.protocol]
    return f"{label} (p={cfg.fallback_probability:g})" if cost.protocol == "group_expected" else label


def protocol_rows(points: Sequence[ProtocolPoint]) -> list[list[str]]:
    """One row per (host count, protocol)."""
    rows = []
    for p in points:
        for j, c in enumerate(_costs(p)):
            rows.append(
                [
                    f"{p.config.hosts:,}" if j == 0 else "",
                    f"{p.config.world:,}" if j == 0 else "",
                    _label(c, p.config),
                    _count(c.rpcs_per_rank),
                    _count(c.rpcs_total),
                    _count(c.list_shards_served_per_store),
                    _count(c.durable_listings),
                    _count(c.durable_list_requests),
                    _count(c.collectives),
                    _secs(c.latest_step_s),
                    _secs(c.load_s),
                    _secs(c.restart_s),
                ]
            )
    return rows


def timeline_rows(points: Sequence[ProtocolPoint]) -> list[list[str]]:
    """The slowest rank's restart, phase by phase (seconds), one row per (host count, protocol)."""
    rows = []
    for p in points:
        for j, c in enumerate(_costs(p)):
            phases = [_secs(c.phases[k]) if k in c.phases else "-" for k, _ in PROTOCOL_PHASES]
            rows.append([f"{p.config.hosts:,}" if j == 0 else "", _label(c, p.config), *phases, _secs(c.restart_s)])
    return rows


def growth_rows(points: Sequence[ProtocolPoint]) -> tuple[list[str], list[list[str]]]:
    """(headers, rows): per metric, each protocol's order of growth and its empirical exponents between host counts."""
    ordered = sorted(points, key=lambda p: p.config.hosts)
    steps = [f"{a.config.hosts:,}->{b.config.hosts:,}" for a, b in itertools.pairwise(ordered)]
    exps = growth(ordered)
    headers = ["metric", "legacy", *(f"legacy e {s}" for s in steps), "group", *(f"group e {s}" for s in steps)]
    rows = []
    for name, (label, legacy_order, group_order) in COMPLEXITY.items():
        rows.append(
            [
                label,
                legacy_order,
                *(_exponent(e) for e in exps[name]["legacy"]),
                group_order,
                *(_exponent(e) for e in exps[name]["group"]),
            ]
        )
    return headers, rows


def render_protocol(points: Sequence[ProtocolPoint], console: Console, title: str) -> None:
    """The three protocol tables on the terminal: messages and times, the timeline, growth with N."""
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for name, right in PROTOCOL_COLUMNS:
        t.add_column(name, justify="right" if right else "left")
    rows = protocol_rows(points)
    for i, row in enumerate(rows):
        last_of_point = i + 1 == len(rows) or rows[i + 1][0] != ""
        t.add_row(*row, style=None if row[2].startswith("legacy") else "green", end_section=last_of_point and i + 1 < len(rows))
    console.print(t)
    tl = Table(title="restart timeline of the slowest rank (s)", title_justify="left")
    for name in ("hosts", "protocol", *(h for _, h in PROTOCOL_PHASES), "total"):
        tl.add_column(name, justify="left" if name == "protocol" else "right")
    for row in timeline_rows(points):
        tl.add_row(*row)
    console.print(tl)
    headers, grows = growth_rows(points)
    if len(points) > 1:
        g = Table(title="growth with N (e: empirical exponent, value ~ N^e, between consecutive host counts)", title_justify="left")
        for name in headers:
            g.add_column(name, justify="right" if " e " in name else "left")
        for row in grows:
            g.add_row(*row)
        console.print(g)


def protocol_markdown(points: Sequence[ProtocolPoint], title: str) -> str:
    """The protocol tables as Markdown (``memstore simulate protocol --markdown``)."""
    main = _markdown([c for c, _ in PROTOCOL_COLUMNS], [r for _, r in PROTOCOL_COLUMNS], protocol_rows(points))
    heads = ["hosts", "protocol", *(h for _, h in PROTOCOL_PHASES), "total"]
    timeline = _markdown(heads, [h != "protocol" for h in heads], timeline_rows(points))
    out = f"{title}\n\n{main}\n\nRestart timeline of the slowest rank (s):\n\n{timeline}\n"
    if len(points) > 1:
        headers, rows = growth_rows(points)
        growth_md = _markdown(headers, [" e " in h for h in headers], rows)
        out += f"\nGrowth with N (e: empirical exponent between consecutive host counts):\n\n{growth_md}\n"
    return out


def protocol_to_json(points: Sequence[ProtocolPoint], parameters: dict[str, Any]) -> dict[str, Any]:
    """The JSON document ``memstore simulate protocol --json`` writes."""
    return {
        "tool": "memstore simulate protocol",
        "version": PROTOCOL_JSON_VERSION,
        "note": PROTOCOL_NOTE,
        "parameters": parameters,
        "points": [p.to_dict() for p in points],
        "growth": growth(points),
        "complexity": {name: {"legacy": lo, "group": go} for name, (_, lo, go) in COMPLEXITY.items()},
    }


# -- the save path and gossip (memstore.sim.save_path_model) -----------------------------------------------
SAVE_TITLE = (
    "save path per saved step beyond --keep (today: every store lists every other; floor: agreed in the process group) "
    "and gossip per --discovery-interval (full answers vs push-pull). Model outputs, not measurements"
)


def save_rows(costs: Sequence[SaveCost]) -> tuple[list[str], list[list[str]]]:
    """(headers, rows): one row per metric, one column per host count, then its order and exponents."""
    ordered = sorted(costs, key=lambda c: c.hosts)
    steps = [f"e {a.hosts:,}->{b.hosts:,}" for a, b in itertools.pairwise(ordered)]
    exps = save_growth(ordered)
    headers = ["metric", *(f"N={c.hosts:,}" for c in ordered), "order", *steps]
    rows = [[label, *(_count(getattr(c, name)) for c in ordered), order, *(_exponent(e) for e in exps[name])]
            for name, label, order in SAVE_METRICS]  # fmt: skip
    return headers, rows


def render_save_path(costs: Sequence[SaveCost], console: Console) -> None:
    from rich.table import Table

    headers, rows = save_rows(costs)
    t = Table(title=SAVE_TITLE, title_justify="left")
    for i, name in enumerate(headers):
        t.add_column(name, justify="left" if i == 0 or name == "order" else "right")
    for row in rows:
        t.add_row(*row)
    console.print(t)


def save_path_markdown(costs: Sequence[SaveCost]) -> str:
    headers, rows = save_rows(costs)
    return f"{SAVE_TITLE}:\n\n{_markdown(headers, [i > 0 and h != 'order' for i, h in enumerate(headers)], rows)}\n"
