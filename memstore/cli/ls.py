"""``memstore ls``: the shards a store holds, one line each."""

from __future__ import annotations

import argparse
import sys

from memstore.cli.common import add_store_address_arguments

HELP = "list shards on a store"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_store_address_arguments(p)
    p.add_argument("--job", default=None)


def run(args: argparse.Namespace) -> int:
    import grpc

    from memstore.core.sizes import format_size
    from memstore.v1 import store_pb2 as pb
    from memstore.v1.channel import store_stub

    channel, stub = store_stub(args.store)
    try:
        resp = stub.List(pb.ListRequest(job_id=args.job or ""), timeout=args.timeout)
    except grpc.RpcError as err:
        print(f"ls failed: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    finally:
        channel.close()
    for s in resp.shards:
        m = s.manifest
        state = pb.ShardState.Name(s.state).removeprefix("SHARD_STATE_").lower()
        print(
            f"{m.key.job_id}\tstep={m.key.step}\trank={m.key.rank}/{m.world_size}\t{format_size(m.nbytes)}\t{state}\t"
            f"owner={m.owner_host}{'  ' + s.error if s.error else ''}"
        )
    return 0
