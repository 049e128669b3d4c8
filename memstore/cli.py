"""The ``memstore`` command line: serve, local-cluster, demo, status, ls, export, reclaim-shm."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from dataclasses import asdict, fields
from typing import Any

from memstore.config import StoreConfig
from memstore.errors import ConfigError, StoreError


def _add_store_flags(p: argparse.ArgumentParser) -> None:
    for f in fields(StoreConfig):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):  # --flag / --no-flag; unset (None) leaves env, file or default in charge
            p.add_argument(flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction, help=StoreConfig.help_of(f.name))
        else:
            p.add_argument(flag, dest=f.name, default=None, metavar=f.name.upper(), help=StoreConfig.help_of(f.name))
    p.add_argument("--config", default=None, help="TOML config file ([store] table); also MEMSTORE_CONFIG")


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level, logging.INFO), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def cmd_serve(args: argparse.Namespace) -> int:
    from memstore.server.app import serve

    cli = {f.name: getattr(args, f.name) for f in fields(StoreConfig)}
    config = StoreConfig.load(cli, config_file=args.config)
    _configure_logging(config.log_level)
    return serve(config)


def cmd_local_cluster(args: argparse.Namespace) -> int:
    from memstore.local_cluster import LocalCluster

    _configure_logging("INFO")
    cluster = LocalCluster(hosts=args.hosts, replicas=args.replicas, capacity=args.capacity, base_port=args.base_port, keep=args.keep)
    stop = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        cluster.start()
        if args.endpoints_file:
            cluster.write_endpoints(args.endpoints_file)
        print(json.dumps({"hosts": cluster.endpoints}), flush=True)
        while not stop:
            for h, sp in cluster.stores.items():
                if not sp.alive and not stop:
                    logging.warning("store %s exited (code %s); see %s", h, sp.proc.returncode if sp.proc else None, sp.log_path)
                    sp.proc = None
            time.sleep(0.2)
    finally:
        cluster.stop()
    return 0


def _stub(address: str):  # type: ignore[no-untyped-def]
    from memstore.v1 import store_pb2_grpc as pb_grpc
    from memstore.v1.channel import insecure_channel

    return pb_grpc.StoreStub(insecure_channel(address))


def cmd_status(args: argparse.Namespace) -> int:
    import grpc

    from memstore.core.sizes import format_size
    from memstore.v1 import store_pb2 as pb

    stub = _stub(args.store)
    try:
        hello = stub.Hello(pb.HelloRequest(), timeout=args.timeout)
    except grpc.RpcError as err:
        print(f"store {args.store} unreachable: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    rows = []
    for hid, addr in zip(hello.peer_ids, hello.peer_addresses, strict=True):
        try:
            h = _stub(addr).Health(pb.HealthRequest(), timeout=args.timeout)
            rows.append(
                {
                    "host": hid,
                    "address": addr,
                    "serving": h.serving,
                    "used": h.used_bytes,
                    "capacity": h.capacity_bytes,
                    "shards": h.shards,
                    "replicating": h.replications_in_flight,
                    "repairing": h.repairs_in_flight,
                    "spill": [
                        {
                            "job": j.job_id,
                            "last_spilled_step": j.last_spilled_step,
                            "failures": j.consecutive_failures,
                            "error": j.last_error,
                            "bytes_written": j.bytes_written,
                        }
                        for j in h.spill
                    ],
                    "orphans": [{"path": o.path, "host_id": o.host_id, "bytes": o.bytes, "files": o.files} for o in h.orphans],
                    "adopted_shards": h.adopted_shards,
                }
            )
        except grpc.RpcError as err:
            rows.append({"host": hid, "address": addr, "serving": False, "error": err.code().name})
    if args.json:
        print(json.dumps({"replicas": hello.replicas, "placement": hello.placement, "hosts": rows}, indent=2))
        return 0
    print(f"cluster: {len(rows)} hosts, R={hello.replicas}, placement={hello.placement}")
    for r in rows:
        if "error" in r:
            print(f"  {r['host']:<8} {r['address']:<22} DOWN ({r['error']})")
        else:
            print(
                f"  {r['host']:<8} {r['address']:<22} up   {format_size(r['used']):>12} / {format_size(r['capacity']):<12} "
                f"shards={r['shards']} replicating={r['replicating']} repairing={r['repairing']}"
                + (f" adopted={r['adopted_shards']}" if r["adopted_shards"] else "")
            )
            for j in r["spill"]:
                state = f"FAILING x{j['failures']}: {j['error']}" if j["failures"] else "ok"
                print(
                    f"           spill {j['job']}: last step {j['last_spilled_step']}, {format_size(j['bytes_written'])} written, {state}"
                )
    _print_orphans(rows)
    return 0 if all(r.get("serving") for r in rows) else 1


def _print_orphans(rows: list[dict[str, Any]]) -> None:
    """Orphaned segment dirs, once per machine (stores on one machine all report the same ones)."""
    from memstore.core.sizes import format_size

    seen: set[tuple[str, str]] = set()
    lines: list[str] = []
    for r in rows:
        machine = r["address"].rpartition(":")[0]
        for o in r.get("orphans", []):
            if (machine, o["path"]) in seen:
                continue
            seen.add((machine, o["path"]))
            lines.append(
                f"  {o['path']}  (host {o['host_id']}, {o['files']} segments, {format_size(o['bytes'])}) on the machine of {r['host']}; "
                f"reclaim there with: memstore reclaim-shm --shm-dir {os.path.dirname(o['path'])}"
            )
    if lines:
        print("orphaned shared memory (segment dirs no running store owns):")
        print("\n".join(lines))


def cmd_reclaim_shm(args: argparse.Namespace) -> int:
    from memstore.core.sizes import format_size
    from memstore.server.segments import orphaned_dirs, reclaim_orphans

    if not args.shm_dir:
        raise ConfigError("--shm-dir is empty: name the directory the stores of this machine use (their --shm-dir)")
    orphans = orphaned_dirs(args.shm_dir) if args.dry_run else reclaim_orphans(args.shm_dir)
    total = sum(o.bytes for o in orphans)
    if args.json:
        print(
            json.dumps(
                {"shm_dir": args.shm_dir, "dry_run": args.dry_run, "bytes": total, "orphans": [asdict(o) for o in orphans]}, indent=2
            )
        )
        return 0
    if not orphans:
        print(f"no orphaned segment dirs under {args.shm_dir}")
        return 0
    for o in orphans:
        print(f"  {o.path}  host {o.host_id}  {o.files} segments  {format_size(o.bytes)}")
    verb = "would reclaim" if args.dry_run else "reclaimed"
    print(f"{verb} {len(orphans)} orphaned segment dirs, {format_size(total)}")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    import grpc

    from memstore.core.sizes import format_size
    from memstore.v1 import store_pb2 as pb

    try:
        resp = _stub(args.store).List(pb.ListRequest(job_id=args.job or ""), timeout=args.timeout)
    except grpc.RpcError as err:
        print(f"ls failed: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    for s in resp.shards:
        m = s.manifest
        state = pb.ShardState.Name(s.state).removeprefix("SHARD_STATE_").lower()
        print(
            f"{m.key.job_id}\tstep={m.key.step}\trank={m.key.rank}/{m.world_size}\t{format_size(m.nbytes)}\t{state}\t"
            f"owner={m.owner_host}{'  ' + s.error if s.error else ''}"
        )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from memstore.demo import run_demo

    return run_demo(
        hosts=args.hosts, replicas=args.replicas, ranks=args.ranks, steps=args.steps, kill_at=args.kill_at, model_size=args.model_size
    )


def cmd_export(args: argparse.Namespace) -> int:
    from memstore.export import run

    return run(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from memstore.bench import main as bench_main

    return bench_main(args.bench_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memstore", description="In-memory replicated checkpoint store for PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run one store server")
    _add_store_flags(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("local-cluster", help="run N stores on 127.0.0.1 until SIGINT/SIGTERM")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--base-port", type=int, default=0, help="first port (0 = free ports)")
    p.add_argument("--capacity", default="2GiB")
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--endpoints-file", default=None, help='write {"hosts": {"<host_id>": "127.0.0.1:<port>"}} here')
    p.set_defaults(func=cmd_local_cluster)

    p = sub.add_parser("demo", help="end-to-end showcase: DDP training survives a host loss bit-exactly")
    p.add_argument("--hosts", type=int, default=4, help="stores on 127.0.0.1 (one trainer rank each by default)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--ranks", type=int, default=None, help="DDP ranks (default: one per host)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-at", type=int, default=20, help="SIGKILL a host after this step")
    p.add_argument("--model-size", choices=["tiny", "small", "medium"], default="small")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "chaos", help="seeded random kills of stores and trainers during real training; checks bit-exactness", add_help=False
    )
    p.add_argument("chaos_args", nargs=argparse.REMAINDER)

    p = sub.add_parser("simulate", help="scale simulator: ETTR and wasted GPU-hours, memstore vs storage checkpoints", add_help=False)
    p.add_argument("sim_args", nargs=argparse.REMAINDER)

    # The bench parses its own flags (memstore bench --help): importing it here would load torch for every command.
    p = sub.add_parser("bench", help="measure save stall, replication and restore against the hardware floors", add_help=False)
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_bench)

    from memstore.export import add_arguments as add_export_arguments  # light: torch is imported only when it runs

    p = sub.add_parser("export", help="write one step as a standard torch.save file (from a cluster or durable storage)")
    add_export_arguments(p)
    p.set_defaults(func=cmd_export)

    store_default = next(str(f.default) for f in fields(StoreConfig) if f.name == "shm_dir")
    p = sub.add_parser("reclaim-shm", help="delete shared-memory segment dirs on this machine that no running store owns")
    p.add_argument(
        "--shm-dir",
        default=os.environ.get("MEMSTORE_SHM_DIR") or store_default,
        help=f"the stores' --shm-dir (default: $MEMSTORE_SHM_DIR, else {store_default})",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="only list them")
    p.set_defaults(func=cmd_reclaim_shm)

    for name, func, helptext in (("status", cmd_status, "health of every store of a cluster"), ("ls", cmd_ls, "list shards on a store")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--store", default="127.0.0.1:7070", help="address of any store of the cluster")
        p.add_argument("--timeout", type=float, default=3.0)
        if name == "ls":
            p.add_argument("--job", default=None)
        else:
            p.add_argument("--json", action="store_true")
        p.set_defaults(func=func)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        # argparse's REMAINDER can't start with a flag (`memstore bench --quick`): hand the rest over as-is.
        from memstore.bench import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["chaos"]:
        from memstore.chaos import main as chaos_main

        return chaos_main(argv[1:])
    if argv[:1] == ["simulate"]:
        from memstore.sim.cli import main as sim_main

        return sim_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except StoreError as exc:
        print(f"memstore {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
