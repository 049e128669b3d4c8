"""Figures of a ``memstore bench`` run, from the JSON it wrote: ``python benchmarks/plot_bench.py run.json [--out run.png]``.

Left: every save's stall (save 1, the early saves, the steady state) beside the memcpy of the same bytes timed right
before it, and its call -> committed time. Right: each ratio over its target (1.0 = at the target; the side of 1.0 that
passes depends on the target's direction, so bars are coloured PASS/MISS). Needs matplotlib (``pip install 'memstore[bench]'``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def plot(doc: dict[str, Any], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (saves_ax, ratios_ax) = plt.subplots(1, 2, figsize=(14, 5))
    saves = doc["saves"]
    steps = [s["step"] for s in saves]
    saves_ax.bar([x - 0.2 for x in steps], [s["stall_seconds"] * 1e3 for s in saves], 0.4, label="save() stall")
    saves_ax.bar([x + 0.2 for x in steps], [(s["memcpy_seconds"] or 0) * 1e3 for s in saves], 0.4, label="memcpy, paired")
    saves_ax.plot(steps, [s["committed_seconds"] * 1e3 for s in saves], "k.-", label="call -> committed")
    saves_ax.set_yscale("log")
    saves_ax.set_xlabel("save (1 = first of a fresh job; phases: " + ", ".join(dict.fromkeys(s["phase"] for s in saves)) + ")")
    saves_ax.set_ylabel("ms")
    saves_ax.legend()
    rows = [r for r in doc["targets"] if r["value"] is not None and r["target"] != "-"]
    limits = [float(r["target"].split()[1]) for r in rows]
    rel = [r["value"] / lim if r["target"].startswith("≤") else lim / r["value"] for r, lim in zip(rows, limits, strict=True)]
    colours = ["tab:green" if r["pass"] else "tab:red" for r in rows]
    ratios_ax.barh([r["ratio"] for r in rows], rel, color=colours)
    ratios_ax.axvline(1.0, color="k", lw=1)
    ratios_ax.set_xscale("log")
    ratios_ax.set_xlabel("how far from the target (< 1: passes, > 1: misses by that factor)")
    ratios_ax.invert_yaxis()
    size = doc["state"]["bytes"] / 2**20
    fig.suptitle(f"memstore bench: {size:g} MiB, {doc['config']['hosts']} hosts, R={doc['config']['replicas']}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/plot_bench.py", description=__doc__.splitlines()[0])
    p.add_argument("json", help="what memstore bench --json wrote")
    p.add_argument("--out", default=None, help="the PNG (default: next to the JSON, same name)")
    args = p.parse_args(argv)
    out = args.out or str(Path(args.json).with_suffix(".png"))
    try:
        plot(json.loads(Path(args.json).read_text()), out)
    except ImportError as exc:
        print(
            f"plot_bench.py: needs matplotlib, which comes with the [bench] extra: pip install 'memstore[bench]' ({exc})", file=sys.stderr
        )
        return 2
    print(f"figures written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
