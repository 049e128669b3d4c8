"""The runner: every system on every state, one after the other in this process (the trainer), one JSON document and
one table (``--docs`` rewrites the table's section of ``docs/benchmarks.md`` between its markers)."""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.peers.common import Context, System, Unavailable, dumps, process_memory, trainer_memory
from benchmarks.peers.states import KINDS, StateSpec, build, shape_of

SYSTEMS = {
    "memstore": "system_memstore:MemstoreSystem",
    "dcp": "system_dcp:DcpSystem",
    "ml-flashpoint": "system_mlflashpoint:MlFlashpointSystem",
    "dlrover": "system_dlrover:DlroverSystem",
}


def say(what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def load_system(name: str) -> System | str:
    """The system ``name``, or why it cannot run here (its module or its peer does not import, or it says so)."""
    module, _, cls = SYSTEMS[name].partition(":")
    try:
        system: System = getattr(importlib.import_module(f"benchmarks.peers.{module}"), cls)()
        why = system.unavailable()
    except (ImportError, Unavailable) as exc:
        return f"{type(exc).__name__}: {exc}"
    return why if why else system


def row_command(args: argparse.Namespace, system: str, kind: str) -> str:
    flags = ["--systems", system, "--states", kind, "--saves", str(args.saves)]
    flags += (
        ["--size", args.size, "--tensors", str(args.tensors)]
        if kind == "tensors"
        else ["--layers", str(args.layers), "--dim", str(args.dim)]
    )
    return shlex.join(["python", "-m", "benchmarks.peers", *flags])


def verified(report: dict[str, Any], exact: str, keys_as_str: str) -> str:
    if report.get("fingerprint") == exact:
        return "bit-exact"
    if report.get("fingerprint_keys_as_str") == keys_as_str:
        return "bit-exact (dict keys restored as str)"
    return "MISMATCH"


def measure(system: System, state: Any, ctx: Context, saves: int) -> dict[str, Any]:
    """``saves`` saves, each timed from the call to its return (stall) and to surviving a host loss; the memory
    held after them; the two restores in fresh processes."""
    from memstore.bench.state import p50

    out: dict[str, Any] = {"saves": []}
    before = process_memory(os.getpid())
    system.start(ctx)
    for step in range(1, saves + 1):
        t0 = time.perf_counter()
        token = system.save(step, state)
        t1 = time.perf_counter()
        info = system.wait_durable(token)
        t2 = time.perf_counter()
        # a system whose trainer is another process times the save there: its figures replace these
        out["saves"].append({"step": step, "stall_seconds": t1 - t0, "durable_seconds": t2 - t0, **info})
    stalls, durables = [s["stall_seconds"] for s in out["saves"]], [s["durable_seconds"] for s in out["saves"]]
    out.update(stall_first=stalls[0], stall_steady=p50(stalls[1:]), durable_first=durables[0], durable_steady=p50(durables[1:]))
    after = process_memory(os.getpid())
    out["memory"] = {
        "trainer": trainer_memory(before, after),
        **system.memory(),
    }  # the system's "trainer" replaces this one where it has one
    out["restore_local"] = system.restore_local()
    out["restore_after_loss"] = system.restore_after_loss()
    return out


def run_one(name: str, spec: StateSpec, state: Any, args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.peers.common import keys_as_str
    from memstore.bench.state import fingerprint, nbytes_of, tensors_of

    row: dict[str, Any] = {"system": name, "state": spec.kind, "command": row_command(args, name, spec.kind), "loadavg": os.getloadavg()}
    loaded = load_system(name)
    if isinstance(loaded, str):
        return {**row, "available": False, "reason": loaded}
    nbytes = nbytes_of(tensors_of(state))
    exact, as_str = fingerprint(state), fingerprint(keys_as_str(state))
    with tempfile.TemporaryDirectory(prefix=f"peers-{name}-", dir=args.workdir) as d:
        ctx = Context(Path(d), nbytes, exact, 120.0 + nbytes / (20 << 20), spec.describe())
        row.update(available=True, version=loaded.version())
        try:
            row.update(measure(loaded, state, ctx, args.saves))
            for kind in ("restore_local", "restore_after_loss"):
                row[kind]["verified"] = verified(row[kind], exact, as_str)
        except Exception as exc:  # a peer that fails here is a result: the exact error, the run goes on
            row["error"] = f"{type(exc).__name__}: {exc}"
            row["traceback"] = traceback.format_exc()[-4000:]
            say(f"{name} on {spec.kind}: {row['error']}")
        finally:
            try:
                loaded.stop()
            except Exception as exc:  # reported with the row, the run goes on
                row["stop_error"] = f"{type(exc).__name__}: {exc}"
            row["notes"] = ctx.notes
    gc.collect()
    return row


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    p.add_argument("--states", default=",".join(KINDS), help="comma-separated, of tensors, model")
    p.add_argument("--size", default="1GiB", help="bytes of the tensors state (default 1GiB)")
    p.add_argument("--tensors", type=int, default=64, help="float32 tensors of the tensors state (default 64)")
    p.add_argument("--layers", type=int, default=8, help="transformer layers of the model state (default 8)")
    p.add_argument("--dim", type=int, default=1024, help="transformer width of the model state (default 1024)")
    p.add_argument("--saves", type=int, default=3, help="saves per system and state: the first, then the steady ones (default 3)")
    p.add_argument("--workdir", default=None, help="where the systems' files go (default: the temp dir)")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write every number here")
    p.add_argument("--docs", default=None, metavar="PATH", help="rewrite the table between the peers-table markers of this page")
    args = p.parse_args(argv)
    unknown = [s for s in args.systems.split(",") if s not in SYSTEMS] + [k for k in args.states.split(",") if k not in KINDS]
    if unknown or args.saves < 2:
        p.error(f"unknown systems or states {unknown}" if unknown else "--saves must be >= 2 (the first and a steady one)")
    return args


def main(argv: list[str] | None = None) -> int:
    from benchmarks.peers.table import markdown, rewrite_section
    from memstore.bench import machine
    from memstore.core.sizes import parse_size

    args = parse(argv)
    started = time.time()
    doc: dict[str, Any] = {"command": shlex.join([sys.executable, "-m", "benchmarks.peers", *(sys.argv[1:] if argv is None else argv)])}
    doc["machine"] = {**machine(), "loadavg_start": os.getloadavg()}
    doc["states"], doc["rows"] = {}, []
    for kind in args.states.split(","):
        spec = StateSpec(kind, parse_size(args.size), args.tensors, args.layers, args.dim)
        say(f"building the {kind} state")
        state = build(spec)
        doc["states"][kind] = {**spec.describe(), **shape_of(state)}
        for name in args.systems.split(","):
            say(f"{name} on the {kind} state")
            doc["rows"].append(run_one(name, spec, state, args))
        del state
        gc.collect()
    doc["machine"]["loadavg_end"] = os.getloadavg()
    doc["seconds"] = time.time() - started
    table = markdown(doc)
    print(table)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(dumps(doc))
    if args.docs:
        rewrite_section(Path(args.docs), table)
    return 1 if any(r.get("error") for r in doc["rows"]) else 0
