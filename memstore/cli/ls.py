"""``memstore ls``: the steps of a job across the cluster (ranks, copies, tiers), or every job's, asked through any store.

``--shards`` lists the raw shards one store holds, one line each (the listing of earlier versions).
"""

from __future__ import annotations

import argparse
import sys

from memstore.cli.common import add_store_address_arguments

HELP = "steps of a job across the cluster, with copies and tiers"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_store_address_arguments(p)
    p.add_argument("--job", default=None, help="the job (default: every job)")
    p.add_argument("--shards", action="store_true", help="the raw shards the --store itself holds, one line each")
    p.add_argument("--json", action="store_true", help="print the same facts as JSON")


def run(args: argparse.Namespace) -> int:
    import grpc

    from memstore import survey
    from memstore.cli import render

    if args.shards:
        return _own_shards(args)
    try:
        s = survey.take(args.store, args.timeout, job=args.job or "")
    except grpc.RpcError as err:
        print(render.rpc_problem("ls", args.store, err), file=sys.stderr)
        return 1
    jobs = [args.job] if args.job else s.jobs()
    doc = {job: survey.steps_of(s, job) for job in jobs}
    down = [h["host"] for h in s.health.values() if "error" in h]
    if args.json:
        render.print_json({"jobs": doc, "unreachable_hosts": down})
        return 0
    out = render.console()
    if args.job and not doc[args.job]:
        print(f"memstore ls: no store holds anything of job {args.job!r}", file=sys.stderr)
        return 1
    for job, steps in doc.items():
        rows = [[r["step"], r["timeline"] or "-", r["ranks"], r["redundancy"], _copies(r, s.replicas), render.size(r["bytes"] or None),
                 render.groups(r["replica_groups"]), ", ".join(r["tiers"]), render.ok("yes") if r["restorable"] else ""]
                for r in steps]  # fmt: skip
        columns = ["step", "timeline", "ranks", "redundancy", "copies (fewest)", "size", "replica groups", "tiers", "restorable"]
        out.print(render.table(f"job {job}", columns, rows))
    for host in down:
        out.print(render.warn(f"{host} did not answer: its copies are not counted"))
    if any("durable" in r["tiers"] for steps in doc.values() for r in steps):
        out.print("durable: the newest spilled step the stores report; older spilled steps stay in the durable tier "
                  "per --spill-keep-last/--spill-keep-best", markup=False, soft_wrap=True)  # fmt: skip
    return 0


def _copies(step: dict[str, object], replicas: int) -> object:
    """The fewest copies of a rank, of R; under ec:K+M the owner's one copy and whether its parity is complete."""
    from memstore.cli import render

    n = step["min_copies"]
    assert isinstance(n, int)
    if step["parity_complete"] is not None:  # ec:K+M: parity is no copy
        text = f"{n} + parity" if step["parity_complete"] else f"{n}, parity incomplete"
        return render.bad(text) if n == 0 else text if step["parity_complete"] else render.warn(text)
    text = f"{n}/{replicas}"
    return render.bad(text) if n == 0 else render.warn(text) if n < replicas else text


def _own_shards(args: argparse.Namespace) -> int:
    import grpc

    from memstore import survey
    from memstore.cli import render
    from memstore.v1 import store_pb2 as pb
    from memstore.v1.channel import store_stub

    channel, stub = store_stub(args.store)
    try:
        resp = stub.List(pb.ListRequest(job_id=args.job or ""), timeout=args.timeout)
    except grpc.RpcError as err:
        print(f"memstore ls: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    finally:
        channel.close()
    rows = [survey.shard_row(x) for x in resp.shards]
    if args.json:
        render.print_json({"host": resp.host_id, "shards": rows})
        return 0
    for r in rows:
        stripe = f"\tstripe={render.stripe(r['stripe'])}" if r["stripe"] else ""
        print(f"{r['job']}\tstep={r['step']}\trank={r['rank']}/{r['world_size']}\t{render.size(r['bytes'])}\t{r['state']}\t"
              f"owner={r['owner']}{stripe}{'  ' + r['error'] if r['error'] else ''}")  # fmt: skip
    return 0
