"""The recovery matrix on paper: ``docs/recovery-matrix.md`` (a table) and its raw results as JSON.

The JSON holds every row measured plus how and where (command, machine, date); the page is made from it alone,
so a row can be re-measured (``--only``) without running the whole matrix again. :func:`table_rows` reads the
page back, for the check that it lists exactly the catalogue's rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tools.recovery_matrix.catalogue import FAULTS
from tools.recovery_matrix.scenario import KIB, STEP_SECONDS, RowResult

HEADER = "| Fault | Id | Configuration | RPO (steps) | RPO bound | RTO (s) | Exact | Restored from | Note |"


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {"runs": {}, "rows": []}


def merge(data: dict[str, Any], results: list[RowResult], run: dict[str, str]) -> dict[str, Any]:
    """``data`` with ``results`` replacing the rows of the same (fault, configuration); ``run`` says how they were measured."""
    fresh = {(r.fault, r.config) for r in results}
    rows = [r for r in data["rows"] if (r["fault"], r["config"]) not in fresh]
    rows += [{**r.__dict__, "ok": r.ok, "run": run["date"]} for r in results]
    order = {(f.id, c.label): i for i, f in enumerate(FAULTS) for c in [*f.configs]}
    rows = sorted((r for r in rows if (r["fault"], r["config"]) in order), key=lambda r: order[(r["fault"], r["config"])])
    runs = {d: v for d, v in {**data["runs"], run["date"]: run}.items() if any(r["run"] == d for r in rows)}
    return {"runs": runs, "rows": rows}


def markdown(data: dict[str, Any]) -> str:
    names = {f.id: f for f in FAULTS}
    out = [
        "# Recovery matrix",
        "",
        "Each fault below was injected into real processes while every trainer rank was saving a checkpoint each step:",
        "store servers and trainer ranks as separate processes on one machine (127.0.0.1), one rank per host, a",
        f"{KIB} KiB state per rank, a step every {STEP_SECONDS} s, in lockstep; spill on = a `file://` durable tier, every step",
        "spilled. After the fault the job restarts and every rank restores (one agreed `latest_step(group=...)`, then `load()`).",
        "R=N: every shard kept N times (`--replicas N`); ec:4+1: one group of five stores, each shard kept whole by its owner",
        "alone plus the group's parity (`--redundancy ec:4+1`, [erasure coding](erasure.md)): one loss survived, two not.",
        "",
        "- **RPO**: the newest step every rank had committed when the fault hit, minus the step restored (0 = nothing lost).",
        "- **RPO bound**: what memstore promises for that configuration; `all` where losing the steps is the correct",
        "  outcome (the only copies were in the RAM of hosts that are gone and nothing was spilled).",
        "- **RTO**: seconds from the fault until every rank holds its restored state, including the restarts the",
        "  fault needs (a store's restart); not the time to start a new trainer process. It is a measurement on the",
        "  machine named below, not a promise.",
        "- **Exact**: every rank restored the same step and its state equals what it saved, byte for byte.",
        "",
        "The page and its raw results (`docs/bench/recovery-matrix.json`) are written by",
        "`python -m tools.recovery_matrix`; the fast suite checks that the rows here are exactly the",
        "catalogue's (`tools/recovery_matrix/catalogue.py`) and all exact.",
        "",
        HEADER,
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        bound = "all" if r["rpo_bound"] is None else str(r["rpo_bound"])
        exact = "yes" if r["exact"] else "**NO**"
        sources = ", ".join(sorted(set(s or "-" for s in r["sources"]))) or "-"
        note = (r["note"] or "").replace("|", "/").replace("\n", " ")
        out.append(f"| {names[r['fault']].name} | `{r['fault']}` | {r['config']} | {r['rpo']} | {bound} | {r['rto']:.2f} | {exact} "
                   f"| {sources} | {note} |")  # fmt: skip
    out += ["", "## Faults", ""]
    out += [f"- `{f.id}`, {f.name}: {f.description}." for f in FAULTS]
    out += ["", "## Measured", ""]
    for date, run in sorted(data["runs"].items()):
        out.append(f"- {date}: `{run['command']}` on {run['machine']}")
    return "\n".join(out) + "\n"


def table_rows(text: str) -> list[tuple[str, str, bool]]:
    """(fault id, configuration, exact) of each row of the page's table."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 9 and cells[1].startswith("`"):
            rows.append((cells[1].strip("`"), cells[2], cells[6] == "yes"))
    return rows
