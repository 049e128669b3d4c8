"""``memstore drain``: make one store leave on purpose (as on SIGTERM), after giving what only it holds another copy."""

from __future__ import annotations

import argparse
import os
import sys
import time

from memstore.cli.common import add_credential_arguments

HELP = "make a store leave the cluster without losing what only it holds"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store",
        default=os.environ.get("MEMSTORE_LISTEN") or None,
        help="address HOST:PORT of the store to drain (default: $MEMSTORE_LISTEN, the store's own --listen, so a "
        "Kubernetes preStop hook in the store's container needs no address)",
    )
    p.add_argument("--timeout", type=float, default=3.0, help="deadline of each RPC")
    p.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the store to finish and exit (0 = do not wait)")
    add_credential_arguments(p)  # draining needs the admin token when auth is on


def run(args: argparse.Namespace) -> int:
    if not args.store:
        raise argparse.ArgumentError(None, "--store HOST:PORT is required (or set MEMSTORE_LISTEN)")
    import grpc

    from memstore.v1 import store_pb2 as pb
    from memstore.v1.channel import store_stub

    channel, stub = store_stub(args.store)
    try:
        try:
            resp = stub.Drain(pb.DrainRequest(), timeout=args.timeout)
        except grpc.RpcError as err:
            print(f"memstore drain: store {args.store}: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
        print(f"store {args.store}: {'drain started' if resp.started else 'already draining'}", flush=True)
        deadline = time.monotonic() + args.wait
        last = ""
        while time.monotonic() < deadline:
            try:
                h = stub.Health(pb.HealthRequest(), timeout=args.timeout)
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE:  # busy or refusing: still there
                    time.sleep(0.2)
                    continue
                print(f"store {args.store}: drained and gone (its log says what it copied)", flush=True)
                return 0
            if h.drain_progress and h.drain_progress != last:
                print(f"  {h.drain_progress}", flush=True)
                last = h.drain_progress
            time.sleep(0.2)
        if args.wait:
            print(f"memstore drain: store {args.store} still running after {args.wait:.0f}s", file=sys.stderr)
            return 1
        return 0
    finally:
        channel.close()
