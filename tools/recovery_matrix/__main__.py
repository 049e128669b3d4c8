"""``python -m tools.recovery_matrix``: run the recovery matrix and write its page and JSON."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

from tools.recovery_matrix import report
from tools.recovery_matrix.catalogue import FAULTS
from tools.recovery_matrix.fault import NotRunHere
from tools.recovery_matrix.runner import run_row
from tools.recovery_matrix.scenario import RowResult


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.recovery_matrix", description=__doc__)
    p.add_argument("--only", nargs="*", default=None, metavar="FAULT_ID", help="run these faults only; the other rows are kept")
    p.add_argument("--markdown", default="docs/recovery-matrix.md")
    p.add_argument("--json", default="docs/bench/recovery-matrix.json")
    p.add_argument("--steps", type=int, default=6, help="steps every rank commits before the fault")
    args = p.parse_args(argv)
    unknown = set(args.only or ()) - {f.id for f in FAULTS}
    if unknown:
        p.error(f"unknown fault ids: {', '.join(sorted(unknown))}; known: {', '.join(f.id for f in FAULTS)}")
    faults = [f for f in FAULTS if args.only is None or f.id in args.only]
    results: list[RowResult] = []
    t0 = time.monotonic()
    for fault in faults:
        for config in fault.configs:
            try:
                r = run_row(fault, config, steps=args.steps)
            except NotRunHere as exc:  # this machine cannot inject it: the row keeps its last measurement
                print(f"{'skip':<6} {fault.id:<22} {config.label:<18} not run here: {exc}", flush=True)
                continue
            results.append(r)
            flag = "ok" if r.ok else "FAILED"
            print(f"{flag:<6} {fault.id:<22} {config.label:<18} RPO {r.rpo} (bound {r.rpo_bound}) RTO {r.rto:.2f}s "
                  f"exact {r.exact} {r.note}", flush=True)  # fmt: skip
    cmd = "python -m tools.recovery_matrix" + (f" --only {' '.join(args.only)}" if args.only else "")
    run = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "command": cmd,
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, "
                      f"Python {platform.python_version()}"}  # fmt: skip
    data = report.merge(report.load(Path(args.json)), results, run)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    Path(args.markdown).write_text(report.markdown(data))
    print(f"{len(results)} rows in {time.monotonic() - t0:.0f} s; wrote {args.markdown} and {args.json}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
