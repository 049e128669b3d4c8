"""``memstore inspect``: one step of a job, rank by rank: size, checksum fingerprint, owner, stripe and every copy."""

from __future__ import annotations

import argparse
import sys

from memstore.cli.common import add_store_address_arguments

HELP = "one step of a job: per-rank shards, copies, sizes, checksums"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_store_address_arguments(p)
    p.add_argument("--job", required=True)
    p.add_argument("--step", type=int, default=None, help="the step (default: the newest restorable one)")
    p.add_argument("--json", action="store_true", help="print the same facts as JSON")


def run(args: argparse.Namespace) -> int:
    import grpc

    from memstore import survey
    from memstore.cli import render

    try:
        s = survey.take(args.store, args.timeout, job=args.job)
    except grpc.RpcError as err:
        print(render.rpc_problem("inspect", args.store, err), file=sys.stderr)
        return 1
    step = args.step if args.step is not None else s.restorable.get(args.job, {}).get("step")
    if step is None:
        print(f"memstore inspect: job {args.job!r} has no restorable step; pass --step (memstore ls --job {args.job})", file=sys.stderr)
        return 1
    ranks = survey.shards_of(s, args.job, step)
    if args.json:
        render.print_json({"job": args.job, "step": step, "ranks": ranks})
        return 0 if ranks else 1
    if not ranks:
        print(f"memstore inspect: no store holds step {step} of job {args.job!r} in RAM (memstore ls --job {args.job})", file=sys.stderr)
        return 1
    rows = []
    for r in ranks:
        copies = ", ".join(f"{c['host']} ({c['state']}{'' if c['verified'] else ', UNVERIFIED'})" for c in r["copies"])
        checksum = r["checksum"] if r["consistent"] else render.bad(f"{r['checksum']} (copies DIFFER)")
        rank = f"{r['rank']}/{r['world_size']}"
        stripe = render.stripe(r["stripe"])
        rows.append([rank, r["timeline"] or "-", render.size(r["bytes"]), r["chunks"], checksum, r["owner"], stripe, copies])
    out = render.console()
    columns = ["rank", "timeline", "size", "chunks", "checksum", "owner", "stripe", "copies"]
    out.print(render.table(f"job {args.job} step {step}", columns, rows))
    return 0
