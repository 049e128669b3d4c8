"""``memstore delete``: drop a job's copies (one step, or all) from the RAM of every store of the cluster."""

from __future__ import annotations

import argparse
import sys

from memstore.cli.common import add_store_address_arguments

HELP = "drop a job's steps from every store's RAM (the durable tier keeps its copies)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_store_address_arguments(p)  # needs that job's token or the admin token when auth is on
    p.add_argument("--job", required=True)
    p.add_argument("--step", type=int, default=-1, help="one step (default: every step)")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument("--json", action="store_true", help="print what was deleted as JSON")


def run(args: argparse.Namespace) -> int:
    import grpc

    from memstore import survey
    from memstore.cli import render
    from memstore.v1 import store_pb2 as pb
    from memstore.v1.channel import store_stub

    what = f"step {args.step} of job {args.job!r}" if args.step >= 0 else f"every step of job {args.job!r}"
    if not args.yes:
        if not sys.stdin.isatty():
            print(f"memstore delete: deleting {what} needs --yes when not run at a terminal", file=sys.stderr)
            return 2
        if input(f"delete {what} from every store's RAM? [y/N] ").strip().lower() not in ("y", "yes"):
            print("nothing deleted", file=sys.stderr)
            return 1
    try:
        hello = survey.hello(args.store, args.timeout)
    except grpc.RpcError as err:
        print(render.rpc_problem("delete", args.store, err), file=sys.stderr)
        return 1
    results: dict[str, int | str] = {}
    for host, address in zip(hello.peer_ids, hello.peer_addresses, strict=True):
        channel, stub = store_stub(address)
        try:
            results[host] = stub.Delete(pb.DeleteRequest(job_id=args.job, step=args.step, rank=-1), timeout=args.timeout).deleted
        except grpc.RpcError as err:
            results[host] = 0 if err.code() == grpc.StatusCode.NOT_FOUND else f"{err.code().name}: {err.details()}"
        finally:
            channel.close()
    failed = {h: r for h, r in results.items() if isinstance(r, str)}
    if args.json:
        render.print_json({"job": args.job, "step": args.step, "deleted": results})
    else:
        total = sum(r for r in results.values() if isinstance(r, int))
        print(f"deleted {total} cop{'y' if total == 1 else 'ies'} of {what} from {len(results) - len(failed)} store(s)")
        for host, problem in failed.items():
            print(f"  {host}: {problem}", file=sys.stderr)
    return 1 if failed else 0
