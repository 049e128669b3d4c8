"""``memstore bench``: memstore's save stall, replication and restores as ratios over baselines measured in the same run.

One run, one state size (default 1 GiB of float32 state on one rank), on freshly started local stores (2 hosts, R=2):

* baselines (:mod:`~memstore.bench.baselines`, :mod:`~memstore.bench.baselines_dcp`): a memcpy into pre-faulted memory, raw
  TCP between two Python processes on loopback, ``torch.save`` + fsync / ``torch.load``, DCP ``async_save``;
* saves (:mod:`~memstore.bench.measure`): save 1 of a fresh job, the later saves and the steady state, each paired
  with a memcpy of the same bytes right before it; the small saves of a 1 MiB state;
* restores, each in a new process (:mod:`~memstore.bench.rig`): from local RAM after a trainer crash, from peer
  RAM after a host loss;
* data parallelism (:mod:`~memstore.bench.data_parallel`, ``--dp-size``): D = 1, 2, 4 ranks of one state on 4 other
  stores, each saving its whole state (today) or a 1/D stripe (a replica group): stall, bytes captured, RAM, restores;
* several ranks per host (:mod:`~memstore.bench.ranks`, ``--ranks-per-host N``, N >= 2): N rank processes on one store
  save ``--size``/N bytes each at once, repeatedly: each save's stall over its own rank's memcpy, the RAM multiple;
* one table (:mod:`~memstore.bench.targets`): ratio, measured, target, PASS/MISS.

Every raw number goes to ``--json``; ``benchmarks/plot_bench.py`` draws it. This module imports only the standard
library (the command line builds its parser from it); torch is imported when a run starts.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from memstore.core.sizes import parse_size

__all__ = ["add_arguments", "main", "run"]

QUICK: dict[str, Any] = {"size": "64MiB", "saves": 2, "restores": 1, "small_saves": 5, "dp_size": "16MiB"}
DEFAULTS: dict[str, Any] = {"size": "1GiB", "saves": 5, "restores": 3, "small_saves": 30, "dp_size": "256MiB"}
JOB = "bench"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every ``memstore bench`` flag."""
    p.add_argument("--size", default=None, help="state bytes on the one benchmarked rank (default 1GiB; --quick 64MiB)")
    p.add_argument("--hosts", type=int, default=2, help="stores in the local cluster (default 2)")
    p.add_argument("--replicas", type=int, default=2, help="replication factor R (default 2)")
    p.add_argument("--keep", type=int, default=2, help="steps each store keeps (default 2); saves 2..keep+2 are the early saves")
    p.add_argument("--saves", type=int, default=None, help="steady saves after save 1 and the early saves (default 5; --quick 2)")
    p.add_argument(
        "--restores", type=int, default=None, help="repetitions of each restore, the disk/DCP baselines, DP saves (default 3; --quick 1)"
    )
    p.add_argument(
        "--small-saves", type=int, default=None, help="saves of the 1 MiB state after its first (default 30; --quick 5; 0: skip)"
    )
    p.add_argument(
        "--dp-size", default=None, help="state bytes on each of D=1,2,4 data-parallel ranks (default 256MiB; --quick 16MiB; 0: skip)"
    )
    p.add_argument(
        "--ranks-per-host", type=int, default=1, metavar="N",
        help="also run N rank processes on one store, each saving --size/N bytes at once, repeatedly (default 1: not run)",
    )  # fmt: skip
    p.add_argument(
        "--idle-wait", type=float, default=60.0, metavar="SECONDS",
        help="after the saves, wait up to this long for the stores to give the job's spares back (it goes idle after ~30 s) "
        "and report the RAM then (default 60; 0: not measured)",
    )  # fmt: skip
    p.add_argument("--quick", action="store_true", help="64MiB, 2 steady saves, 1 restore, 5 small saves, 16MiB DP (smoke test)")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write every raw number, ratio and target here")
    p.add_argument("--disk-dir", default=None, help="directory on local disk for the torch.save and DCP baselines (default: the temp dir)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random state")
    p.add_argument("--data-plane", choices=("tcp", "grpc"), default=None, help="passed to the stores (how replicas and pulls travel)")
    p.add_argument("--prefault", type=_prefault, default=None, metavar="SIZE|auto", help="passed to the stores as MEMSTORE_PREFAULT")
    p.add_argument("--store-env", action="append", default=[], metavar="KEY=VALUE", help="extra environment of the stores, repeatable")
    p.add_argument(
        "--shm-dir", type=_directory, default="/dev/shm", metavar="DIR",
        help="the tmpfs the stores keep their segments in (default /dev/shm); e.g. one mounted with huge pages (docs/operations.md)",
    )  # fmt: skip


def _directory(text: str) -> str:
    """``--shm-dir``: an existing directory this process may write in (checked before any store starts)."""
    import os

    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    if not os.access(text, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not writable by this user")
    return text


def _prefault(text: str) -> str:
    """``--prefault``: auto or a size (checked here, so a bad one fails before any store starts); kept as given."""
    if text.strip().lower() != "auto":
        try:
            parse_size(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{exc}; or auto") from None
    return text


def config_of(args: argparse.Namespace) -> dict[str, Any]:
    """The run's configuration: flags given, else --quick's values, else the defaults. ValueError when it cannot run."""
    from memstore.core.sizes import parse_size

    preset = QUICK if args.quick else DEFAULTS
    pick = {k: preset[k] if getattr(args, k) is None else getattr(args, k) for k in DEFAULTS}
    if not 1 <= args.replicas <= args.hosts <= 8:
        raise ValueError(f"need 1 <= --replicas ({args.replicas}) <= --hosts ({args.hosts}) <= 8")
    if args.idle_wait < 0:
        raise ValueError(f"--idle-wait must be >= 0 seconds (0: not measured), got {args.idle_wait}")
    if pick["saves"] < 1 or pick["restores"] < 1 or pick["small_saves"] < 0 or args.keep < 1:
        raise ValueError("--saves, --restores and --keep must be >= 1, --small-saves >= 0")
    from memstore.bench.ranks import check_ranks

    check_ranks(args.ranks_per_host, parse_size(str(pick["size"])))
    env = dict(item.split("=", 1) for item in args.store_env if "=" in item)
    if args.prefault is not None:
        env["MEMSTORE_PREFAULT"] = args.prefault
    return {
        "size": parse_size(str(pick["size"])), "hosts": args.hosts, "replicas": args.replicas, "keep": args.keep,
        "saves": pick["saves"], "restores": pick["restores"], "small_saves": pick["small_saves"], "quick": args.quick,
        "dp_size": parse_size(str(pick["dp_size"])),
        "seed": args.seed, "disk_dir": args.disk_dir, "data_plane": args.data_plane, "store_env": env, "json": args.json_path,
        "shm_dir": args.shm_dir, "ranks_per_host": args.ranks_per_host, "idle_wait": args.idle_wait,
    }  # fmt: skip


def say(what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def machine(shm_dir: str = "/dev/shm") -> dict[str, Any]:
    import os

    import torch

    from memstore.server.memory.shm_pages import shm_pages
    from trainer_client.knobs import save_switches

    pages = shm_pages(shm_dir)
    return {
        "python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(), "platform": platform.platform(),
        "shm_dir": shm_dir, "shm_huge_pages": pages.huge, "shm_pages": pages.describe(),
        **save_switches(),  # the trainer's: trainer_hashing, marked_captures
    }  # fmt: skip


def measure_all(config: dict[str, Any]) -> dict[str, Any]:
    """The whole run: the baselines, then the saves, small saves and restores on fresh stores; the run's document."""
    from memstore.bench.baselines import baseline_disk, baseline_hash, baseline_memcpy, baseline_tcp
    from memstore.bench.baselines_dcp import baseline_dcp
    from memstore.bench.measure import measure_prepared_first_save, measure_restores, measure_saves, measure_small_saves
    from memstore.bench.rig import RamSampler, idle_ram, ram_fields, running, start_cluster
    from memstore.bench.state import LAYOUT, make_state, nbytes_of, tensors_of

    size, reps = config["size"], config["restores"]
    say(f"generating {size} bytes of state")
    state = make_state(size, config["seed"])
    tensors = tensors_of(state)
    shard_bytes = nbytes_of(tensors)  # the shard's header adds a few KiB: negligible next to the baselines' noise
    doc: dict[str, Any] = {"config": config, "machine": machine(config["shm_dir"])}
    doc["state"] = {"bytes": nbytes_of(tensors), "shard_bytes": shard_bytes, "tensors": len(tensors), "layout": LAYOUT}
    say("floors: memcpy, raw TCP, the store's verification, torch.save + fsync / torch.load, DCP async_save")
    doc["floors"] = {
        "memcpy": baseline_memcpy(tensors), "tcp": baseline_tcp(shard_bytes), "hash": baseline_hash(shard_bytes),
        "disk": baseline_disk(state, config["disk_dir"], reps), "dcp": baseline_dcp(state, config["disk_dir"], reps),
    }  # fmt: skip
    say(f"starting {config['hosts']} stores, R={config['replicas']}")
    cluster = start_cluster(
        config["hosts"], config["replicas"], config["keep"], shard_bytes, config["data_plane"], config["store_env"], config["shm_dir"]
    )
    with running(cluster):
        say("saves from the first")
        ram = RamSampler(cluster)
        try:
            with ram.sampling():
                doc["saves"] = measure_saves(cluster, JOB, state, config["keep"], config["saves"])
            settled = ram.used()
            if config["idle_wait"] > 0:
                say("the stores' RAM once the job stops saving (its spares go back after ~30 s)")
            idle = idle_ram(ram, config["idle_wait"]) if config["idle_wait"] > 0 else None
            doc["ram"] = ram_fields(ram.peak, settled, idle, doc["state"]["bytes"])
        finally:
            ram.close()
        if config["small_saves"]:
            say("small saves")
            doc["small_saves"] = measure_small_saves(cluster, f"{JOB}-small", config["small_saves"], config["seed"], config["keep"])
        say("restores in a new process: from local RAM, from peer RAM after a host loss")
        doc["restores"] = measure_restores(cluster, JOB, state, config["replicas"], reps, config["keep"])
    say("save 1 of a fresh job on fresh stores after prepare() at set-up")
    cluster = start_cluster(
        config["hosts"], config["replicas"], config["keep"], shard_bytes, config["data_plane"], config["store_env"], config["shm_dir"]
    )
    with running(cluster):
        doc["prepared"] = measure_prepared_first_save(cluster, f"{JOB}-prepared", state, config["keep"])
    from memstore.bench.parallel_streams import measure_streams

    say("one shard pushed store to store on 1, 2 and 4 parallel streams")
    doc["streams"] = measure_streams(shard_bytes, reps, config["store_env"], config["shm_dir"])
    if config["dp_size"]:
        from memstore.bench.data_parallel import measure_data_parallel

        say(f"data parallel: D=1, 2, 4 ranks of one {config['dp_size']}-byte state, without and with a replica group")
        del state, tensors
        dp_state = make_state(config["dp_size"], config["seed"])
        doc["data_parallel"] = measure_data_parallel(
            dp_state, config["replicas"], reps, config["data_plane"], config["store_env"], config["shm_dir"]
        )
    if config["ranks_per_host"] > 1:
        from memstore.bench import ranks

        n = config["ranks_per_host"]
        say(f"{n} rank processes on one store, {config['size'] // n} bytes each, saving at once")
        doc["ranks_per_host"] = ranks.measure(config)
    return doc


def finish(doc: dict[str, Any]) -> dict[str, Any]:
    """The run's ratios and targets added to its document."""
    from memstore.bench.targets import compute_ratios, evaluate

    doc["ratios"] = compute_ratios(doc)[0]
    doc["targets"] = evaluate(doc)
    restored = [r["verified_equal"] for r in doc["restores"].values() if r] + [doc["floors"]["disk"]["load_verified"]]
    doc["ok"] = all(s["copies"] >= doc["config"]["replicas"] for s in doc["saves"]) and all(restored)
    if "data_parallel" in doc:
        from memstore.bench.data_parallel import ok

        doc["ok"] = doc["ok"] and ok(doc["data_parallel"])
    if "ranks_per_host" in doc:
        from memstore.bench import ranks

        doc["ok"] = doc["ok"] and ranks.ok(doc["ranks_per_host"])
    return doc


def run_config(config: dict[str, Any], command: str) -> int:
    from memstore.bench.targets import text_table

    started = time.time()
    doc = {"command": command, **finish(measure_all(config))}
    doc["seconds"] = time.time() - started
    print(text_table(doc["targets"]))
    if "data_parallel" in doc:
        from memstore.bench import data_parallel

        print("\n" + data_parallel.text_table(doc["data_parallel"]))
    if "ranks_per_host" in doc:
        from memstore.bench import ranks

        print("\n" + ranks.summary_line(doc["ranks_per_host"]))
    if not doc["ok"]:
        print("memstore bench: a save did not reach R copies or a restore (or torch.load) did not verify (see the JSON)", file=sys.stderr)
    if config["json"]:
        path = Path(config["json"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"raw numbers written to {path}")
    return 0 if doc["ok"] else 1


def run(args: argparse.Namespace) -> int:
    """Run ``memstore bench`` with flags parsed by a parser that :func:`add_arguments` filled; the exit code."""
    from trainer_client.knobs import save_switches

    try:
        config = config_of(args)
        save_switches()  # a bad one is refused before anything runs
    except ValueError as exc:  # InvalidArgumentError is one
        print(f"memstore bench: error: {exc}", file=sys.stderr)
        return 2
    return run_config(config, shlex.join([sys.executable, *sys.argv]))


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) as ``memstore bench`` flags and run; the exit code."""
    parser = argparse.ArgumentParser(prog="memstore bench", description="Measure memstore's save stall, replication and restores.")
    add_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # `memstore bench -- --size 1GiB`: the CLI hands its REMAINDER over with the separator
        argv = argv[1:]
    return run(parser.parse_args(argv))
