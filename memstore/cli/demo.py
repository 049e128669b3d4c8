"""``memstore demo``: the end-to-end showcase (:mod:`memstore.demo.showcase`)."""

from __future__ import annotations

import argparse

HELP = "end-to-end showcase: DDP training survives a host loss bit-exactly"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--hosts", type=int, default=None, help="stores on 127.0.0.1, one trainer rank each by default (default 4, or K+M for ec:K+M)"
    )
    p.add_argument("--replicas", type=int, default=None, help="copies of each shard, the owner's included (default 2)")
    p.add_argument("--redundancy", default=None, help="the stores' --redundancy, replicas:R or ec:K+M (instead of --replicas)")
    p.add_argument("--ranks", type=int, default=None, help="DDP ranks (default: one per host)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-at", type=int, default=20, help="SIGKILL a host after this step")
    p.add_argument("--model-size", choices=["tiny", "small", "medium"], default="small")
    p.add_argument(
        "--replica-group",
        action="store_true",
        help="the ranks save as one data-parallel replica group (CheckpointClient(replica_group=dist.group.WORLD)): each "
        "captures ~1/ranks of the state and the stores hold it R times instead of ranks x R; the demo checks both",
    )
    p.add_argument("--report", default=None, help="write the summary as JSON here")


def run(args: argparse.Namespace) -> int:
    from memstore.cli.common import resolve_redundancy
    from memstore.demo.showcase import run_demo

    return run_demo(
        hosts=args.hosts,
        redundancy=resolve_redundancy(args.replicas, args.redundancy),
        ranks=args.ranks,
        steps=args.steps,
        kill_at=args.kill_at,
        model_size=args.model_size,
        replica_group=args.replica_group,
        report=args.report,
    )
