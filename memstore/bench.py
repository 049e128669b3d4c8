"""``memstore bench``: save stall, replication, restore and memory of memstore against baselines.

A run measures one or more *scenarios* (state size x hosts x replication factor R). Each runs on an
embedded :class:`~memstore.local_cluster.LocalCluster` on 127.0.0.1 (or, with ``--endpoints``, on an
already running cluster addressed by a JSON endpoints file) and measures:

* the trainer's stall per ``save()`` (the cold first saves, then p50/p95 over warm saves),
* the time until the save is committed (R copies) and the replication throughput derived from it,
* restore from local RAM after a trainer-process crash: a NEW process connects and loads,
* restore from peer RAM after a host loss: the owner store is SIGKILLed and replaced (empty RAM) and a
  new process on the replacement loads; and, for diagnosis, the pure pull path (owner up, its copy
  deleted) and the store's pull timed alone,
* restore from durable storage: n/a until the spill tier exists,
* the memory of every store process (RSS, PSS, shared/anonymous parts) against the shard bytes it holds,

and, once per run, the RSS growth of the stores and of the saving client over ``--leak-saves`` (100)
consecutive saves. In the same run and on the same bytes it measures the baselines they are compared with:
a torch ``copy_`` into pre-faulted memory (also right before every measured save, so both see the same
background load), raw TCP between two Python processes on loopback, ``torch.save`` + fsync /
``torch.load``, and ``torch.distributed.checkpoint.async_save`` (blocking part and total, fsynced). For
diagnosis it also measures gRPC-Python streaming and an in-process cost model of the save and
replication paths, and records the machine's CPU pressure and the CPU time other processes took.

Results: rich tables, ``--json PATH`` (every raw number) and ``--plot PATH.png`` (matplotlib; written next
to the JSON by default).

This module is imported by ``memstore.cli`` and by the bench's helper processes, so it only imports the
standard library at module level; torch, numpy, grpc, rich and matplotlib are imported where used.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import platform
import re
import select
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from rich.console import Console

    from memstore.local_cluster import LocalCluster

MiB = 1 << 20
GiB = 1 << 30
JOB_ID = "bench"
CHUNK = 4 * MiB  # TCP/gRPC floor message size and cost-model chunk (= memstore's default chunk size)
CAPACITY_SLACK = 64 * MiB
MEMCPY_REPS = 5
TCP_REPS = 3
GRPC_REPS = 3
FLOOR_TIMEOUT = 300.0
MAX_HOSTS = 8
DEFAULT_MAX_RAM = "18GiB"
BENCH_COPIES = 3  # state + up to two transient copies of it in this process (floor buffers, torch.load, DCP staging, a restore)
PROCESS_OVERHEAD = 448 * MiB  # PSS of the bench and a restore process (Python + torch + gRPC) without the state
STORE_OVERHEAD = 64 * MiB  # PSS of one idle store process

# Targets (issue 3), evaluated per scenario; the headline scenario is 1 GiB on one rank, 2 hosts, R=2.
STALL_MEMCPY_MAX = 1.5  # save() stall p50 <= 1.5x torch copy_ into pre-faulted memory
STALL_DISK_MIN = 20.0  # torch.save + fsync >= 20x the stall
STALL_DCP_MAX = 0.2  # stall <= 1/5 of DCP async_save's blocking time
REPLICATION_MIN = 0.7  # replication throughput >= 0.7x raw TCP
PEER_RESTORE_TCP_MIN = 0.7  # restore from peer RAM >= 0.7x raw TCP throughput
PEER_RESTORE_LOAD_MIN = 3.0  # ... and >= 3x faster than torch.load
LOCAL_RESTORE_LOAD_MIN = 10.0  # restore from local RAM after a trainer crash >= 10x faster than torch.load
STORE_RSS_MAX = 1.15  # store RSS <= 1.15x the shard bytes it holds
LEAK_MAX_PERCENT = 5.0  # < 5% RSS growth over the leak-check saves

# --matrix: a sweep that fits ~10 min on a 2-core, 24 GiB machine. The headline scenario (1 GiB, 2 hosts,
# R=2) runs with the full --saves/--restores, the others with fewer.
MATRIX_SIZES = "64MiB,256MiB,1GiB,4GiB"
MATRIX_COMBOS: tuple[tuple[int, int], ...] = ((2, 1), (2, 2), (3, 2), (3, 3), (4, 2), (4, 3))
MATRIX_SAVES = 3
MATRIX_RESTORES = 1
HEADLINE = (GiB, 2, 2)
DURABLE_NOTE = "n/a until the spill tier exists"


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--size",
        default=None,
        help="state bytes on the one benchmarked rank, a comma-separated list (e.g. 64MiB,256MiB,1GiB,4GiB; default 1GiB); "
        "sizes whose RAM need exceeds --max-ram are skipped with the reason",
    )
    p.add_argument("--hosts", default=None, help=f"stores in the local cluster, a comma-separated list of 1..{MAX_HOSTS} (default 2)")
    p.add_argument("--replicas", default=None, help="replication factor R, a comma-separated list (default 2); R > hosts is skipped")
    p.add_argument(
        "--matrix",
        action="store_true",
        help=f"preset sweep: sizes {MATRIX_SIZES} x (hosts, R) in {', '.join(f'({h},{r})' for h, r in MATRIX_COMBOS)}; "
        f"the headline 1GiB/2 hosts/R=2 with full --saves/--restores, the rest with {MATRIX_SAVES} saves / {MATRIX_RESTORES} restore",
    )
    p.add_argument(
        "--endpoints",
        default=None,
        metavar="PATH",
        help='JSON endpoints file {"hosts": {"<id>": "HOST:PORT", ...}} of an already running cluster: bench those stores '
        "(the rank saves to the first host; pass the cluster's keep as --keep); parts that kill/restart local store processes are skipped",
    )
    p.add_argument("--saves", type=int, default=None, help="measured (warm) saves after the warm-up ones (default 5; --quick 2)")
    p.add_argument(
        "--restores", type=int, default=None, help="repetitions of each restore and of the disk/DCP baselines (default 3; --quick 1)"
    )
    p.add_argument("--keep", type=int, default=2, help="steps each store keeps (default 2); warm-up is keep+1 saves")
    p.add_argument("--leak-saves", type=int, default=None, help="consecutive saves of the RSS leak check (default 100; 0 = skip)")
    p.add_argument("--leak-size", default=None, help="state size of the leak check (default 64MiB; --quick 16MiB)")
    p.add_argument(
        "--max-ram", default=DEFAULT_MAX_RAM, help=f"skip scenarios whose estimated RAM need exceeds this (default {DEFAULT_MAX_RAM})"
    )
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write every raw number, ratio and machine info here")
    p.add_argument(
        "--plot",
        dest="plot_path",
        default=None,
        metavar="PATH.png",
        help="write the figures here (default: next to --json, same name .png)",
    )
    p.add_argument("--no-plot", action="store_true", help="do not write the figures")
    p.add_argument("--quick", action="store_true", help="64MiB, 2 saves, 1 restore, 16MiB leak check unless given explicitly (smoke test)")
    p.add_argument("--disk-dir", default=None, help="directory on local disk for the torch.save and DCP baselines (default: the temp dir)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random state")
    p.add_argument(
        "--data-plane",
        choices=("tcp", "grpc"),
        default=None,
        help="passed to the stores as --data-plane (how replicas and pulls travel); default: the store's default",
    )
    p.add_argument(
        "--store-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment of the store processes, repeatable (e.g. MALLOC_TRIM_THRESHOLD_=268435456 to try allocator tuning)",
    )


@dataclass
class Scenario:
    size: int
    hosts: int
    replicas: int
    saves: int
    restores: int
    headline: bool = False

    @property
    def name(self) -> str:
        return f"{_short_size(self.size)}-{self.hosts}h-R{self.replicas}"


@dataclass
class BenchConfig:
    sizes: list[int]
    hosts: list[int]
    replicas: list[int]
    saves: int
    restores: int
    keep: int
    warmup: int
    json_path: str | None
    plot_path: str | None
    disk_dir: str | None
    seed: int
    quick: bool
    matrix: bool
    store_env: dict[str, str]
    data_plane: str | None
    endpoints: str | None
    leak_saves: int
    leak_size: int
    max_ram: int
    combos: list[tuple[int, int]] = field(default_factory=list)  # (hosts, R) pairs to run
    # the headline scenario, for the JSON's readers of issue 2 (one scenario per run)
    size: int = 0
    hosts_headline: int = 0
    replicas_headline: int = 0


def _short_size(n: int) -> str:
    if n % GiB == 0:
        return f"{n // GiB}GiB"
    if n % MiB == 0:
        return f"{n // MiB}MiB"
    return f"{n}B"


def _int_list(text: str, what: str) -> list[int]:
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        try:
            out.append(int(item))
        except ValueError:
            raise ValueError(f"{what} {text!r} is invalid: expected a comma-separated list of integers") from None
    if not out:
        raise ValueError(f"{what} {text!r} is empty")
    return out


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    from memstore.core.sizes import parse_size

    size_text = args.size or (MATRIX_SIZES if args.matrix else "64MiB" if args.quick else "1GiB")
    sizes = []
    for item in filter(None, (s.strip() for s in size_text.split(","))):
        n = parse_size(item)
        if n < MiB:
            raise ValueError(f"--size {item} is too small: expected at least 1MiB")
        sizes.append(n)
    if not sizes:
        raise ValueError(f"--size {size_text!r} is empty")
    sizes = sorted(set(sizes))
    saves = args.saves if args.saves is not None else (2 if args.quick else 5)
    restores = args.restores if args.restores is not None else (1 if args.quick else 3)
    if saves < 1 or restores < 1:
        raise ValueError(f"--saves {saves} / --restores {restores} are invalid: expected >= 1")
    if args.keep < 1:
        raise ValueError(f"--keep {args.keep} is invalid: expected >= 1")
    hosts = _int_list(args.hosts, "--hosts") if args.hosts else [2]
    replicas = _int_list(args.replicas, "--replicas") if args.replicas else [2]
    for h in hosts:
        if not 1 <= h <= MAX_HOSTS:
            raise ValueError(f"--hosts {h} is invalid: expected 1..{MAX_HOSTS} stores on loopback")
    for r in replicas:
        if r < 1:
            raise ValueError(f"--replicas {r} is invalid: expected >= 1")
    if args.matrix and not args.hosts and not args.replicas:
        combos = list(MATRIX_COMBOS)
    else:
        combos = [(h, r) for h in sorted(set(hosts)) for r in sorted(set(replicas))]
    leak_saves = args.leak_saves if args.leak_saves is not None else 100
    if leak_saves != 0 and leak_saves < 10:
        raise ValueError(f"--leak-saves {leak_saves} is invalid: expected 0 (skip) or >= 10 (RSS after save 10 is the reference)")
    leak_size = parse_size(args.leak_size or ("16MiB" if args.quick else "64MiB"))
    if leak_size < MiB:
        raise ValueError(f"--leak-size {args.leak_size} is too small: expected at least 1MiB")
    store_env = {}
    for item in args.store_env or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--store-env {item!r} is invalid: expected KEY=VALUE")
        store_env[key] = value
    if args.endpoints and not os.path.isfile(args.endpoints):
        raise ValueError(f"--endpoints {args.endpoints} does not exist")
    plot_path = None
    if not args.no_plot:
        plot_path = args.plot_path or (str(Path(args.json_path).with_suffix(".png")) if args.json_path else None)
    return BenchConfig(
        sizes=sizes,
        hosts=sorted(set(hosts)),
        replicas=sorted(set(replicas)),
        saves=saves,
        restores=restores,
        keep=args.keep,
        warmup=args.keep + 1,
        json_path=args.json_path,
        plot_path=plot_path,
        disk_dir=args.disk_dir,
        seed=args.seed,
        quick=bool(args.quick),
        matrix=bool(args.matrix),
        store_env=store_env,
        data_plane=args.data_plane,
        endpoints=args.endpoints,
        leak_saves=leak_saves,
        leak_size=leak_size,
        max_ram=parse_size(args.max_ram),
        combos=combos,
    )


def ram_need(size: int, replicas: int, hosts: int, keep: int) -> dict[str, int]:
    """Estimated RAM a scenario needs on this machine.

    The stores: keep steps plus one pooled segment of the one benchmarked rank on each of its R holders,
    (keep+1) x size x R. With one rank per host (a real job) that would be x hosts more, reported as
    ``one_rank_per_host_bytes`` for reference. The bench process: the state plus up to two transient copies. Plus the
    processes themselves (Python, torch, gRPC): the bench, a restore process, ~40-60 MiB per store.
    """
    segment = _round_page(size + 64 * 1024)  # the shard adds a small header
    stores = (keep + 1) * segment * replicas
    bench = BENCH_COPIES * size
    processes = PROCESS_OVERHEAD + STORE_OVERHEAD * hosts
    return {
        "stores_bytes": stores,
        "bench_bytes": bench,
        "processes_bytes": processes,
        "total_bytes": stores + bench + processes,
        "one_rank_per_host_bytes": stores * hosts + bench + processes,
    }


def plan_scenarios(config: BenchConfig, endpoints: dict[str, Any] | None) -> tuple[list[Scenario], list[dict[str, Any]]]:
    """The scenarios to run, and the ones skipped with their reason."""
    scenarios: list[Scenario] = []
    skipped: list[dict[str, Any]] = []
    if endpoints is not None:
        combos = [(len(endpoints["hosts"]), int(endpoints["replicas"]))]
    else:
        combos = []
        for h, r in config.combos:
            if r > h:
                skipped.append({"size": None, "hosts": h, "replicas": r, "reason": f"R={r} needs at least {r} hosts"})
            else:
                combos.append((h, r))
    for size in config.sizes:
        for h, r in combos:
            need = ram_need(size, r, h, config.keep)
            if endpoints is not None:
                # The stores are not ours to budget; the cluster's capacity is.
                cap = int(endpoints["capacity_bytes"])
                if (config.keep + 1) * _round_page(size + 64 * 1024) > cap:
                    skipped.append(
                        {
                            "size": size,
                            "hosts": h,
                            "replicas": r,
                            "reason": f"keep+1 shards of {_short_size(size)} exceed the store capacity {_fmt_bytes(cap)}",
                        }
                    )
                    continue
                total = need["bench_bytes"]
            else:
                total = need["total_bytes"]
            if total > config.max_ram:
                skipped.append(
                    {
                        "size": size,
                        "hosts": h,
                        "replicas": r,
                        "ram_need": need,
                        "reason": f"needs ~{_fmt_bytes(total)} of RAM ((keep+1)={config.keep + 1} x {_short_size(size)} x R={r} in the "
                        f"stores + {BENCH_COPIES} x {_short_size(size)} in the bench + processes) > --max-ram {_fmt_bytes(config.max_ram)}",
                    }
                )
                continue
            scenarios.append(Scenario(size, h, r, config.saves, config.restores))
    if scenarios:
        head = next((s for s in scenarios if (s.size, s.hosts, s.replicas) == HEADLINE), None)
        if head is None:
            head = max(scenarios, key=lambda s: (s.size, s.replicas >= 2, -s.hosts))
        head.headline = True
        if config.matrix:
            for s in scenarios:
                if not s.headline:
                    s.saves = min(config.saves, MATRIX_SAVES)
                    s.restores = min(config.restores, MATRIX_RESTORES)
        config.size, config.hosts_headline, config.replicas_headline = head.size, head.hosts, head.replicas
    return scenarios, skipped


def run_from_args(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    from rich.console import Console

    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"memstore bench: error: {exc}", file=sys.stderr)
        return 2
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # logs and pipes: don't squeeze the tables into 80 columns
    try:
        result = run(config, shlex.join([sys.executable, *sys.argv]), console)
    except BenchSetupError as exc:
        print(f"memstore bench: error: {exc}", file=sys.stderr)
        return 2
    result["bench_argv"] = argv
    render(result, console)
    if config.json_path:
        path = Path(config.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=_json_default) + "\n")
        console.print(f"raw numbers written to {path}")
    if config.plot_path and result.get("scenarios"):
        try:
            write_plot(result, config.plot_path)
            console.print(f"figures written to {config.plot_path}")
        except ImportError as exc:
            console.print(f"[yellow]no figures: {exc} (install matplotlib)[/]")
    return 0 if result["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="memstore bench", description="Measure memstore's save stall, replication, restore and memory.")
    add_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # `memstore bench -- --size 1GiB`: the CLI hands its REMAINDER over with the separator
        argv = argv[1:]
    args = parser.parse_args(argv)
    return run_from_args(args, argv=argv)


class BenchSetupError(Exception):
    """The bench cannot run as asked (an unreachable --endpoints cluster, nothing fits in RAM)."""


def _json_default(value: Any) -> Any:
    if isinstance(value, set | tuple):
        return list(value)
    return str(value)


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), without numpy."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _summary(values: list[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "min": min(values),
        "p50": _percentile(values, 50),
        "p95": _percentile(values, 95),
        "max": max(values),
        "values": values,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def _round_page(n: int) -> int:
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    return -(-n // page) * page


def _mem_total() -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def cpu_pressure() -> dict[str, float] | None:
    """The 'some' line of /proc/pressure/cpu: share of time runnable tasks waited for a CPU."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/pressure/cpu").read_text().splitlines():
            if line.startswith("some"):
                fields = dict(item.split("=") for item in line.split()[1:])
                return {"avg10": float(fields["avg10"]), "avg60": float(fields["avg60"]), "total_us": float(fields["total"])}
    return None


def _cpu_busy_seconds() -> tuple[float, float] | None:
    """(busy, steal) CPU seconds of the whole machine since boot, from /proc/stat."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
        hz = os.sysconf("SC_CLK_TCK")
        return (user + nice + system + irq + softirq) / hz, steal / hz
    return None


def _own_cpu_seconds() -> float:
    """CPU seconds of this process and of its reaped children (stores, helpers, restore processes)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class CpuWindow:
    """CPU conditions over a stretch of the run: PSI pressure, load average, and the CPU time taken by
    processes other than this bench and its children (other work on the machine)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.pressure0 = cpu_pressure()
        self.busy0 = _cpu_busy_seconds()
        self.own0 = _own_cpu_seconds()
        self.load0 = os.getloadavg() if hasattr(os, "getloadavg") else None

    def report(self) -> dict[str, Any]:
        elapsed = time.monotonic() - self.t0
        pressure = cpu_pressure()
        busy = _cpu_busy_seconds()
        own = _own_cpu_seconds() - self.own0
        ncpu = os.cpu_count() or 1
        out: dict[str, Any] = {
            "seconds": elapsed,
            "cpu_pressure_start": self.pressure0,
            "cpu_pressure_end": pressure,
            "cpu_pressure_some_share": None,
            "loadavg_start": self.load0,
            "loadavg_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "bench_cpu_seconds": own,
            "other_cpu_seconds": None,
            "other_cpu_share_of_machine": None,
            "steal_seconds": None,
        }
        if self.pressure0 and pressure and elapsed > 0:
            out["cpu_pressure_some_share"] = (pressure["total_us"] - self.pressure0["total_us"]) / 1e6 / elapsed
        if self.busy0 and busy and elapsed > 0:
            other = max(0.0, (busy[0] - self.busy0[0]) - own)
            out["other_cpu_seconds"] = other
            out["other_cpu_share_of_machine"] = other / (elapsed * ncpu)
            out["steal_seconds"] = busy[1] - self.busy0[1]
        return out


def machine_info() -> dict[str, Any]:
    import grpc
    import numpy as np
    import torch

    thp = {}
    for name in ("enabled", "shmem_enabled"):
        with contextlib.suppress(OSError):
            thp[name] = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
    shm = shutil.disk_usage("/dev/shm") if os.path.isdir("/dev/shm") else None
    return {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _cpu_model(),
        "ram_bytes": _mem_total(),
        "dev_shm_bytes": shm.total if shm else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "numpy": np.__version__,
        "grpcio": grpc.__version__,
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "transparent_hugepage": thp,
    }


def proc_memory(pid: int) -> dict[str, int] | None:
    """RSS (VmRSS and its RssAnon / RssFile / RssShmem parts, VmHWM) from /proc/<pid>/status and PSS (and its
    anonymous / file / shmem parts) from /proc/<pid>/smaps_rollup, in bytes; None if the process is gone."""
    out: dict[str, int] = {}
    keys = {"VmRSS": "rss", "RssAnon": "rss_anon", "RssFile": "rss_file", "RssShmem": "rss_shmem", "VmHWM": "rss_peak"}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in keys:
                out[keys[name]] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    pss_keys = {"Pss": "pss", "Pss_Anon": "pss_anon", "Pss_File": "pss_file", "Pss_Shmem": "pss_shmem"}
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in pss_keys:
                out[pss_keys[name]] = int(rest.split()[0]) * 1024
    return out


def _pss(pid: int) -> int:
    mem = proc_memory(pid)
    return mem.get("pss", 0) if mem else 0


def _children(ppid: int) -> list[int]:
    out = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{entry.name}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == ppid:
                    out.append(int(entry.name))
    return out


def _listening_pid(address: str) -> int | None:
    """The pid of the local process listening on ``address`` (a loopback or local HOST:PORT), or None."""
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]")
    local = {"127.0.0.1", "localhost", "::1", "0.0.0.0", socket.gethostname()}
    with contextlib.suppress(OSError):
        local.update(socket.gethostbyname_ex(socket.gethostname())[2])
    if host not in local or not port_text.isdigit():
        return None
    port = int(port_text)
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A = LISTEN
                    inodes.add(f"socket:[{f[9]}]")
    if not inodes:
        return None
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                for fd in os.scandir(f"/proc/{entry.name}/fd"):
                    with contextlib.suppress(OSError):
                        if os.readlink(fd.path) in inodes:
                            return int(entry.name)
    return None


class Monitor:
    """Samples, every ``interval`` s, the memory of this process and its children (PSS, so pages
    shared by a store and the client count once); remembers the peak, overall and since ``reset_window``."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.phase = "start"
        self.peak_bytes = 0
        self.peak_phase = ""
        self.window_peak_bytes = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-monitor", daemon=True)
        self.cpu = CpuWindow()

    def __enter__(self) -> Monitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def reset_window(self) -> None:
        self.window_peak_bytes = 0

    def sample(self) -> None:
        total = sum(_pss(pid) for pid in [os.getpid(), *_children(os.getpid())])
        self.samples += 1
        self.window_peak_bytes = max(self.window_peak_bytes, total)
        if total > self.peak_bytes:
            self.peak_bytes = total
            self.peak_phase = self.phase

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(Exception):
                self.sample()

    def report(self) -> dict[str, Any]:
        cpu = self.cpu.report()
        return {
            "memory_peak_pss_bytes": self.peak_bytes,
            "memory_peak_phase": self.peak_phase,
            "memory_samples": self.samples,
            "cpu_pressure_start": cpu["cpu_pressure_start"],
            "cpu_pressure_end": cpu["cpu_pressure_end"],
            "cpu_pressure_some_share_during_run": cpu["cpu_pressure_some_share"],
            "loadavg_start": cpu["loadavg_start"],
            "loadavg_end": cpu["loadavg_end"],
            "bench_cpu_seconds": cpu["bench_cpu_seconds"],
            "other_cpu_seconds": cpu["other_cpu_seconds"],
            "other_cpu_share_of_machine": cpu["other_cpu_share_of_machine"],
            "steal_seconds": cpu["steal_seconds"],
        }


# --------------------------------------------------------------------------------------------------
# the state
# --------------------------------------------------------------------------------------------------


def make_state(nbytes: int, seed: int) -> dict[str, Any]:
    """A model + Adam-like state of ``nbytes`` float32 bytes: 4 layers x (weight, exp_avg, exp_avg_sq), random."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    layers = 4
    total = nbytes // 4
    base = total // (3 * layers)
    sizes = [base] * (3 * layers)
    sizes[-1] += total - base * 3 * layers
    made = iter([torch.rand(n, generator=gen) for n in sizes])
    model = {f"layers.{i}.weight": next(made) for i in range(layers)}
    optim_state = {i: {"step": torch.tensor(100.0), "exp_avg": next(made), "exp_avg_sq": next(made)} for i in range(layers)}
    return {
        "model": model,
        "optim": {
            "state": optim_state,
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": list(range(layers))}],
        },
        "step": 100,
    }


def state_tensors(state: Any) -> list[torch.Tensor]:
    import torch

    out: list[torch.Tensor] = []

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list | tuple):
            for x in v:
                walk(x)

    walk(state)
    return out


def states_equal(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(states_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(states_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def state_fingerprint(state: Any) -> str:
    """xxh3-128 over the state's structure, every non-tensor leaf and every tensor's dtype, shape and bytes: a
    restore in another process is verified by comparing fingerprints, without shipping the tensors back."""
    import torch
    import xxhash

    h = xxhash.xxh3_128()

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            t = v.detach().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)};".encode())
            if t.numel():
                h.update(t.reshape(-1).view(torch.uint8).numpy().data)
        elif isinstance(v, dict):
            h.update(f"{type(v).__name__}{{{len(v)};".encode())
            for k, x in v.items():
                h.update(f"{type(k).__name__}:{k!r}=".encode())
                walk(x)
        elif isinstance(v, list | tuple):
            h.update(f"{type(v).__name__}[{len(v)};".encode())
            for x in v:
                walk(x)
        else:
            h.update(f"{type(v).__name__}:{v!r};".encode())

    walk(state)
    return h.hexdigest()


def _byte_views(tensors: list[torch.Tensor]) -> list[memoryview]:
    import torch

    return [t.detach().reshape(-1).view(torch.uint8).numpy().data for t in tensors]


def _chunks(views: list[memoryview], chunk: int = CHUNK) -> Iterator[memoryview]:
    for mv in views:
        for off in range(0, len(mv), chunk):
            yield mv[off : off + chunk]


def _prefaulted(nbytes: int) -> bytearray:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    zeros = bytes(min(CHUNK, nbytes))
    for off in range(0, nbytes, CHUNK):
        view[off : off + CHUNK] = zeros[: min(CHUNK, nbytes - off)]
    view.release()
    return buf


def _child_env() -> dict[str, str]:
    """Environment for helper processes: this memstore importable first."""
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# --------------------------------------------------------------------------------------------------
# floors
# --------------------------------------------------------------------------------------------------


def _copy_all(dst: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    off = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        dst[off : off + n].view(t.dtype).copy_(t.reshape(-1))
        off += n


def floor_memcpy(tensors: list[torch.Tensor], reps: int = MEMCPY_REPS) -> dict[str, Any]:
    """torch ``copy_`` (multi-threaded) of every state tensor into a pre-faulted buffer; memmove single-thread;
    the same copy into a /dev/shm mapping and into fresh (never touched) memory, for reference."""
    import torch

    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    result: dict[str, Any] = {"bytes": nbytes, "torch_threads": torch.get_num_threads()}

    fresh_times = []
    for _ in range(2):
        t0 = time.perf_counter()
        dst = torch.empty(nbytes, dtype=torch.uint8)
        _copy_all(dst, tensors)
        fresh_times.append(time.perf_counter() - t0)
        del dst
    result["torch_copy_fresh_seconds"] = _summary(fresh_times)

    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.fill_(1)  # touch every page once: pre-faulted, like memstore's pooled segments
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _copy_all(dst, tensors)
        times.append(time.perf_counter() - t0)
    result["torch_copy_seconds"] = _summary(times)

    mm_times = []
    for _ in range(max(1, reps // 2)):
        base = dst.data_ptr()
        t0 = time.perf_counter()
        off = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            ctypes.memmove(base + off, t.data_ptr(), n)
            off += n
        mm_times.append(time.perf_counter() - t0)
    result["memmove_single_thread_seconds"] = _summary(mm_times)
    del dst
    gc.collect()
    result["shm_torch_copy_seconds"] = _shm_copy(tensors, nbytes, reps)
    return result


def _shared_mapping(nbytes: int, directory: str | None) -> Any:
    """An unlinked, pre-populated MAP_SHARED file mapping: the kind of memory a save writes into."""
    import mmap

    fd, path = tempfile.mkstemp(prefix="memstore-bench-", dir=directory)
    try:
        os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
        os.unlink(path)


def _shm_copy(tensors: list[torch.Tensor], nbytes: int, reps: int) -> dict[str, Any] | None:
    """The same copy into a pre-faulted MAP_SHARED file mapping on /dev/shm (what a save writes into)."""

    import torch

    if not os.path.isdir("/dev/shm"):
        return None
    mm = _shared_mapping(nbytes, "/dev/shm")
    times = []
    try:
        dst = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
        dst.fill_(1)
        for _ in range(reps):
            t0 = time.perf_counter()
            _copy_all(dst, tensors)
            times.append(time.perf_counter() - t0)
        del dst
    finally:
        gc.collect()
        with contextlib.suppress(BufferError):
            mm.close()
    return _summary(times)


_TCP_SENDER = r"""
import socket, sys
port, n, reps, chunk = (int(a) for a in sys.argv[1:5])
buf = bytearray(n)
mv = memoryview(buf)
pattern = bytes(range(256)) * (chunk // 256)
for off in range(0, n, chunk):
    mv[off : off + chunk] = pattern[: min(chunk, n - off)]
s = socket.create_connection(("127.0.0.1", port), timeout=120)
for _ in range(reps):
    for off in range(0, n, chunk):
        s.sendall(mv[off : off + chunk])
s.shutdown(socket.SHUT_WR)
s.settimeout(120)
s.recv(1)
s.close()
"""


def floor_tcp(nbytes: int, recv_buf: bytearray, reps: int = TCP_REPS, timeout: float = FLOOR_TIMEOUT) -> dict[str, Any]:
    """A child Python process sends ``nbytes`` ``reps`` times with sendall of 4 MiB memoryview slices; this
    process receives with recv_into a pre-faulted buffer. Each repetition is timed from its first byte (rep 0)
    or the previous repetition's last byte to its last byte."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(timeout)
    port = listener.getsockname()[1]
    view = memoryview(recv_buf)[:nbytes]
    child = subprocess.Popen(
        [sys.executable, "-c", _TCP_SENDER, str(port), str(nbytes), str(reps), str(CHUNK)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    times: list[float] = []
    first_bytes = 0
    rcvbuf = 0
    try:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(timeout)
            rcvbuf = conn.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
            t_prev = 0.0
            for rep in range(reps):
                got = 0
                while got < nbytes:
                    n = conn.recv_into(view[got:], nbytes - got)
                    if n == 0:
                        raise RuntimeError(f"TCP sender closed after {got} of {nbytes} bytes (rep {rep})")
                    if rep == 0 and got == 0:
                        t_prev = time.perf_counter()  # first byte arrived
                        first_bytes = n
                    got += n
                now = time.perf_counter()
                times.append(now - t_prev)
                t_prev = now
            conn.sendall(b"k")
        child.wait(timeout=timeout)
        err = child.stderr.read().decode(errors="replace") if child.stderr else ""
    finally:
        view.release()
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
        if child.stderr:
            child.stderr.close()
        listener.close()
    if child.returncode != 0:
        raise RuntimeError(f"TCP sender failed with {child.returncode}: {err[-2000:]}")
    # Rep 0 is timed from its first recv's return, so it misses those first bytes.
    throughputs = [(nbytes - (first_bytes if i == 0 else 0)) / t for i, t in enumerate(times)]
    return {
        "bytes": nbytes,
        "reps": reps,
        "send_slice_bytes": CHUNK,
        "receiver_so_rcvbuf": rcvbuf,
        "seconds": _summary(times),
        "bytes_per_second": _summary(throughputs),
    }


_GRPC_SENDER = r"""
import sys
import grpc
from memstore.v1 import store_pb2 as pb
from memstore.v1.channel import insecure_channel
port, n, reps, mode, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
buf = bytearray(n)
mv = memoryview(buf)
pattern = bytes(range(256)) * (chunk // 256)
for off in range(0, n, chunk):
    mv[off : off + chunk] = pattern[: min(chunk, n - off)]
ch = insecure_channel(f"127.0.0.1:{port}")
grpc.channel_ready_future(ch).result(timeout=60)
if mode == "bytes":
    put = ch.stream_unary("/memstore.bench.Sink/Put", request_serializer=None, response_deserializer=None)
    gen = lambda: (bytes(mv[o : o + chunk]) for o in range(0, n, chunk))
else:
    put = ch.stream_unary("/memstore.bench.Sink/Put", request_serializer=pb.PutRequest.SerializeToString, response_deserializer=None)
    gen = lambda: (pb.PutRequest(chunk=bytes(mv[o : o + chunk])) for o in range(0, n, chunk))
for _ in range(reps):
    put(gen(), timeout=600)
ch.close()
"""


def floor_grpc(nbytes: int, recv_buf: bytearray, mode: str, reps: int = GRPC_REPS, timeout: float = FLOOR_TIMEOUT) -> dict[str, Any]:
    """gRPC-Python client streaming of ``nbytes`` in 4 MiB messages from a child process to a server in this
    process, with memstore's channel/server options. ``mode`` "bytes": raw bytes messages (no protobuf; one
    ``bytes()`` copy per chunk, the least gRPC-Python allows); "protobuf": ``PutRequest(chunk=...)`` as
    memstore's replication sends. The receiver copies each chunk into a pre-faulted buffer (no checksum).
    Timed on the receiver from the first message to the last."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from memstore.v1 import store_pb2 as pb
    from memstore.v1.channel import SERVER_OPTIONS

    view = memoryview(recv_buf)[:nbytes]
    times: list[float] = []
    errors: list[str] = []

    def handler(request_iterator: Iterator[Any], context: grpc.ServicerContext) -> bytes:
        t0 = 0.0
        got = 0
        try:
            for msg in request_iterator:
                data = msg if mode == "bytes" else msg.chunk
                if got == 0:
                    t0 = time.perf_counter()
                view[got : got + len(data)] = data
                got += len(data)
            times.append(time.perf_counter() - t0)
        except Exception as exc:
            errors.append(repr(exc))
        return b""

    deserializer = None if mode == "bytes" else pb.PutRequest.FromString
    rpc = grpc.stream_unary_rpc_method_handler(handler, request_deserializer=deserializer, response_serializer=None)
    server = grpc.server(ThreadPoolExecutor(max_workers=4), options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("memstore.bench.Sink", {"Put": rpc}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _GRPC_SENDER, str(port), str(nbytes), str(reps), mode, str(CHUNK)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=timeout,
            env=_child_env(),
            check=False,
        )
    finally:
        server.stop(1).wait(5)
        view.release()
    if proc.returncode != 0 or errors or len(times) != reps:
        raise RuntimeError(f"gRPC floor ({mode}) failed: rc={proc.returncode} {errors} {proc.stderr.decode(errors='replace')[-2000:]}")
    return {
        "mode": mode,
        "bytes": nbytes,
        "reps": reps,
        "message_bytes": CHUNK,
        "seconds": _summary(times),
        "bytes_per_second": _summary([nbytes / t for t in times]),
    }


def floor_disk(state: Any, disk_dir: str | None, reps: int) -> dict[str, Any]:
    """torch.save + flush + fsync to a temp file on local disk; torch.load(weights_only=True) with the file's
    page cache evicted (cold) and warm, ``reps`` times each."""
    import torch

    cold: list[float] = []
    warm: list[float] = []
    evicted = False
    ok = True
    with tempfile.TemporaryDirectory(prefix="memstore-bench-", dir=disk_dir) as d:
        path = os.path.join(d, "state.pt")
        t0 = time.perf_counter()
        with open(path, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            t1 = time.perf_counter()
            os.fsync(fh.fileno())
        t2 = time.perf_counter()
        file_bytes = os.path.getsize(path)
        for i in range(reps):
            evicted = _evict_page_cache(path)
            t3 = time.perf_counter()
            loaded = torch.load(path, weights_only=True)
            cold.append(time.perf_counter() - t3)
            if i == 0:
                ok = states_equal(state, loaded)
            del loaded
            gc.collect()
            t3 = time.perf_counter()
            loaded = torch.load(path, weights_only=True)
            warm.append(time.perf_counter() - t3)
            del loaded
            gc.collect()
        fs = _filesystem_of(d)
    return {
        "dir": d,
        "filesystem": fs,
        "file_bytes": file_bytes,
        "save_seconds": t1 - t0,
        "fsync_seconds": t2 - t1,
        "save_fsync_seconds": t2 - t0,
        "load_cold_seconds": _summary(cold),
        "load_cold_page_cache_evicted": evicted,
        "load_warm_seconds": _summary(warm),
        "load_verified": ok,
    }


def _evict_page_cache(path: str) -> bool:
    """Drop the file's clean pages from the page cache (POSIX_FADV_DONTNEED; no root needed)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _filesystem_of(path: str) -> str:
    best = ("", "")
    with contextlib.suppress(OSError):
        real = os.path.realpath(path)
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")) and len(parts[1]) >= len(best[0]):
                best = (parts[1], f"{parts[2]} ({parts[0]} on {parts[1]})")
    return best[1]


def floor_dcp(state: Any, disk_dir: str | None, reps: int) -> dict[str, Any]:
    """``torch.distributed.checkpoint.async_save`` of the state to a local directory with ``FileSystemWriter``
    (``sync_files=True``, its default: every file is fsynced before the future completes), in this single process:
    torch 2.13 needs no process group for that (``no_dist=True``). Blocking = until async_save returns (DCP stages
    the state into CPU memory and plans); total = until the returned future completes (written and fsynced).

    Two stagings: ``default`` as documented (async_save makes a new DefaultStager per call, so each call stages into
    fresh memory), and ``reused_stager``, a caller-owned DefaultStager kept across calls (it caches its staging
    storages, so after a first call it copies into memory already faulted in: DCP's best case)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    out: dict[str, Any] = {
        "torch": torch.__version__,
        "writer": "FileSystemWriter(sync_files=True, thread_count=1)",
        "process_group": "none: async_save(no_dist=True) in one process",
        "reps": reps,
    }

    def one(directory: str, stager: Any) -> tuple[float, float, int]:
        writer = FileSystemWriter(directory, sync_files=True)
        t0 = time.perf_counter()
        fut: Any = dcp.async_save(state, storage_writer=writer, no_dist=True, async_stager=stager)
        t1 = time.perf_counter()
        done = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse (async staging) or a Future
        done.result(timeout=FLOOR_TIMEOUT)
        t2 = time.perf_counter()
        nbytes = sum(p.stat().st_size for p in Path(directory).iterdir())
        return t1 - t0, t2 - t0, nbytes

    with warnings.catch_warnings(), tempfile.TemporaryDirectory(prefix="memstore-bench-dcp-", dir=disk_dir) as d:
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming the intent is to save in a single process"
        out["dir"] = d
        out["filesystem"] = _filesystem_of(d)
        for mode in ("default", "reused_stager"):
            stager = DefaultStager(StagingOptions(False, False, False, False)) if mode == "reused_stager" else None
            blocking: list[float] = []
            total: list[float] = []
            first: dict[str, float] = {}
            try:
                for i in range(reps + (1 if stager is not None else 0)):
                    path = os.path.join(d, f"{mode}-{i}")
                    b, t, nbytes = one(path, stager)
                    shutil.rmtree(path, ignore_errors=True)
                    if stager is not None and i == 0:
                        first = {"blocking_seconds": b, "total_seconds": t}  # fills the stager's cache: reported apart
                        continue
                    blocking.append(b)
                    total.append(t)
                    out["file_bytes"] = nbytes
                    gc.collect()
            finally:
                if stager is not None:
                    stager.close()
            out[mode] = {"blocking_seconds": _summary(blocking), "total_seconds": _summary(total)}
            if first:
                out[mode]["first_call"] = first
            gc.collect()
    return out


# --------------------------------------------------------------------------------------------------
# cost model of the save and replication paths (in process)
# --------------------------------------------------------------------------------------------------


def replication_cost_model(tensors: list[torch.Tensor], nbytes: int) -> dict[str, Any]:
    """Time each CPU step the replication pipeline applies to every byte, on the same bytes, in this process,
    one thread. Sender (owner store): xxh3 over the whole shard before any byte is sent, ``bytes(view[chunk])``
    per chunk (memstore.v1.streams.iter_chunks), ``PutRequest(chunk=...)`` and its serialisation by gRPC.
    Receiver (peer store): protobuf parse and ``msg.chunk``, xxh3 verify, copy into the segment."""
    from memstore.v1 import store_pb2 as pb
    from memstore.v1.integrity import checksum

    views = _byte_views(tensors)
    out: dict[str, float] = {}

    def timed(name: str, fn: Callable[[memoryview], object]) -> None:
        t0 = time.perf_counter()
        for c in _chunks(views):
            fn(c)
        out[name] = time.perf_counter() - t0

    timed("xxh3_checksum", checksum)
    timed("bytes_copy_per_chunk", bytes)
    timed("pb_putrequest_build", lambda c: pb.PutRequest(chunk=bytes(c)))
    timed("pb_serialize", lambda c: pb.PutRequest(chunk=bytes(c)).SerializeToString())
    wire = pb.PutRequest(chunk=bytes(CHUNK)).SerializeToString()
    n_chunks = sum(1 for _ in _chunks(views))
    t0 = time.perf_counter()
    for _ in range(n_chunks):
        pb.PutRequest.FromString(wire).chunk  # noqa: B018 - parse + field access is the measured work
    out["pb_parse_and_chunk_access"] = time.perf_counter() - t0
    dest = _prefaulted(CHUNK)
    dview = memoryview(dest)
    blob = bytes(CHUNK)
    t0 = time.perf_counter()
    for c in _chunks(views):
        dview[: len(c)] = blob[: len(c)]
    out["copy_into_segment"] = time.perf_counter() - t0
    dview.release()
    for v in views:
        v.release()
    sender = out["xxh3_checksum"] + out["pb_serialize"]
    receiver = out["pb_parse_and_chunk_access"] + out["xxh3_checksum"] + out["copy_into_segment"]
    return {
        "bytes": nbytes,
        "chunk_bytes": CHUNK,
        "chunks": n_chunks,
        "seconds": out,
        "bytes_per_second": {k: nbytes / v for k, v in out.items() if v > 0},
        "sender_cpu_seconds_estimate": sender,
        "receiver_cpu_seconds_estimate": receiver,
        "notes": (
            "pb_serialize includes bytes_copy_per_chunk and pb_putrequest_build; the owner checksums the whole shard "
            "before it pushes the first chunk, so that part is serial; receiver work overlaps the sender's "
            "on another core when one is free; gRPC framing and the kernel copies are in the gRPC/TCP floors."
        ),
    }


def save_path_model(state: Any, reps: int = 3) -> dict[str, Any]:
    """The client side of save() without the store: serialization.plan() and ShardLayout.write_into() a
    pre-faulted /dev/shm mapping. save() minus these two is the Allocate/Commit RPCs and the mapping lookup."""

    from trainer_client import serialization

    plan_times = []
    layout = serialization.plan(state)
    for _ in range(reps):
        t0 = time.perf_counter()
        layout = serialization.plan(state)
        plan_times.append(time.perf_counter() - t0)
    nbytes = layout.nbytes
    shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
    mm = _shared_mapping(nbytes, shm_dir)
    write_times = []
    try:
        layout.write_into(mm)  # first touch
        for _ in range(reps):
            t0 = time.perf_counter()
            layout.write_into(mm)
            write_times.append(time.perf_counter() - t0)
    finally:
        with contextlib.suppress(BufferError):
            mm.close()
    return {
        "bytes": nbytes,
        "dir": shm_dir,
        "plan_seconds": _summary(plan_times),
        "write_into_shm_seconds": _summary(write_times),
        "fresh_segment_seconds": fresh_segment_model(nbytes, shm_dir),
    }


def fresh_segment_model(nbytes: int, directory: str | None, reps: int = 2) -> dict[str, Any] | None:
    """What a store pays for a segment it cannot take from its pool (memstore.server.segments.SegmentPool._create):
    ftruncate + posix_fallocate (tmpfs zero-fills every page) + mmap(MAP_SHARED | MAP_POPULATE), on the same tmpfs. Cold
    saves pay it, and so does every pull into a store whose pool is empty (a replacement host) or holds no reusable
    segment (segments a zero-copy reader mapped are never recycled)."""
    import mmap

    if directory is None:
        return None
    falloc: list[float] = []
    total: list[float] = []
    for _ in range(reps):
        fd, path = tempfile.mkstemp(prefix="memstore-bench-seg-", dir=directory)
        try:
            t0 = time.perf_counter()
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)
            t1 = time.perf_counter()
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            t2 = time.perf_counter()
            mm.close()
        finally:
            os.close(fd)
            os.unlink(path)
        falloc.append(t1 - t0)
        total.append(t2 - t0)
    return {"fallocate_seconds": _summary(falloc), "seconds": _summary(total)}


# --------------------------------------------------------------------------------------------------
# store RPCs (a fresh channel per call: a replaced store comes back on the same address)
# --------------------------------------------------------------------------------------------------


def _rpc(address: str, call: Callable[[Any, float], Any], timeout: float = 5.0) -> Any:
    import grpc

    from memstore.v1 import store_pb2_grpc as pb_grpc
    from memstore.v1.channel import insecure_channel

    with insecure_channel(address) as ch:
        try:
            return call(pb_grpc.StoreStub(ch), timeout)
        except grpc.RpcError:
            return None


def _hello(address: str, timeout: float = 10.0) -> Any:
    from memstore.v1 import store_pb2 as pb

    return _rpc(address, lambda s, t: s.Hello(pb.HelloRequest(), timeout=t), timeout)


def _health(address: str, timeout: float = 5.0) -> Any:
    from memstore.v1 import store_pb2 as pb

    return _rpc(address, lambda s, t: s.Health(pb.HealthRequest(), timeout=t), timeout)


def _listing(address: str, job: str = "", timeout: float = 5.0) -> Any:
    from memstore.v1 import store_pb2 as pb

    return _rpc(address, lambda s, t: s.List(pb.ListRequest(job_id=job), timeout=t), timeout)


def _delete(address: str, job: str, step: int = -1) -> int:
    from memstore.v1 import store_pb2 as pb

    resp = _rpc(address, lambda s, t: s.Delete(pb.DeleteRequest(job_id=job, step=step, rank=-1 if step == -1 else 0), timeout=t), 30.0)
    return int(resp.deleted) if resp is not None else 0


def _fetch(address: str, job: str, step: int, timeout: float) -> tuple[float, str]:
    """Time the store's Fetch RPC alone (it returns once the store holds a verified copy): its pull from a peer."""
    import grpc

    from memstore.v1 import store_pb2 as pb
    from memstore.v1 import store_pb2_grpc as pb_grpc
    from memstore.v1.channel import insecure_channel

    with insecure_channel(address) as ch:
        stub = pb_grpc.StoreStub(ch)
        grpc.channel_ready_future(ch).result(timeout=30)
        timeline = stub.LatestStep(pb.LatestStepRequest(job_id=job, step=step), timeout=timeout).timeline
        t0 = time.perf_counter()
        resp = stub.Fetch(pb.FetchRequest(key=pb.ShardKey(job_id=job, step=step, rank=0, timeline=timeline)), timeout=timeout)
        return time.perf_counter() - t0, resp.source_host


def _job_steps(address: str, job: str) -> set[int] | None:
    resp = _listing(address, job)
    return None if resp is None else {int(s.manifest.key.step) for s in resp.shards}


def _settled(addresses: list[str], job: str, keep: int) -> bool:
    """Retention has dropped the oldest steps of ``job`` everywhere (so the next save reuses a pooled segment)."""
    for a in addresses:
        steps = _job_steps(a, job)
        if steps is None or len(steps) > keep:
            return False
    return True


def _wait(predicate: Callable[[], Any], timeout: float, interval: float, what: str) -> Any:
    from memstore.local_cluster import wait_for

    return wait_for(predicate, timeout, interval=interval, what=what)


def _held(address: str) -> dict[str, Any] | None:
    """Shard bytes a store holds (sum of nbytes over its List, every job) and its accounted bytes (Health)."""
    listing = _listing(address)
    health = _health(address)
    if listing is None or health is None:
        return None
    held = sum(int(s.manifest.nbytes) for s in listing.shards)
    held_pages = sum(_round_page(max(1, int(s.manifest.nbytes))) for s in listing.shards)
    used = int(health.used_bytes)
    return {
        "shards": len(listing.shards),
        "shard_bytes_held": held,
        "used_bytes": used,  # in-use segments + pooled free segments, as the store accounts them against capacity
        "pooled_bytes_estimate": max(0, used - held_pages),
        "capacity_bytes": int(health.capacity_bytes),
    }


# --------------------------------------------------------------------------------------------------
# helper processes: a restarted trainer that restores, the leak check's saving trainer
# --------------------------------------------------------------------------------------------------


def _emitter() -> Callable[[dict[str, Any]], None]:
    """stdout is the JSON-lines channel to the bench; anything else printing to stdout goes to stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def emit(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    return emit


def _wait_accepting(address: str, timeout: float) -> None:
    """Poll until ``address`` accepts TCP connections (a replacement store may still be starting)."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.005)


def restore_worker() -> None:
    """A restarted trainer process: imports, reports ready, waits for one command on stdin, then (timed) connects
    to the store and ``load()``s the latest step, and reports timings, its memory and the state's fingerprint."""
    emit = _emitter()
    t0 = time.perf_counter()
    import torch  # noqa: F401 - a trainer has torch loaded before it restores

    from trainer_client import CheckpointClient

    emit({"ready": True, "pid": os.getpid(), "import_seconds": time.perf_counter() - t0})
    cmd = json.loads(sys.stdin.readline())
    address = cmd["address"]
    _wait_accepting(address, float(cmd.get("wait_seconds", 120)))
    w_accept = time.time()
    t_accept = time.perf_counter()
    client = CheckpointClient(cmd["job"], 0, 1, store=address, timeout=60.0)
    t_connected = time.perf_counter()
    state = client.load(zero_copy=bool(cmd["zero_copy"]))
    t_loaded = time.perf_counter()
    w_loaded = time.time()
    source = client.last_load_source or ""
    shared = client.shared_memory
    client.close()
    mem = proc_memory(os.getpid())
    fingerprint = state_fingerprint(state)
    emit(
        {
            "accept_unix": w_accept,
            "loaded_unix": w_loaded,
            "connect_seconds": t_connected - t_accept,
            "load_seconds": t_loaded - t_connected,
            "connect_load_seconds": t_loaded - t_accept,
            "source_host": source,
            "shared_memory": shared,
            "zero_copy": bool(cmd["zero_copy"]),
            "memory_after_load": mem,
            "fingerprint": fingerprint,
        }
    )


def leak_worker() -> None:
    """The leak check's trainer: ``saves`` consecutive saves of one state; after each (committed, retention settled)
    it samples its own memory and that of the stores (pids given), one JSON line per save."""
    emit = _emitter()
    cfg = json.loads(sys.stdin.readline())
    from trainer_client import CheckpointClient
    from trainer_client.errors import ReplicationError

    state = make_state(int(cfg["size"]), int(cfg["seed"]))
    addresses = list(cfg["addresses"])
    pids = {h: p for h, p in cfg["pids"].items() if p}
    commit_timeout = 60.0 + int(cfg["size"]) / (10 * MiB)
    emit({"ready": True, "pid": os.getpid()})
    client = CheckpointClient(cfg["job"], 0, 1, store=addresses[0], timeout=60.0)
    try:
        for i in range(int(cfg["saves"])):
            t0 = time.perf_counter()
            handle = client.save(i + 1, state)
            t1 = time.perf_counter()
            error = ""
            try:
                copies = int(handle.wait(timeout=commit_timeout).copies)
            except ReplicationError as exc:
                error, copies = str(exc), 0
            _wait(lambda: _settled(addresses, cfg["job"], int(cfg["keep"])), 60.0, 0.01, "retention to drop old steps")
            emit(
                {
                    "save": i + 1,
                    "stall_seconds": t1 - t0,
                    "copies": copies,
                    "error": error,
                    "client": proc_memory(os.getpid()),
                    "stores": {h: proc_memory(int(p)) for h, p in pids.items()},
                }
            )
    finally:
        client.close()
    emit({"done": True})


class Child:
    """A helper process speaking JSON lines on stdin/stdout, with bounded reads."""

    def __init__(self, entry: str, what: str) -> None:
        self.what = what
        self._err = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close(), lives as long as the process
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"from memstore.bench import {entry}; {entry}()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            env=_child_env(),
        )
        self._buf = b""

    def read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.what}: no answer within {timeout:.0f}s; stderr: {self.stderr_tail()}")
            ready, _, _ = select.select([fd], [], [], min(remaining, 1.0))
            if not ready:
                continue
            data = os.read(fd, 1 << 16)
            if not data:
                self.proc.wait(timeout=10)
                raise RuntimeError(f"{self.what} exited with {self.proc.returncode}: {self.stderr_tail()}")
            self._buf += data
        line, _, self._buf = self._buf.partition(b"\n")
        result: dict[str, Any] = json.loads(line)
        return result

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        self.proc.stdin.flush()

    def stderr_tail(self, n: int = 3000) -> str:
        with contextlib.suppress(OSError, ValueError):
            self._err.seek(0)
            return self._err.read().decode(errors="replace")[-n:]
        return ""

    def close(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError, ValueError):
                if stream is not None:
                    stream.close()
        self._err.close()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None and self.proc.poll() is None:
            self.proc.kill()
        self.close()


def _restore_in_new_process(
    address: str,
    job: str,
    zero_copy: bool,
    timeout: float,
    before: Callable[[], object] | None = None,
    during: Callable[[], object] | None = None,
) -> dict[str, Any]:
    """Start a restore process and wait until it has imported torch; then run ``before`` (e.g. kill a store), tell it
    to restore, run ``during`` (e.g. start the replacement store) and collect its report."""
    with Child("restore_worker", "restore process") as child:
        ready = child.read(timeout=120.0)
        if before is not None:
            before()
        child.send({"address": address, "job": job, "zero_copy": zero_copy, "wait_seconds": timeout})
        t0 = time.perf_counter()
        if during is not None:
            during()
        result = child.read(timeout=timeout)
        result["bench_wall_seconds"] = time.perf_counter() - t0
        result["import_seconds"] = ready["import_seconds"]
        result["pid"] = ready["pid"]
    return result


# --------------------------------------------------------------------------------------------------
# the stores: an embedded local cluster, or an already running one (--endpoints)
# --------------------------------------------------------------------------------------------------


class Stores:
    """The stores a scenario runs on. ``local``: this bench started them and may kill and restart them."""

    local = False
    hosts: list[str]
    job: str

    def address(self, host: str) -> str:
        raise NotImplementedError

    def addresses(self) -> list[str]:
        return [self.address(h) for h in self.hosts]

    def pid(self, host: str) -> int | None:
        raise NotImplementedError

    def kill(self, host: str) -> None:
        raise NotImplementedError

    def restart(self, host: str) -> None:
        raise NotImplementedError

    def log_text(self, host: str) -> str:
        return ""

    def dump_logs(self) -> None:
        pass

    def stop(self) -> None:
        raise NotImplementedError


class LocalStores(Stores):
    local = True

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.hosts = list(cluster.stores)
        self.job = JOB_ID

    def address(self, host: str) -> str:
        return self.cluster.address(host)

    def pid(self, host: str) -> int | None:
        proc = self.cluster.stores[host].proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def kill(self, host: str) -> None:
        self.cluster.kill(host)

    def restart(self, host: str) -> None:
        self.cluster.restart(host, timeout=60)

    def log_text(self, host: str) -> str:
        with contextlib.suppress(OSError):
            return self.cluster.stores[host].log_path.read_text(errors="replace")
        return ""

    def dump_logs(self) -> None:
        for h in self.hosts:
            tail = self.cluster.log_tail(h, lines=30)
            if tail:
                print(f"--- log of store {h} ---\n{tail}", file=sys.stderr)

    def stop(self) -> None:
        self.cluster.stop()


class RemoteStores(Stores):
    """An already running cluster; the bench's shards go to a job of its own, deleted at the end."""

    def __init__(self, endpoints: dict[str, str], job: str) -> None:
        self.endpoints = dict(endpoints)
        self.hosts = list(endpoints)
        self.job = job
        self._pids = {h: _listening_pid(a) for h, a in endpoints.items()}

    def address(self, host: str) -> str:
        return self.endpoints[host]

    def pid(self, host: str) -> int | None:
        return self._pids.get(host)

    def stop(self) -> None:
        for a in self.addresses():
            with contextlib.suppress(Exception):
                _delete(a, self.job)


def load_endpoints(path: str) -> dict[str, Any]:
    """Read an endpoints file and ask its first store for R and the capacity."""
    try:
        data = json.loads(Path(path).read_text())
        hosts = {str(k): str(v) for k, v in data["hosts"].items()}
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
        raise BenchSetupError(f'--endpoints {path}: expected JSON {{"hosts": {{"<id>": "HOST:PORT", ...}}}}: {exc}') from None
    if not hosts:
        raise BenchSetupError(f"--endpoints {path} lists no hosts")
    first = next(iter(hosts.values()))
    hello = _hello(first)
    if hello is None:
        raise BenchSetupError(f"--endpoints {path}: the store at {first} does not answer")
    unreachable = [h for h, a in hosts.items() if _health(a) is None]
    if unreachable:
        raise BenchSetupError(f"--endpoints {path}: stores {', '.join(unreachable)} do not answer")
    return {
        "path": path,
        "hosts": hosts,
        "replicas": int(hello.replicas),
        "capacity_bytes": int(hello.capacity_bytes),
        "version": hello.version,
        "placement": hello.placement,
        "data_port": int(hello.data_port),
        "local_pids": {h: _listening_pid(a) for h, a in hosts.items()},
    }


def _start_stores(config: BenchConfig, hosts: int, replicas: int, shard_bytes: int, endpoints: dict[str, Any] | None) -> Stores:
    if endpoints is not None:
        return RemoteStores(endpoints["hosts"], job=f"bench-{os.getpid()}-{int(time.time())}")
    from memstore.local_cluster import LocalCluster

    capacity = (config.keep + 1) * _round_page(shard_bytes) + CAPACITY_SLACK
    # --repair-interval 3600: after the startup pass (when the stores are still empty) no anti-entropy pass runs during
    # the measurements, so the peer restore of a deleted copy is the Fetch path and nothing else. A replacement store
    # still runs its startup pass (that is how it gets back to R copies after a host loss).
    extra = ["--repair-interval", "3600"]
    if config.data_plane:
        extra += ["--data-plane", config.data_plane]
    cluster = LocalCluster(
        hosts=hosts, replicas=replicas, capacity=str(capacity), keep=config.keep, extra_args=extra, env=dict(config.store_env) or None
    )
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return LocalStores(cluster)


_PULLED = re.compile(r"(fetch|repair): pulled (\S+) from (\S+)")
_SERVING = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*store \S+ serving on", re.MULTILINE)


def _pull_notes(log_text: str) -> dict[str, Any]:
    """The store's 'fetch: pulled' / 'repair: pulled' log lines since its last start."""
    start = log_text.rfind("serving on")
    tail = log_text[start:] if start >= 0 else log_text
    pulls = [{"by": m.group(1), "key": m.group(2), "from": m.group(3)} for m in _PULLED.finditer(tail)]
    by_key: dict[str, set[str]] = {}
    for p in pulls:
        by_key.setdefault(p["key"], set()).add(p["by"])
    return {
        "pulls": pulls,
        "fetch_pulls": sum(1 for p in pulls if p["by"] == "fetch"),
        "repair_pulls": sum(1 for p in pulls if p["by"] == "repair"),
        "pulled_twice": sorted(k for k, who in by_key.items() if len(who) > 1),
    }


def _serving_unix(log_text: str) -> float | None:
    """Wall-clock time of the store's last 'serving on' log line (logging's asctime, local time, ms)."""
    matches = list(_SERVING.finditer(log_text))
    if not matches:
        return None
    m = matches[-1]
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000.0


# --------------------------------------------------------------------------------------------------
# one scenario: saves, store memory, restores
# --------------------------------------------------------------------------------------------------


@dataclass
class SaveSample:
    step: int
    phase: str  # "cold" (a new segment: the first keep+1 saves) | "measured"
    save_wall_seconds: float  # wall time of save()
    stall_seconds: float  # SaveHandle.stall_seconds (measured inside save())
    committed_seconds: float  # save() start -> wait() returned
    copies: int
    replication_seconds: float  # committed - save wall
    replication_bytes_per_second: float
    paired_memcpy_seconds: float | None  # torch copy_ into pre-faulted memory, right before this save
    error: str = ""  # why the save did not reach R copies (wait() raised); such saves are left out of the commit figures


def _store_memory(stores: Stores) -> dict[str, Any]:
    """Per store: its process's RSS/PSS (when it is a local process) against the shard bytes it holds."""
    per: dict[str, Any] = {}
    for h in stores.hosts:
        held = _held(stores.address(h)) or {}
        pid = stores.pid(h)
        mem = proc_memory(pid) if pid else None
        entry: dict[str, Any] = {"pid": pid, "memory": mem, **held}
        if mem and held.get("shard_bytes_held"):
            entry["rss_over_held"] = _ratio(mem["rss"], held["shard_bytes_held"])
            entry["rss_over_held_plus_pooled"] = _ratio(mem["rss"], held["used_bytes"])
            entry["pss_over_held"] = _ratio(mem.get("pss"), held["shard_bytes_held"])
        per[h] = entry
    holding = {h: e for h, e in per.items() if e.get("rss_over_held") is not None}
    worst = max(holding, key=lambda h: holding[h]["rss_over_held"]) if holding else None
    return {
        "stores": per,
        "worst_host": worst,
        "rss_over_held_max": holding[worst]["rss_over_held"] if worst else None,
        "rss_over_held_plus_pooled_max": max((e["rss_over_held_plus_pooled"] for e in holding.values()), default=None),
        "available": bool(holding),
        "note": "" if holding else "no local store process to read (remote --endpoints) or no store holds shards",
    }


def _restore_summary(runs: list[dict[str, Any]], fingerprint: str, key: str = "connect_load_seconds") -> dict[str, Any]:
    for r in runs:
        r["verified_equal"] = r.pop("fingerprint", None) == fingerprint
    return {
        "seconds": _summary([r[key] for r in runs]),
        "timed": key,
        "load_seconds": _summary([r["load_seconds"] for r in runs]),
        "connect_seconds": _summary([r["connect_seconds"] for r in runs]),
        "source_hosts": sorted({r["source_host"] for r in runs}),
        "verified_equal": all(r["verified_equal"] for r in runs),
        "runs": runs,
    }


def _caught_up(stores: Stores, host: str, keep: int) -> bool:
    """``host`` holds the newest ``keep`` steps of the job that any store holds, and runs no repair."""
    union: set[int] = set()
    for h in stores.hosts:
        steps = _job_steps(stores.address(h), stores.job)
        if steps is None:
            return False
        union |= steps
    mine = _job_steps(stores.address(host), stores.job)
    health = _health(stores.address(host))
    return mine is not None and health is not None and mine >= set(sorted(union)[-keep:]) and health.repairs_in_flight == 0


def measure_scenario(
    config: BenchConfig,
    scn: Scenario,
    state: Any,
    fingerprint: str,
    shard_bytes: int,
    endpoints: dict[str, Any] | None,
    step_done: Callable[[str], None],
    monitor: Monitor,
) -> dict[str, Any]:
    import torch

    from trainer_client import CheckpointClient
    from trainer_client.errors import ReplicationError

    name = scn.name
    out: dict[str, Any] = {
        "name": name,
        "size": scn.size,
        "hosts": scn.hosts,
        "replicas": scn.replicas,
        "saves_measured": scn.saves,
        "restores": scn.restores,
        "headline": scn.headline,
        "ram_need": ram_need(scn.size, scn.replicas, scn.hosts, config.keep),
    }
    cpu = CpuWindow()
    monitor.reset_window()
    monitor.phase = f"{name}: cluster start"
    commit_timeout = 60.0 + shard_bytes / (10 * MiB)
    restore_timeout = 120.0 + shard_bytes / (20 * MiB)
    tensors = state_tensors(state)
    t0 = time.perf_counter()
    stores = _start_stores(config, scn.hosts, scn.replicas, shard_bytes, endpoints)
    out["cluster_start_seconds"] = time.perf_counter() - t0
    out["local_cluster"] = stores.local
    out["job"] = stores.job
    owner = stores.hosts[0]
    owner_addr = stores.address(owner)
    addresses = stores.addresses()
    try:
        step_done(f"{name}: cluster started")

        # -- saves ------------------------------------------------------------------------------
        monitor.phase = f"{name}: saves"
        samples: list[SaveSample] = []
        floor_dst = torch.empty(sum(t.numel() * t.element_size() for t in tensors), dtype=torch.uint8)
        floor_dst.fill_(1)
        client = CheckpointClient(stores.job, 0, 1, store=owner_addr)
        try:
            out["shared_memory"] = client.shared_memory
            out["store_version"] = client.hello.version
            out["store_data_port"] = int(getattr(client.hello, "data_port", 0))  # 0: replicas and pulls travel over gRPC
            out["data_plane"] = _data_plane(config.data_plane, out)
            total = config.warmup + scn.saves
            for i in range(total):
                step = i + 1
                measured = i >= config.warmup
                paired = None
                if measured:
                    t0 = time.perf_counter()
                    _copy_all(floor_dst, tensors)
                    paired = time.perf_counter() - t0
                t0 = time.perf_counter()
                handle = client.save(step, state)
                t1 = time.perf_counter()
                error = ""
                try:
                    copies = int(handle.wait(timeout=commit_timeout).copies)
                except ReplicationError as exc:
                    # A real outcome (e.g. a peer's PrepareReceive timing out): recorded, and the run goes on.
                    error = str(exc)
                    info = getattr(handle, "_info", None)  # the last status wait() saw
                    copies = int(info.copies) if info is not None else 0
                    out.setdefault("errors", []).append(f"save of step {step}: {error}")
                t2 = time.perf_counter()
                rep = t2 - t1
                samples.append(
                    SaveSample(
                        step=step,
                        phase="measured" if measured else "cold",
                        save_wall_seconds=t1 - t0,
                        stall_seconds=handle.stall_seconds,
                        committed_seconds=t2 - t0,
                        copies=copies,
                        replication_seconds=rep,
                        replication_bytes_per_second=shard_bytes / rep if rep > 0 else float("nan"),
                        paired_memcpy_seconds=paired,
                        error=error,
                    )
                )
                # Let retention evict the oldest step so the next save reuses its (pre-faulted) segment.
                _wait(lambda: _settled(addresses, stores.job, config.keep), 60.0, 0.02, "retention to drop old steps")
                monitor.sample()
                step_done(f"{name}: save {step}/{total}")
        finally:
            client.close()
            del floor_dst
            gc.collect()
        last_step = samples[-1].step
        out["last_step"] = last_step
        out["saves"] = [asdict(s) for s in samples]
        measured_saves = [s for s in samples if s.phase == "measured"]
        cold_saves = [s for s in samples if s.phase == "cold"]
        out["stall_seconds"] = _summary([s.save_wall_seconds for s in measured_saves])
        out["stall_inside_save_seconds"] = _summary([s.stall_seconds for s in measured_saves])
        out["paired_memcpy_seconds"] = _summary([s.paired_memcpy_seconds or 0.0 for s in measured_saves])
        committed = [s for s in measured_saves if not s.error]
        out["failed_saves"] = sum(1 for s in samples if s.error)
        if not committed:
            raise RuntimeError(f"no measured save of {name} reached R={scn.replicas} copies: {measured_saves[-1].error}")
        out["committed_seconds"] = _summary([s.committed_seconds for s in committed])
        out["replication_seconds"] = _summary([s.replication_seconds for s in committed])
        out["replication_bytes_per_second"] = _summary([s.replication_bytes_per_second for s in committed])
        out["first_save"] = asdict(samples[0])
        out["cold_saves_stall_seconds"] = _summary([s.save_wall_seconds for s in cold_saves])

        # -- store memory, steady state after the saves ---------------------------------------------
        monitor.phase = f"{name}: store memory"
        out["store_memory"] = _store_memory(stores)
        step_done(f"{name}: store memory")

        # -- restore from local RAM after a trainer crash: a new process on the owner's store ------------
        monitor.phase = f"{name}: restore local"
        runs = []
        for i in range(scn.restores):
            runs.append(_restore_in_new_process(owner_addr, stores.job, True, restore_timeout))
            monitor.sample()
            step_done(f"{name}: restore from local RAM, new process {i + 1}/{scn.restores}")
        out["restore_local"] = _restore_summary(runs, fingerprint)
        r = _restore_in_new_process(owner_addr, stores.job, False, restore_timeout)
        monitor.sample()
        out["restore_local_copy"] = _restore_summary([r], fingerprint)
        step_done(f"{name}: restore from local RAM, zero_copy=False")

        if scn.replicas >= 2:
            # -- the store's pull alone: delete the owner's copy, time its Fetch RPC ----------------------
            monitor.phase = f"{name}: peer pull"
            pulls: list[dict[str, Any]] = []
            for i in range(scn.restores):
                deleted = _delete(owner_addr, stores.job, last_step)
                seconds, source = _fetch(owner_addr, stores.job, last_step, restore_timeout)
                pulls.append(
                    {"seconds": seconds, "source_host": source, "deleted_on_owner": deleted, "bytes_per_second": shard_bytes / seconds}
                )
                step_done(f"{name}: pull from peer RAM (Fetch RPC) {i + 1}/{scn.restores}")
            out["peer_pull"] = {
                "seconds": _summary([p["seconds"] for p in pulls]),
                "bytes_per_second": _summary([p["bytes_per_second"] for p in pulls]),
                "source_hosts": sorted({p["source_host"] for p in pulls}),
                "runs": pulls,
            }

            # -- restore from peer RAM, owner store up but its copy gone: a new process ------------------
            monitor.phase = f"{name}: restore peer (copy deleted)"
            runs = []
            for i in range(scn.restores):
                r = _restore_in_new_process(
                    owner_addr, stores.job, True, restore_timeout, before=lambda: _delete(owner_addr, stores.job, last_step)
                )
                runs.append(r)
                monitor.sample()
                step_done(f"{name}: restore from peer RAM, owner's copy deleted {i + 1}/{scn.restores}")
            out["restore_peer_deleted"] = _restore_summary(runs, fingerprint)

            # -- restore from peer RAM after a host loss: SIGKILL the owner store, start its replacement ----
            if stores.local:
                monitor.phase = f"{name}: restore after host loss"
                runs = []
                for i in range(scn.restores):
                    _wait(lambda: _caught_up(stores, owner, config.keep), restore_timeout, 0.05, f"{owner} to hold the newest steps")
                    timing: dict[str, float] = {}

                    def replace_owner(timing: dict[str, float] = timing) -> None:
                        t = time.perf_counter()
                        stores.restart(owner)
                        timing["restart_seconds"] = time.perf_counter() - t

                    r = _restore_in_new_process(
                        owner_addr, stores.job, True, restore_timeout, before=lambda: stores.kill(owner), during=replace_owner
                    )
                    # The replacement's port accepts TCP connections as soon as gRPC binds it, before the store has
                    # wiped the dead store's segments and serves; its 'serving on' log line marks when it serves (and
                    # its startup repair pass begins), so the figure is timed from that line.
                    serving = _serving_unix(stores.log_text(owner))
                    r["restart_seconds"] = timing.get("restart_seconds")
                    r["serving_unix"] = serving
                    r["serving_to_loaded_seconds"] = r["loaded_unix"] - serving if serving else None
                    r["port_open_to_loaded_seconds"] = r["loaded_unix"] - r["accept_unix"]
                    r["restore_seconds"] = r["serving_to_loaded_seconds"] or r["port_open_to_loaded_seconds"]
                    _wait(lambda: _caught_up(stores, owner, config.keep), restore_timeout, 0.05, f"the replacement {owner}'s repair pass")
                    r.update(_pull_notes(stores.log_text(owner)))
                    runs.append(r)
                    monitor.sample()
                    step_done(f"{name}: restore from peer RAM after host loss {i + 1}/{scn.restores}")
                peer = _restore_summary(runs, fingerprint, key="restore_seconds")
                peer["bytes_per_second"] = shard_bytes / peer["seconds"]["p50"]
                peer["pulled_by"] = sorted({p["by"] for r in runs for p in r["pulls"]})
                out["restore_peer"] = peer
            else:
                out["restore_peer"] = None
                out["restore_peer_note"] = (
                    "host loss skipped: with --endpoints the stores are not processes of this bench, so it cannot kill and "
                    "replace one; the peer-restore targets use the restore with the owner's copy deleted instead"
                )
                for i in range(scn.restores):
                    step_done(f"{name}: host loss skipped (--endpoints) {i + 1}/{scn.restores}")
        else:
            out["restore_peer"] = None
            out["restore_peer_note"] = "R=1: no peer holds a copy, so a lost host's state is not restorable from RAM"
            for i in range(3 * scn.restores):
                step_done(f"{name}: restore from peer RAM skipped (R=1) {i + 1}")
        out["restore_durable"] = {"available": False, "note": DURABLE_NOTE}
        out["store_memory_end"] = _store_memory(stores)
    except BaseException:
        stores.dump_logs()
        raise
    finally:
        monitor.phase = f"{name}: stop"
        stores.stop()
    out["conditions"] = {**cpu.report(), "memory_peak_pss_bytes": monitor.window_peak_bytes}
    step_done(f"{name}: done")
    return out


# --------------------------------------------------------------------------------------------------
# leak check: RSS over many consecutive saves
# --------------------------------------------------------------------------------------------------


def measure_leak(
    config: BenchConfig, hosts: int, replicas: int, endpoints: dict[str, Any] | None, step_done: Callable[[str], None], monitor: Monitor
) -> dict[str, Any]:
    if config.leak_saves == 0:
        return {"skipped": "--leak-saves 0"}
    size = config.leak_size
    ref = 10
    monitor.phase = "leak check"
    cpu = CpuWindow()
    stores = _start_stores(config, hosts, replicas, size + MiB, endpoints)
    samples: list[dict[str, Any]] = []
    try:
        cfg = {
            "addresses": stores.addresses(),
            "pids": {h: stores.pid(h) for h in stores.hosts},
            "job": stores.job,
            "size": size,
            "seed": config.seed,
            "saves": config.leak_saves,
            "keep": config.keep,
        }
        with Child("leak_worker", "leak-check process") as child:
            child.send(cfg)
            child.read(timeout=120.0)
            per_save = 120.0 + size / (10 * MiB)
            for i in range(config.leak_saves):
                samples.append(child.read(timeout=per_save))
                if (i + 1) % 10 == 0:
                    monitor.sample()
                step_done(f"leak check: save {i + 1}/{config.leak_saves}")
            child.read(timeout=60.0)
    except BaseException:
        stores.dump_logs()
        raise
    finally:
        stores.stop()
    procs: dict[str, list[dict[str, int] | None]] = {"client": [s["client"] for s in samples]}
    for h in samples[0]["stores"]:
        procs[f"store {h}"] = [s["stores"].get(h) for s in samples]
    result: dict[str, Any] = {}
    for label, series in procs.items():
        a, b = series[ref - 1], series[-1]
        if not a or not b:
            continue
        result[label] = {
            "rss_after_save_ref": a["rss"],
            "rss_after_last_save": b["rss"],
            "growth_percent": (b["rss"] - a["rss"]) / a["rss"] * 100.0,
            "rss_anon_growth_bytes": b.get("rss_anon", 0) - a.get("rss_anon", 0),
            "rss_shmem_growth_bytes": b.get("rss_shmem", 0) - a.get("rss_shmem", 0),
            "pss_growth_percent": _ratio((b.get("pss", 0) - a.get("pss", 0)) * 100.0, a.get("pss")),
            "rss_series": [m["rss"] if m else None for m in series],
        }
    worst = max(result, key=lambda k: result[k]["growth_percent"]) if result else None
    return {
        "size": size,
        "saves": config.leak_saves,
        "hosts": hosts,
        "replicas": replicas,
        "reference_save": ref,
        "processes": result,
        "max_growth_percent": result[worst]["growth_percent"] if worst else None,
        "worst": worst,
        "stall_seconds": _summary([s["stall_seconds"] for s in samples]),
        "copies": sorted({s["copies"] for s in samples}),
        "failed_saves": [f"step {s['save']}: {s['error']}" for s in samples if s.get("error")],
        "stores_measured": bool(len(result) > 1),
        "conditions": cpu.report(),
    }


# --------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------

FLOOR_STEPS = 8


def measure_floors(
    state: Any, tensors: list[torch.Tensor], shard_bytes: int, state_bytes: int, config: BenchConfig, reps: int,
    step_done: Callable[[str], None], monitor: Monitor, label: str,
) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """The baselines of one state size, and the diagnosis cost model."""
    monitor.phase = f"{label}: floor memcpy"
    memcpy = floor_memcpy(tensors)
    gc.collect()
    step_done(f"{label}: baseline raw TCP on loopback")
    monitor.phase = f"{label}: floor tcp"
    recv_buf = _prefaulted(shard_bytes)
    tcp = floor_tcp(shard_bytes, recv_buf)
    step_done(f"{label}: diagnosis gRPC streaming, raw bytes messages")
    monitor.phase = f"{label}: floor grpc"
    grpc_bytes = floor_grpc(shard_bytes, recv_buf, "bytes")
    step_done(f"{label}: diagnosis gRPC streaming, PutRequest messages")
    grpc_pb = floor_grpc(shard_bytes, recv_buf, "protobuf")
    del recv_buf
    gc.collect()
    step_done(f"{label}: baseline torch.save + fsync / torch.load")
    monitor.phase = f"{label}: floor disk"
    disk = floor_disk(state, config.disk_dir, reps)
    gc.collect()
    step_done(f"{label}: baseline DCP async_save")
    monitor.phase = f"{label}: floor dcp"
    dcp = floor_dcp(state, config.disk_dir, reps)
    gc.collect()
    step_done(f"{label}: diagnosis cost model of the save and replication paths")
    monitor.phase = f"{label}: cost model"
    cost = replication_cost_model(tensors, state_bytes)
    cost["save_path"] = save_path_model(state)
    gc.collect()
    step_done(f"{label}: baselines done")
    return {"memcpy": memcpy, "tcp": tcp, "grpc_bytes": grpc_bytes, "grpc_protobuf": grpc_pb, "disk": disk, "dcp": dcp}, cost


def _scenario_steps(config: BenchConfig, scn: Scenario) -> int:
    return 4 + config.warmup + scn.saves + scn.restores + 3 * scn.restores


def run(config: BenchConfig, command: str, console: Console | None = None) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from trainer_client import serialization

    console = console or Console()
    started = time.time()
    endpoints = load_endpoints(config.endpoints) if config.endpoints else None
    scenarios, skipped = plan_scenarios(config, endpoints)
    for s in skipped:
        what = f"{_short_size(s['size'])}, " if s.get("size") else ""
        console.print(f"[yellow]skipped {what}{s['hosts']} hosts, R={s['replicas']}: {s['reason']}[/]")
    if not scenarios:
        raise BenchSetupError("no scenario to run: " + "; ".join(s["reason"] for s in skipped))
    if endpoints is not None:
        console.print(
            f"[yellow]--endpoints {endpoints['path']}: {len(endpoints['hosts'])} stores, R={endpoints['replicas']}; the restore after a "
            "host loss (SIGKILL and replace a store) is skipped: the stores are not processes of this bench[/]"
        )
    console.print(f"restore from durable storage: {DURABLE_NOTE}")
    head = next(s for s in scenarios if s.headline)
    total = sum(_scenario_steps(config, s) for s in scenarios) + FLOOR_STEPS * len({s.size for s in scenarios}) + config.leak_saves + 1
    results: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    sizes_out: dict[str, Any] = {}
    with (
        Monitor() as monitor,
        Progress(
            SpinnerColumn(),
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        ) as progress,
    ):
        task = progress.add_task("starting", total=total)

        def step_done(what: str) -> None:
            progress.update(task, advance=1, description=what)

        for size in config.sizes:
            todo = [s for s in scenarios if s.size == size]
            if not todo:
                continue
            label = _short_size(size)
            monitor.phase = f"{label}: generate"
            progress.update(task, description=f"{label}: generating the state")
            t0 = time.perf_counter()
            state = make_state(size, config.seed)
            tensors = state_tensors(state)
            state_bytes = sum(t.numel() * t.element_size() for t in tensors)
            shard_bytes = serialization.plan(state).nbytes
            gen_seconds = time.perf_counter() - t0
            fingerprint = state_fingerprint(state)
            step_done(f"{label}: baseline memcpy")
            floors, cost = measure_floors(
                state, tensors, shard_bytes, state_bytes, config, max(s.restores for s in todo), step_done, monitor, label
            )
            sizes_out[str(size)] = {
                "state": {
                    "bytes": state_bytes,
                    "shard_bytes": shard_bytes,
                    "tensors": len(tensors),
                    "dtype": "float32",
                    "layout": "4 layers x (weight, exp_avg, exp_avg_sq) + 4 scalar step tensors, torch.rand; one rank of world size 1",
                    "generate_seconds": gen_seconds,
                    "fingerprint": fingerprint,
                },
                "floors": floors,
                "diagnosis": cost,
            }
            for scn in todo:
                try:
                    results.append(measure_scenario(config, scn, state, fingerprint, shard_bytes, endpoints, step_done, monitor))
                except Exception as exc:  # one scenario failing (a real outcome) must not lose the others
                    failed.append({"name": scn.name, "size": scn.size, "hosts": scn.hosts, "replicas": scn.replicas, "error": repr(exc)})
                    console.print(f"[bold red]scenario {scn.name} failed: {exc!r}[/]")
            del state, tensors
            gc.collect()
        try:
            leak = measure_leak(config, head.hosts, head.replicas, endpoints, step_done, monitor)
        except Exception as exc:
            leak = {"skipped": f"the leak check failed: {exc!r}", "failed": True}
            console.print(f"[bold red]{leak['skipped']}[/]")
        step_done("done")
        conditions = monitor.report()
    if not results:
        raise BenchSetupError("every scenario failed: " + "; ".join(f"{f['name']}: {f['error']}" for f in failed))
    if not any(r["headline"] for r in results):
        results[0]["headline"] = True  # the planned headline failed: the first scenario that ran stands in
    return assemble(config, command, started, sizes_out, results, skipped, leak, conditions, endpoints, failed)


def evaluate(scn: dict[str, Any], size_info: dict[str, Any], leak: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Ratios and targets (PASS/MISS) of one scenario against the baselines of its state size."""
    fl = size_info["floors"]
    nb = size_info["state"]["shard_bytes"]
    memcpy, tcp, disk, dcp = fl["memcpy"], fl["tcp"], fl["disk"], fl["dcp"]
    stall = scn["stall_seconds"]["p50"]
    stall95 = scn["stall_seconds"]["p95"]
    paired = scn["paired_memcpy_seconds"]["p50"]
    repl_bps = scn["replication_bytes_per_second"]["p50"] if scn["replicas"] >= 2 else None
    tcp_bps = tcp["bytes_per_second"]["p50"]
    load_warm = disk["load_warm_seconds"]["p50"]
    load_cold = disk["load_cold_seconds"]["p50"]
    dcp_block = dcp["default"]["blocking_seconds"]["p50"]
    dcp_block_reused = dcp["reused_stager"]["blocking_seconds"]["p50"]
    dcp_total = dcp["default"]["total_seconds"]["p50"]
    local = scn["restore_local"]["seconds"]["p50"]
    local_copy = scn["restore_local_copy"]["seconds"]["p50"]
    peer_deleted = scn["restore_peer_deleted"]["seconds"]["p50"] if scn.get("restore_peer_deleted") else None
    peer_host_loss = scn["restore_peer"]["seconds"]["p50"] if scn.get("restore_peer") else None
    peer = peer_host_loss if peer_host_loss is not None else peer_deleted
    peer_bps = nb / peer if peer else None
    pull_bps = scn["peer_pull"]["bytes_per_second"]["p50"] if scn.get("peer_pull") else None
    mem = scn["store_memory"]
    ratios = {
        "stall_p50_over_memcpy": _ratio(stall, paired),
        "stall_p95_over_memcpy": _ratio(stall95, paired),
        "stall_p50_over_memcpy_standalone": _ratio(stall, memcpy["torch_copy_seconds"]["p50"]),
        "stall_p50_over_shm_memcpy": _ratio(stall, (memcpy.get("shm_torch_copy_seconds") or {}).get("p50")),
        "first_save_over_memcpy_fresh": _ratio(scn["first_save"]["save_wall_seconds"], memcpy["torch_copy_fresh_seconds"]["p50"]),
        "stall_p50_over_torch_save_fsync": _ratio(stall, disk["save_fsync_seconds"]),
        "torch_save_fsync_over_stall_p50": _ratio(disk["save_fsync_seconds"], stall),
        "stall_p50_over_dcp_async_blocking": _ratio(stall, dcp_block),
        "stall_p50_over_dcp_async_blocking_reused_stager": _ratio(stall, dcp_block_reused),
        "committed_p50_over_dcp_async_total": _ratio(scn["committed_seconds"]["p50"], dcp_total),
        "committed_p50_over_torch_save_fsync": _ratio(scn["committed_seconds"]["p50"], disk["save_fsync_seconds"]),
        "replication_over_raw_tcp": _ratio(repl_bps, tcp_bps),
        "replication_over_grpc_bytes": _ratio(repl_bps, fl["grpc_bytes"]["bytes_per_second"]["p50"]),
        "replication_over_grpc_protobuf": _ratio(repl_bps, fl["grpc_protobuf"]["bytes_per_second"]["p50"]),
        "grpc_bytes_over_raw_tcp": _ratio(fl["grpc_bytes"]["bytes_per_second"]["p50"], tcp_bps),
        "grpc_protobuf_over_raw_tcp": _ratio(fl["grpc_protobuf"]["bytes_per_second"]["p50"], tcp_bps),
        "torch_load_warm_over_restore_local": _ratio(load_warm, local),
        "torch_load_cold_over_restore_local": _ratio(load_cold, local),
        "torch_load_warm_over_restore_local_copy": _ratio(load_warm, local_copy),
        "restore_peer_over_raw_tcp": _ratio(peer_bps, tcp_bps),
        "torch_load_warm_over_restore_peer": _ratio(load_warm, peer),
        "torch_load_cold_over_restore_peer": _ratio(load_cold, peer),
        "restore_peer_deleted_over_raw_tcp": _ratio(nb / peer_deleted if peer_deleted else None, tcp_bps),
        "torch_load_warm_over_restore_peer_deleted": _ratio(load_warm, peer_deleted),
        "peer_pull_over_raw_tcp": _ratio(pull_bps, tcp_bps),
        "store_rss_over_held_max": mem["rss_over_held_max"],
        "store_rss_over_held_plus_pooled_max": mem["rss_over_held_plus_pooled_max"],
    }
    peer_what = "after a host loss (replacement store serving -> loaded in a new process)"
    if peer_host_loss is None and peer_deleted is not None:
        peer_what = "with the owner's copy deleted (no host loss possible with --endpoints)"

    def target(text: str, value: float | None, ok: Callable[[float], bool], note: str = "") -> dict[str, Any]:
        return {"target": text, "value": value, "pass": None if value is None else bool(ok(value)), "note": note}

    r1 = scn["replicas"] < 2
    targets = {
        "stall_vs_memcpy": target(
            f"save() stall p50 <= {STALL_MEMCPY_MAX}x torch copy_ of the same bytes into pre-faulted memory (paired p50)",
            ratios["stall_p50_over_memcpy"], lambda v: v <= STALL_MEMCPY_MAX,
        ),
        "stall_vs_torch_save_fsync": target(
            f"save() stall p50 >= {STALL_DISK_MIN:.0f}x lower than torch.save + fsync", ratios["torch_save_fsync_over_stall_p50"],
            lambda v: v >= STALL_DISK_MIN,
        ),
        "stall_vs_dcp_async_save": target(
            f"save() stall p50 <= 1/{1 / STALL_DCP_MAX:.0f} of DCP async_save's blocking time (default staging)",
            ratios["stall_p50_over_dcp_async_blocking"], lambda v: v <= STALL_DCP_MAX,
        ),
        "replication_vs_raw_tcp": target(
            f"replication throughput p50 >= {REPLICATION_MIN}x raw TCP on loopback", ratios["replication_over_raw_tcp"],
            lambda v: v >= REPLICATION_MIN, "n/a: R=1 replicates nothing" if r1 else "",
        ),
        "restore_peer_vs_raw_tcp": target(
            f"restore from peer RAM {peer_what} >= {PEER_RESTORE_TCP_MIN}x raw TCP throughput", ratios["restore_peer_over_raw_tcp"],
            lambda v: v >= PEER_RESTORE_TCP_MIN, "n/a: R=1 keeps no peer copy" if r1 else "",
        ),
        "restore_peer_vs_torch_load": target(
            f"restore from peer RAM {peer_what} >= {PEER_RESTORE_LOAD_MIN:.0f}x faster than torch.load (page cache warm)",
            ratios["torch_load_warm_over_restore_peer"], lambda v: v >= PEER_RESTORE_LOAD_MIN, "n/a: R=1 keeps no peer copy" if r1 else "",
        ),
        "restore_local_vs_torch_load": target(
            f"restore from local RAM after a trainer crash (new process, zero-copy) >= {LOCAL_RESTORE_LOAD_MIN:.0f}x faster than "
            "torch.load (page cache warm)", ratios["torch_load_warm_over_restore_local"], lambda v: v >= LOCAL_RESTORE_LOAD_MIN,
        ),
        "store_rss_vs_held": target(
            f"store RSS <= {STORE_RSS_MAX}x the shard bytes it holds (worst store holding shards)", ratios["store_rss_over_held_max"],
            lambda v: v <= STORE_RSS_MAX, mem["note"],
        ),
        "rss_growth_over_saves": target(
            f"RSS growth < {LEAK_MAX_PERCENT:.0f}% from save {leak.get('reference_save', 10)} to save {leak.get('saves', '-')} "
            f"(stores and client; {_short_size(leak['size']) if leak.get('size') else '-'} state, {leak.get('hosts', '-')} hosts, "
            f"R={leak.get('replicas', '-')}; percent)", leak.get("max_growth_percent"), lambda v: v < LEAK_MAX_PERCENT,
            leak.get("skipped", ""),
        ),
    }  # fmt: skip
    return ratios, targets


def assemble(
    config: BenchConfig,
    command: str,
    started: float,
    sizes: dict[str, Any],
    results: list[dict[str, Any]],
    skipped: list[dict[str, Any]],
    leak: dict[str, Any],
    conditions: dict[str, Any],
    endpoints: dict[str, Any] | None,
    failed: list[dict[str, Any]],
) -> dict[str, Any]:
    verified = [not failed, not leak.get("failed")]
    for scn in results:
        info = sizes[str(scn["size"])]
        scn["ratios"], scn["targets"] = evaluate(scn, info, leak)
        scn["targets_passed"] = sum(1 for t in scn["targets"].values() if t["pass"] is True)
        scn["targets_missed"] = sum(1 for t in scn["targets"].values() if t["pass"] is False)
        for key in ("restore_local", "restore_local_copy", "restore_peer_deleted", "restore_peer"):
            if scn.get(key):
                verified.append(scn[key]["verified_equal"])
        verified.append(info["floors"]["disk"]["load_verified"])
    head = next(s for s in results if s["headline"])
    head_size = sizes[str(head["size"])]
    return {
        "ok": all(verified),
        "command": command,
        "started_unix": started,
        "duration_seconds": time.time() - started,
        "config": asdict(config),
        "machine": machine_info(),
        "conditions": conditions,
        "endpoints": endpoints,
        "headline": head["name"],
        "scenarios": results,
        "skipped": skipped,
        "failed": failed,
        "sizes": sizes,
        "leak_check": leak,
        "restore_durable": {"available": False, "note": DURABLE_NOTE},
        # The headline scenario at the top level, as issue 2's JSON had it.
        "state": head_size["state"],
        "floors": head_size["floors"],
        "diagnosis": head_size["diagnosis"],
        "cluster": head,
        "ratios": head["ratios"],
        "targets": head["targets"],
        "method": _METHOD | {"warmup": f"{config.warmup} saves (keep+1={config.keep}+1): {_METHOD['warmup']}"},
    }


_METHOD: dict[str, str] = {
    "scenarios": (
        "state size x hosts x R; the baselines are measured once per state size, on the same bytes, before its scenarios; every "
        "scenario starts its own local cluster (1 rank on h0, world size 1) and stops it at the end"
    ),
    "ram_need": (
        "(keep+1) x size x R in the stores (one benchmarked rank: keep steps plus one pooled segment on each of its R holders; a "
        "job with a rank on every host needs x hosts as much, ram_need.one_rank_per_host_bytes) + 3 x size in the bench; "
        "scenarios above --max-ram are skipped; the measured peak PSS is conditions.memory_peak_pss_bytes"
    ),
    "warmup": (
        "each of the first keep+1 saves gets a new segment (the store pools a segment only once retention evicts the oldest "
        "of keep steps), so save keep+2 is the first into a recycled, pre-faulted segment; those cold saves are reported apart"
    ),
    "stall": "wall time of CheckpointClient.save() over the measured saves",
    "memcpy_floor": (
        "paired: torch copy_ of the state's tensors into one pre-faulted uint8 buffer, right before each measured save "
        "(same background load); standalone: median of 5 before the cluster starts; memmove single-thread, a /dev/shm "
        "mapping and fresh memory for reference"
    ),
    "committed": "save() start until SaveHandle.wait() returned (all R copies verified); the next save starts after retention settled",
    "replication_throughput": "shard bytes / (time to committed - save() wall time); includes the owner's xxh3 pass over the shard",
    "tcp_floor": "child python sendall of 4 MiB memoryview slices, this process recv_into a pre-faulted buffer; median of 3",
    "grpc_floors": (
        "diagnosis of the gRPC data plane (--data-plane grpc, and the fallback), not a target: gRPC-Python client stream from "
        "a child process, 4 MiB messages, memstore's channel and server options; raw bytes messages and PutRequest protobuf "
        "messages; receiver copies into a pre-faulted buffer"
    ),
    "disk_floor": "torch.save to a file, flush + fsync; torch.load(weights_only=True) after POSIX_FADV_DONTNEED (cold) and again (warm)",
    "dcp_floor": (
        "torch.distributed.checkpoint.async_save(state, storage_writer=FileSystemWriter(dir, sync_files=True), no_dist=True) "
        "in this process, no process group; blocking = until it returns, total = until its future completes (files fsynced); "
        "default staging (a new stager per call: fresh staging memory) and a reused caller-owned DefaultStager (cached, "
        "pre-faulted staging memory; its first call reported apart); the targets use the default"
    ),
    "restore_local": (
        "after a trainer-process crash: a NEW process (torch and trainer_client imported before the clock starts) connects to "
        "the owner's store and load()s the latest step, zero-copy (the default); timed from the store port accepting to "
        "load() returned (connect + LatestStep + Fetch + Open + map + xxh3 verify of every chunk + decode); verified by a "
        "fingerprint (xxh3-128 over structure and bytes) against the saved state; zero_copy=False once for reference"
    ),
    "peer_pull": "Delete of the newest step on h0 (h0 stays up), then h0's Fetch RPC timed alone: the store's pull from peer RAM",
    "restore_peer_deleted": "as restore_local, after the newest step was deleted on h0: h0's Fetch pulls it from the group peer",
    "restore_peer": (
        "after a host loss: h0 SIGKILLed, a new restore process waiting, h0's replacement started (empty RAM; its startup "
        "repair pass pulls the newest keep steps and the client's Fetch joins the pull of the newest); timed from the "
        "replacement's 'serving on' log line (its port accepts earlier, while it wipes the dead store's segments) to load() "
        "returned in the new process; "
        "the store's log says whether the repair pass, the Fetch, or both pulled"
    ),
    "restore_durable": DURABLE_NOTE,
    "store_memory": (
        "after the measured saves: /proc/<pid>/status VmRSS (RssAnon, RssFile, RssShmem) and /proc/<pid>/smaps_rollup Pss of "
        "each store process; shard bytes held = sum of nbytes over its List RPC; used_bytes (Health) = held segments + pooled "
        "free segments; the target uses RSS / shard bytes held of the worst store holding shards"
    ),
    "leak_check": (
        "a separate cluster (the headline's hosts and R) and a saving process: --leak-saves consecutive save() + wait() of a "
        "--leak-size state, each followed by retention settling; VmRSS of each store and of the saving process after save 10 "
        "vs after the last save"
    ),
    "conditions": (
        "per scenario and run: PSI CPU pressure (share of time some task waited for a CPU, this bench's included), load "
        "average, and the CPU seconds other processes took (machine busy time from /proc/stat minus this bench and its children)"
    ),
    "memory": "peak of the summed PSS of this process and its children (stores, helpers), sampled every 0.5 s and per step",
}


# --------------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------------


def _fmt_s(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.1f} ms" if v < 1 else f"{v:.3f} s"


def _fmt_bps(v: float | None) -> str:
    return "-" if v is None else f"{v / GiB:.2f} GiB/s"


def _fmt_ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _fmt_faster(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}x faster" if v >= 1 else f"{1 / v:.1f}x slower"


def _fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.1f}%"


def _fmt_bytes(n: int | None) -> str:
    from memstore.core.sizes import format_size

    return "-" if n is None else format_size(n)


def _data_plane(flag: str | None, cl: dict[str, Any]) -> str:
    if cl.get("store_data_port"):
        return "raw TCP data channel" if flag != "grpc" else "gRPC streams"
    return "gRPC streams"


def _verdict(t: dict[str, Any]) -> str:
    if t["pass"] is None:
        return "n/a"
    return "[bold green]PASS[/]" if t["pass"] else "[bold red]MISS[/]"


def render(result: dict[str, Any], console: Console) -> None:
    head = result["cluster"]
    info = result["sizes"][str(head["size"])]
    _render_headline(result, head, info, console)
    _render_floors(head, info, console)
    _render_memory(head, result["leak_check"], console)
    _render_diagnosis(result, head, info, console)
    if len(result["scenarios"]) > 1 or result["skipped"] or result.get("failed"):
        _render_matrix(result, console)
    m = result["machine"]
    cfg = result["config"]
    cond = result["conditions"]
    busy = cond.get("cpu_pressure_some_share_during_run")
    other = cond.get("other_cpu_share_of_machine")
    console.print(
        f"[dim]{m['cpu_count']} CPUs ({m['cpu_model']}), {_fmt_bytes(m['ram_bytes'])} RAM, Python {m['python']}, torch {m['torch']} "
        f"({m['torch_threads']} threads), grpcio {m['grpcio']}. Warm-up: {cfg['warmup']} cold saves (keep+1) so the store's "
        f"segment pool is warm, then the measured saves. Peak memory (PSS, this process + stores + helpers): "
        f"{_fmt_bytes(cond['memory_peak_pss_bytes'])} during {cond['memory_peak_phase']}. CPU pressure during the run: "
        f"{'-' if busy is None else f'{busy * 100:.0f}%'} of the time some task (this bench's own included) waited for a CPU; "
        f"other processes took {'-' if other is None else f'{other * 100:.0f}%'} of the machine's CPU time. "
        f"Run took {result['duration_seconds']:.0f} s.[/]"
    )
    if cfg["store_env"]:
        console.print(f"[yellow]store processes ran with extra environment: {' '.join(f'{k}={v}' for k, v in cfg['store_env'].items())}[/]")
    for f in result.get("failed", []):
        console.print(f"[bold red]scenario {f['name']} failed: {f['error']}[/]")
    for s in result["scenarios"]:
        for e in s.get("errors", []):
            console.print(f"[bold yellow]{s['name']}: {e}[/]")
    if not result["ok"]:
        console.print("[bold red]not ok: a scenario failed or a restored state differed from the saved one[/]")


def _render_headline(result: dict[str, Any], cl: dict[str, Any], info: dict[str, Any], console: Console) -> None:
    from rich.table import Table

    cfg = result["config"]
    st = info["state"]
    fl = info["floors"]
    ra = cl["ratios"]
    tg = cl["targets"]
    nb = st["shard_bytes"]
    where = f"--endpoints {cfg['endpoints']}" if cfg["endpoints"] else "127.0.0.1"
    title = (
        f"memstore bench [{cl['name']}{', headline' if len(result['scenarios']) > 1 else ''}]: {_fmt_bytes(st['bytes'])} of float32 state "
        f"({st['tensors']} tensors) on 1 rank, {cl['hosts']} hosts, R={cl['replicas']}, {where}, data plane: {cl['data_plane']}"
    )
    t = Table(title=title)
    t.add_column("figure")
    t.add_column("memstore", justify="right")
    t.add_column("baseline (same run)")
    t.add_column("ratio", justify="right")
    t.add_column("target", justify="right")
    t.add_column("", justify="center")

    stall = cl["stall_seconds"]
    paired = cl["paired_memcpy_seconds"]["p50"]
    t.add_row(
        f"save() stall p50 (warm, n={stall['n']})",
        f"{_fmt_s(stall['p50'])} ({_fmt_bps(nb / stall['p50'])})",
        f"torch copy_ pre-faulted {_fmt_s(paired)} ({_fmt_bps(nb / paired)})",
        _fmt_ratio(ra["stall_p50_over_memcpy"]),
        f"<= {STALL_MEMCPY_MAX}x",
        _verdict(tg["stall_vs_memcpy"]),
    )
    t.add_row("save() stall p95 (warm)", _fmt_s(stall["p95"]), "same", _fmt_ratio(ra["stall_p95_over_memcpy"]), "", "")
    cold = cl["cold_saves_stall_seconds"]
    t.add_row(
        f"first save / cold saves p50, max (n={cold['n']})",
        f"{_fmt_s(cl['first_save']['save_wall_seconds'])} / {_fmt_s(cold['p50'])}, {_fmt_s(cold['max'])}",
        f"torch copy_ into fresh memory {_fmt_s(fl['memcpy']['torch_copy_fresh_seconds']['p50'])}",
        _fmt_ratio(ra["first_save_over_memcpy_fresh"]),
        "",
        "",
    )
    disk = fl["disk"]
    low = ra["torch_save_fsync_over_stall_p50"]
    t.add_row(
        "save() stall p50 vs torch.save",
        _fmt_s(stall["p50"]),
        f"torch.save + fsync {_fmt_s(disk['save_fsync_seconds'])}",
        "-" if low is None else f"{low:.1f}x lower",
        f">= {STALL_DISK_MIN:.0f}x lower",
        _verdict(tg["stall_vs_torch_save_fsync"]),
    )
    dcp = fl["dcp"]
    t.add_row(
        "save() stall p50 vs DCP async_save (blocking)",
        _fmt_s(stall["p50"]),
        f"DCP async_save returns after {_fmt_s(dcp['default']['blocking_seconds']['p50'])} (default staging, n={dcp['reps']})",
        _fmt_ratio(ra["stall_p50_over_dcp_async_blocking"]),
        f"<= {STALL_DCP_MAX:.2f}x",
        _verdict(tg["stall_vs_dcp_async_save"]),
    )
    t.add_row(
        "  same, DCP with a reused stager (reference)",
        _fmt_s(stall["p50"]),
        f"DCP async_save returns after {_fmt_s(dcp['reused_stager']['blocking_seconds']['p50'])} (cached staging memory)",
        _fmt_ratio(ra["stall_p50_over_dcp_async_blocking_reused_stager"]),
        "",
        "",
    )
    com = cl["committed_seconds"]
    t.add_row(
        f"time to committed p50 / p95 (R={cl['replicas']} copies)",
        f"{_fmt_s(com['p50'])} / {_fmt_s(com['p95'])}",
        f"DCP async_save done (fsynced) {_fmt_s(dcp['default']['total_seconds']['p50'])}; torch.save + fsync "
        f"{_fmt_s(disk['save_fsync_seconds'])}",
        _fmt_ratio(ra["committed_p50_over_dcp_async_total"]),
        "",
        "",
    )
    tcp_bps = fl["tcp"]["bytes_per_second"]["p50"]
    if cl["replicas"] >= 2:
        t.add_row(
            "replication throughput p50",
            f"{_fmt_bps(cl['replication_bytes_per_second']['p50'])} ({_fmt_s(cl['replication_seconds']['p50'])})",
            f"raw TCP loopback {_fmt_bps(tcp_bps)}",
            _fmt_ratio(ra["replication_over_raw_tcp"]),
            f">= {REPLICATION_MIN}x",
            _verdict(tg["replication_vs_raw_tcp"]),
        )
    else:
        t.add_row("replication throughput", "n/a (R=1)", "", "", "", "n/a")
    warm = disk["load_warm_seconds"]["p50"]
    cold_load = disk["load_cold_seconds"]["p50"]
    load_floor = f"torch.load cached {_fmt_s(warm)} / evicted {_fmt_s(cold_load)}"
    loc = cl["restore_local"]
    t.add_row(
        f"restore from local RAM after a trainer crash: new process, zero-copy (n={loc['seconds']['n']})",
        f"{_fmt_s(loc['seconds']['p50'])} ({_fmt_bps(nb / loc['seconds']['p50'])})",
        load_floor,
        f"{_fmt_faster(ra['torch_load_warm_over_restore_local'])} / {_fmt_faster(ra['torch_load_cold_over_restore_local'])}",
        f">= {LOCAL_RESTORE_LOAD_MIN:.0f}x faster",
        _verdict(tg["restore_local_vs_torch_load"]),
    )
    lc = cl["restore_local_copy"]
    t.add_row(
        "  same, load(zero_copy=False) (reference)",
        f"{_fmt_s(lc['seconds']['p50'])} ({_fmt_bps(nb / lc['seconds']['p50'])})",
        load_floor,
        _fmt_faster(ra["torch_load_warm_over_restore_local_copy"]),
        "",
        "",
    )
    peer = cl.get("restore_peer")
    if peer:
        who = "+".join(peer.get("pulled_by") or []) or "?"
        t.add_row(
            f"restore from peer RAM after a host loss: replacement serving -> loaded, new process (n={peer['seconds']['n']}, "
            f"src {','.join(peer['source_hosts'])}, pulled by {who})",
            f"{_fmt_s(peer['seconds']['p50'])} ({_fmt_bps(peer['bytes_per_second'])})",
            f"raw TCP loopback {_fmt_bps(tcp_bps)}",
            _fmt_ratio(ra["restore_peer_over_raw_tcp"]),
            f">= {PEER_RESTORE_TCP_MIN}x",
            _verdict(tg["restore_peer_vs_raw_tcp"]),
        )
        t.add_row(
            "  same, vs torch.load",
            _fmt_s(peer["seconds"]["p50"]),
            load_floor,
            f"{_fmt_faster(ra['torch_load_warm_over_restore_peer'])} / {_fmt_faster(ra['torch_load_cold_over_restore_peer'])}",
            f">= {PEER_RESTORE_LOAD_MIN:.0f}x faster",
            _verdict(tg["restore_peer_vs_torch_load"]),
        )
    elif cl["replicas"] >= 2:
        t.add_row("restore from peer RAM after a host loss", "skipped", cl.get("restore_peer_note", ""), "", "", "")
    else:
        t.add_row("restore from peer RAM", "n/a (R=1)", cl.get("restore_peer_note", ""), "", "", "n/a")
    pd = cl.get("restore_peer_deleted")
    if pd:
        deleted_targets = not peer
        t.add_row(
            f"{'restore from peer RAM' if deleted_targets else '  owner store up'}, its copy deleted: new process "
            f"(n={pd['seconds']['n']}, src {','.join(pd['source_hosts'])})",
            f"{_fmt_s(pd['seconds']['p50'])} ({_fmt_bps(nb / pd['seconds']['p50'])})",
            f"raw TCP {_fmt_bps(tcp_bps)}; torch.load cached {_fmt_s(warm)}",
            f"{_fmt_ratio(ra['restore_peer_deleted_over_raw_tcp'])}; {_fmt_faster(ra['torch_load_warm_over_restore_peer_deleted'])}",
            f">= {PEER_RESTORE_TCP_MIN}x; >= {PEER_RESTORE_LOAD_MIN:.0f}x" if deleted_targets else "",
            f"{_verdict(tg['restore_peer_vs_raw_tcp'])} {_verdict(tg['restore_peer_vs_torch_load'])}" if deleted_targets else "",
        )
    pp = cl.get("peer_pull")
    if pp:
        t.add_row(
            f"  of which the store's pull (Fetch RPC alone, n={pp['seconds']['n']})",
            f"{_fmt_s(pp['seconds']['p50'])} ({_fmt_bps(pp['bytes_per_second']['p50'])})",
            f"raw TCP loopback {_fmt_bps(tcp_bps)}",
            _fmt_ratio(ra["peer_pull_over_raw_tcp"]),
            "",
            "",
        )
    t.add_row("restore from durable storage", DURABLE_NOTE, "", "", "", "n/a")
    mem = cl["store_memory"]
    worst = mem.get("worst_host")
    if worst:
        w = mem["stores"][worst]
        t.add_row(
            f"store RSS / shard bytes held (worst: {worst}, {w['shards']} shards)",
            f"{_fmt_bytes(w['memory']['rss'])} / {_fmt_bytes(w['shard_bytes_held'])}",
            f"RSS / (held + pooled free segments {_fmt_bytes(w['pooled_bytes_estimate'])}) = {_fmt_ratio(w['rss_over_held_plus_pooled'])}",
            _fmt_ratio(ra["store_rss_over_held_max"]),
            f"<= {STORE_RSS_MAX}x",
            _verdict(tg["store_rss_vs_held"]),
        )
    else:
        t.add_row("store RSS / shard bytes held", "n/a", mem.get("note", ""), "", "", "n/a")
    leak = result["leak_check"]
    if leak.get("processes"):
        t.add_row(
            f"RSS growth, save {leak['reference_save']} -> {leak['saves']} ({_short_size(leak['size'])} state; worst: {leak['worst']})",
            _fmt_pct(leak["max_growth_percent"]),
            ", ".join(f"{k} {_fmt_pct(v['growth_percent'])}" for k, v in leak["processes"].items()),
            "",
            f"< {LEAK_MAX_PERCENT:.0f}%",
            _verdict(tg["rss_growth_over_saves"]),
        )
    else:
        t.add_row("RSS growth over consecutive saves", "skipped", leak.get("skipped", ""), "", "", "n/a")
    console.print(t)
    passed = sum(1 for x in tg.values() if x["pass"] is True)
    missed = [k for k, x in tg.items() if x["pass"] is False]
    console.print(f"targets: {passed} PASS, {len(missed)} MISS{': ' + ', '.join(missed) if missed else ''}")


def _render_floors(cl: dict[str, Any], info: dict[str, Any], console: Console) -> None:
    from rich.table import Table

    fl = info["floors"]
    nb = info["state"]["shard_bytes"]
    f = Table(title=f"baselines and references ({_short_size(cl['size'])}, same run)")
    f.add_column("measurement")
    f.add_column("time", justify="right")
    f.add_column("throughput", justify="right")
    mc = fl["memcpy"]
    paired = cl["paired_memcpy_seconds"]["p50"]
    f.add_row(
        f"torch copy_ pre-faulted, paired with the saves (p50 of {cl['paired_memcpy_seconds']['n']})", _fmt_s(paired), _fmt_bps(nb / paired)
    )
    copy_s = mc["torch_copy_seconds"]["p50"]
    f.add_row(f"torch copy_ pre-faulted, {mc['torch_threads']} threads, standalone (p50 of 5)", _fmt_s(copy_s), _fmt_bps(nb / copy_s))
    mm = mc["memmove_single_thread_seconds"]["p50"]
    f.add_row("ctypes.memmove single thread, pre-faulted", _fmt_s(mm), _fmt_bps(nb / mm))
    if mc.get("shm_torch_copy_seconds"):
        shm = mc["shm_torch_copy_seconds"]["p50"]
        f.add_row("torch copy_ into a pre-faulted /dev/shm MAP_SHARED mapping (p50 of 5)", _fmt_s(shm), _fmt_bps(nb / shm))
    fresh_s = mc["torch_copy_fresh_seconds"]["p50"]
    f.add_row("torch copy_ into fresh memory (incl. page faults, p50 of 2)", _fmt_s(fresh_s), _fmt_bps(nb / fresh_s))
    tcp_bps = fl["tcp"]["bytes_per_second"]["p50"]
    f.add_row(f"raw TCP loopback, 4 MiB sendall / recv_into (p50 of {TCP_REPS})", _fmt_s(fl["tcp"]["seconds"]["p50"]), _fmt_bps(tcp_bps))
    for key, label in (("grpc_bytes", "raw bytes messages"), ("grpc_protobuf", "PutRequest protobuf messages")):
        g = fl[key]
        f.add_row(
            f"gRPC-Python stream, 4 MiB {label} (p50 of {GRPC_REPS})",
            _fmt_s(g["seconds"]["p50"]),
            f"{_fmt_bps(g['bytes_per_second']['p50'])} = {_fmt_ratio(_ratio(g['bytes_per_second']['p50'], tcp_bps))} TCP",
        )
    disk = fl["disk"]
    f.add_row(
        f"torch.save + fsync ({disk['filesystem'] or 'local disk'})",
        _fmt_s(disk["save_fsync_seconds"]),
        _fmt_bps(nb / disk["save_fsync_seconds"]),
    )
    f.add_row("  of which fsync", _fmt_s(disk["fsync_seconds"]), "")
    n_loads = disk["load_cold_seconds"]["n"]
    cold_load = disk["load_cold_seconds"]["p50"]
    warm = disk["load_warm_seconds"]["p50"]
    f.add_row(f"torch.load, page cache evicted (p50 of {n_loads})", _fmt_s(cold_load), _fmt_bps(nb / cold_load))
    f.add_row(f"torch.load, page cache warm (p50 of {n_loads})", _fmt_s(warm), _fmt_bps(nb / warm))
    dcp = fl["dcp"]
    for mode, label in (("default", "default staging"), ("reused_stager", "reused DefaultStager")):
        d = dcp[mode]
        f.add_row(
            f"DCP async_save, {label}: blocking / total incl. fsync (p50 of {d['blocking_seconds']['n']})",
            f"{_fmt_s(d['blocking_seconds']['p50'])} / {_fmt_s(d['total_seconds']['p50'])}",
            f"{_fmt_bps(nb / d['blocking_seconds']['p50'])} / {_fmt_bps(nb / d['total_seconds']['p50'])}",
        )
    if dcp["reused_stager"].get("first_call"):
        fc = dcp["reused_stager"]["first_call"]
        f.add_row(
            "  reused DefaultStager, first call (fills its cache)", f"{_fmt_s(fc['blocking_seconds'])} / {_fmt_s(fc['total_seconds'])}", ""
        )
    console.print(f)


def _render_memory(cl: dict[str, Any], leak: dict[str, Any], console: Console) -> None:
    from rich.table import Table

    mem = cl["store_memory"]
    t = Table(title=f"store memory after the saves [{cl['name']}] (RSS from /proc/<pid>/status, PSS from smaps_rollup)")
    for col in ("store", "pid", "shards", "held", "pooled", "VmRSS", "RssShmem", "RssAnon", "Pss", "RSS/held", "RSS/(held+pooled)"):
        t.add_column(col, justify="left" if col == "store" else "right")
    for h, e in mem["stores"].items():
        m = e.get("memory") or {}
        t.add_row(
            h,
            str(e.get("pid") or "-"),
            str(e.get("shards", "-")),
            _fmt_bytes(e.get("shard_bytes_held")),
            _fmt_bytes(e.get("pooled_bytes_estimate")),
            _fmt_bytes(m.get("rss")),
            _fmt_bytes(m.get("rss_shmem")),
            _fmt_bytes(m.get("rss_anon")),
            _fmt_bytes(m.get("pss")),
            _fmt_ratio(e.get("rss_over_held")),
            _fmt_ratio(e.get("rss_over_held_plus_pooled")),
        )
    console.print(t)
    if leak.get("processes"):
        lt = Table(
            title=f"RSS over {leak['saves']} consecutive saves of {_short_size(leak['size'])} ({leak['hosts']} hosts, R={leak['replicas']})"
        )
        for col in (
            "process",
            f"RSS after save {leak['reference_save']}",
            f"after save {leak['saves']}",
            "growth",
            "RssAnon growth",
            "PSS growth",
        ):
            lt.add_column(col, justify="left" if col == "process" else "right")
        for k, v in leak["processes"].items():
            lt.add_row(
                k,
                _fmt_bytes(v["rss_after_save_ref"]),
                _fmt_bytes(v["rss_after_last_save"]),
                _fmt_pct(v["growth_percent"]),
                f"{v['rss_anon_growth_bytes'] / MiB:+.1f} MiB",
                _fmt_pct(v["pss_growth_percent"]),
            )
        console.print(lt)


def _render_diagnosis(result: dict[str, Any], cl: dict[str, Any], info: dict[str, Any], console: Console) -> None:
    from rich.table import Table

    cm = info["diagnosis"]
    nb = info["state"]["shard_bytes"]
    stall = cl["stall_seconds"]
    c = Table(title="diagnosis: CPU cost of the save path and of the gRPC data plane's per-chunk steps (this process, same bytes)")
    c.add_column("step")
    c.add_column("time", justify="right")
    c.add_column("throughput", justify="right")
    sp = cm["save_path"]
    c.add_row("save: serialization.plan()", _fmt_s(sp["plan_seconds"]["p50"]), "")
    w = sp["write_into_shm_seconds"]["p50"]
    c.add_row("save: ShardLayout.write_into(pre-faulted /dev/shm mapping)", _fmt_s(w), _fmt_bps(nb / w))
    c.add_row("save: measured save() p50 (adds Allocate + Commit RPCs)", _fmt_s(stall["p50"]), "")
    fresh = sp.get("fresh_segment_seconds")
    if fresh:
        c.add_row(
            "store: a fresh segment (ftruncate + fallocate + MAP_POPULATE as SegmentPool._create; cold saves, pulls into an empty pool)",
            f"{_fmt_s(fresh['seconds']['p50'])} (fallocate {_fmt_s(fresh['fallocate_seconds']['p50'])})",
            _fmt_bps(nb / fresh["seconds"]["p50"]),
        )
    for k, v in cm["seconds"].items():
        c.add_row(f"replication: {k}", _fmt_s(v), _fmt_bps(cm["bytes"] / v if v > 0 else None))
    c.add_row("replication: sender CPU estimate (xxh3 + build + serialize)", _fmt_s(cm["sender_cpu_seconds_estimate"]), "")
    c.add_row("replication: receiver CPU estimate (parse + xxh3 + copy)", _fmt_s(cm["receiver_cpu_seconds_estimate"]), "")
    if cl["replicas"] >= 2:
        c.add_row(f"replication: measured (committed - stall) p50, {cl['data_plane']}", _fmt_s(cl["replication_seconds"]["p50"]), "")
    loc = cl["restore_local"]
    c.add_row("restore (local, new process): connect p50", _fmt_s(loc["connect_seconds"]["p50"]), "")
    c.add_row(
        "restore (local, new process): load() p50 (LatestStep + Fetch + Open + map + verify + decode)",
        _fmt_s(loc["load_seconds"]["p50"]),
        "",
    )
    peer = cl.get("restore_peer")
    if peer:
        runs = peer["runs"]
        c.add_row(
            "restore (host loss): replacement store start -> serving p50 (not in the figure)",
            _fmt_s(_percentile([r["restart_seconds"] for r in runs if r.get("restart_seconds")], 50)),
            "",
        )
        c.add_row(
            "restore (host loss): port open -> loaded p50 (includes the replacement's startup before it serves)",
            _fmt_s(_percentile([r["port_open_to_loaded_seconds"] for r in runs], 50)),
            "",
        )
        c.add_row(
            "restore (host loss): connect p50 / load() p50 (LatestStep + Fetch joining the repair's pull + Open + verify)",
            f"{_fmt_s(peer['connect_seconds']['p50'])} / {_fmt_s(peer['load_seconds']['p50'])}",
            "",
        )
        pp = cl.get("peer_pull")
        if fresh and pp:
            model = fresh["seconds"]["p50"] + pp["seconds"]["p50"] + loc["seconds"]["p50"]
            c.add_row(
                "restore (host loss): model = fresh segment + pull into a pooled segment + local restore (vs measured)",
                f"{_fmt_s(model)} (measured {_fmt_s(peer['seconds']['p50'])})",
                "",
            )
    console.print(c)


def _render_matrix(result: dict[str, Any], console: Console) -> None:
    from rich.table import Table

    t = Table(
        title=f"all scenarios ({len(result['scenarios'])} run, {len(result.get('failed', []))} failed, {len(result['skipped'])} skipped); "
        "headline marked *"
    )
    for col in (
        "scenario",
        "stall p50 (x memcpy)",
        "stall / DCP blocking",
        "committed p50",
        "replication (x TCP)",
        "local restore (vs torch.load)",
        "peer restore, host loss (x TCP)",
        "RSS/held (/held+pooled)",
        "targets (P/M)",
        "other CPU / pressure",
    ):
        t.add_column(col, justify="left" if col == "scenario" else "right")
    for s in result["scenarios"]:
        info = result["sizes"][str(s["size"])]
        nb = info["state"]["shard_bytes"]
        ra = s["ratios"]
        cond = s["conditions"]
        peer = s.get("restore_peer")
        peer_txt = "-"
        if peer:
            peer_txt = f"{_fmt_s(peer['seconds']['p50'])} ({_fmt_ratio(ra['restore_peer_over_raw_tcp'])})"
        elif s.get("restore_peer_deleted"):
            peer_txt = (
                f"deleted copy: {_fmt_s(s['restore_peer_deleted']['seconds']['p50'])} ({_fmt_ratio(ra['restore_peer_over_raw_tcp'])})"
            )
        repl = (
            "-"
            if s["replicas"] < 2
            else f"{_fmt_bps(s['replication_bytes_per_second']['p50'])} ({_fmt_ratio(ra['replication_over_raw_tcp'])})"
        )
        other = cond.get("other_cpu_share_of_machine")
        pres = cond.get("cpu_pressure_some_share")
        t.add_row(
            s["name"] + (" *" if s["headline"] else ""),
            f"{_fmt_s(s['stall_seconds']['p50'])} ({_fmt_ratio(ra['stall_p50_over_memcpy'])})",
            _fmt_ratio(ra["stall_p50_over_dcp_async_blocking"]),
            _fmt_s(s["committed_seconds"]["p50"]),
            repl,
            f"{_fmt_s(s['restore_local']['seconds']['p50'])} ({_fmt_faster(ra['torch_load_warm_over_restore_local'])})",
            peer_txt,
            f"{_fmt_ratio(ra['store_rss_over_held_max'])} ({_fmt_ratio(ra['store_rss_over_held_plus_pooled_max'])})",
            f"{s['targets_passed']}/{s['targets_passed'] + s['targets_missed']} "
            + "".join({True: "P", False: "M", None: "-"}[v["pass"]] for v in s["targets"].values()),
            f"{'-' if other is None else f'{other * 100:.0f}%'} / {'-' if pres is None else f'{pres * 100:.0f}%'}",
        )
        del nb
    console.print(t)
    order = ", ".join(f"{i + 1} {k}" for i, k in enumerate(result["scenarios"][0]["targets"]))
    console.print(f"[dim]targets column: passed/evaluated, then P(ASS)/M(ISS)/-(n/a) per target in this order: {order}[/]")
    for s in result["skipped"]:
        what = f"{_short_size(s['size'])}, " if s.get("size") else ""
        console.print(f"[yellow]skipped {what}{s['hosts']} hosts, R={s['replicas']}: {s['reason']}[/]")


# --------------------------------------------------------------------------------------------------
# figures
# --------------------------------------------------------------------------------------------------


def write_plot(result: dict[str, Any], path: str) -> None:
    """Bars of memstore vs the baselines for stall and restore (headline), throughput and stall vs size, store
    memory vs bytes held, and RSS over the leak check's saves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    head = result["cluster"]
    info = result["sizes"][str(head["size"])]
    fl = info["floors"]
    nb = info["state"]["shard_bytes"]
    fig, axes = plt.subplots(2, 3, figsize=(19, 10.5))
    ms, base, ref = "#1f77b4", "#ff7f0e", "#7f7f7f"

    seconds_fmt = FuncFormatter(lambda v, _pos: _fmt_s(v))

    def log_seconds(axis: Any) -> None:
        axis.set_major_formatter(seconds_fmt)
        axis.set_minor_formatter(NullFormatter())

    sizes = sorted(int(k) for k in result["sizes"])

    def size_axis(ax: Any) -> None:
        ax.set_xscale("log", base=2)
        ax.set_xticks([x / MiB for x in sizes], [_short_size(x) for x in sizes])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlim(sizes[0] / MiB / 1.5, sizes[-1] / MiB * 1.5)
        ax.set_xlabel("state size")

    def bars(ax: Any, items: list[tuple[str, float | None, str]], title: str) -> None:
        shown = [(n, float(v), c) for n, v, c in items if v]
        ys = list(range(len(shown)))
        ax.barh(ys, [v for _, v, _ in shown], color=[c for _, _, c in shown])
        ax.set_yticks(ys, [n for n, _, _ in shown], fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        log_seconds(ax.xaxis)
        ax.set_xlim(min(v for _, v, _ in shown) / 2, max(v for _, v, _ in shown) * 4)
        ax.set_xlabel("seconds (log); blue: memstore, orange: baselines, grey: hardware floor")
        ax.set_title(title, fontsize=10)
        for y, (_, v, _) in zip(ys, shown, strict=True):
            ax.text(v, y, f" {_fmt_s(v)}", va="center", fontsize=7)

    dcp = fl["dcp"]
    bars(
        axes[0][0],
        [
            ("memstore save() stall p50", head["stall_seconds"]["p50"], ms),
            ("memstore save() stall p95", head["stall_seconds"]["p95"], ms),
            ("torch copy_ pre-faulted (paired)", head["paired_memcpy_seconds"]["p50"], ref),
            ("DCP async_save blocking (default)", dcp["default"]["blocking_seconds"]["p50"], base),
            ("DCP async_save blocking (reused stager)", dcp["reused_stager"]["blocking_seconds"]["p50"], base),
            ("torch.save + fsync", fl["disk"]["save_fsync_seconds"], base),
            ("memstore time to committed p50", head["committed_seconds"]["p50"], ms),
            ("DCP async_save total (fsynced)", dcp["default"]["total_seconds"]["p50"], base),
        ],
        f"trainer stall [{head['name']}]",
    )
    peer = head.get("restore_peer") or {}
    bars(
        axes[0][1],
        [
            ("local RAM, new process, zero-copy", head["restore_local"]["seconds"]["p50"], ms),
            ("local RAM, new process, copy", head["restore_local_copy"]["seconds"]["p50"], ms),
            ("peer RAM after host loss", (peer.get("seconds") or {}).get("p50"), ms),
            ("peer RAM, owner's copy deleted", ((head.get("restore_peer_deleted") or {}).get("seconds") or {}).get("p50"), ms),
            ("store pull alone (Fetch)", ((head.get("peer_pull") or {}).get("seconds") or {}).get("p50"), ms),
            ("raw TCP, same bytes", fl["tcp"]["seconds"]["p50"], ref),
            ("torch.load, page cache warm", fl["disk"]["load_warm_seconds"]["p50"], base),
            ("torch.load, page cache evicted", fl["disk"]["load_cold_seconds"]["p50"], base),
        ],
        f"restore [{head['name']}] (durable tier: n/a)",
    )

    # throughput vs size, per (hosts, R)
    ax = axes[0][2]
    series: dict[str, list[tuple[int, float, float | None]]] = {}
    for s in result["scenarios"]:
        snb = result["sizes"][str(s["size"])]["state"]["shard_bytes"]
        repl = s["replication_bytes_per_second"]["p50"] if s["replicas"] >= 2 else None
        p = s.get("restore_peer")
        series.setdefault(f"{s['hosts']}h R={s['replicas']}", []).append((s["size"], repl or 0.0, snb / p["seconds"]["p50"] if p else None))
    for label, pts in sorted(series.items()):
        pts.sort()
        if any(r for _, r, _ in pts):
            line = ax.plot([x / MiB for x, _, _ in pts], [r / GiB for _, r, _ in pts], marker="o", label=f"replication {label}")[0]
            peer_pts = [(x, pr) for x, _, pr in pts if pr]
            if peer_pts:
                ax.plot([x / MiB for x, _ in peer_pts], [v / GiB for _, v in peer_pts], marker="x", ls="--", color=line.get_color(),
                        label=f"peer restore {label}")  # fmt: skip
    ax.plot([x / MiB for x in sizes], [result["sizes"][str(x)]["floors"]["tcp"]["bytes_per_second"]["p50"] / GiB for x in sizes],
            color="k", marker="s", lw=2, label="raw TCP loopback")  # fmt: skip
    size_axis(ax)
    ax.set_ylabel("GiB/s")
    ax.set_ylim(bottom=0)
    ax.set_title("throughput vs size (x: peer restore after a host loss)", fontsize=10)
    ax.legend(fontsize=6, ncol=2, loc="lower left")

    # stall vs size
    ax = axes[1][0]
    stall_series: dict[str, list[tuple[int, float]]] = {}
    for s in result["scenarios"]:
        stall_series.setdefault(f"{s['hosts']}h R={s['replicas']}", []).append((s["size"], s["stall_seconds"]["p50"]))
    for label, spts in sorted(stall_series.items()):
        spts.sort()
        ax.plot([x / MiB for x, _ in spts], [v for _, v in spts], marker="o", label=f"memstore stall {label}")
    for key, label, color in (
        (lambda f: f["memcpy"]["torch_copy_seconds"]["p50"], "torch copy_ pre-faulted", ref),
        (lambda f: f["dcp"]["default"]["blocking_seconds"]["p50"], "DCP async_save blocking", base),
        (lambda f: f["disk"]["save_fsync_seconds"], "torch.save + fsync", "k"),
    ):
        ax.plot(
            [x / MiB for x in sizes], [key(result["sizes"][str(x)]["floors"]) for x in sizes], color=color, marker="s", lw=2, label=label
        )
    size_axis(ax)
    ax.set_yscale("log")
    log_seconds(ax.yaxis)
    ax.set_ylabel("seconds (log)")
    ax.set_title("stall vs size", fontsize=10)
    ax.legend(fontsize=7)

    # store memory
    ax = axes[1][1]
    mem = head["store_memory"]["stores"]
    hosts = list(mem)
    xs = list(range(len(hosts)))
    w = 0.2
    for i, (kind, label, color) in enumerate(
        (
            ("held", "shard bytes held", "#2ca02c"),
            ("used", "held + pooled (used_bytes)", "#98df8a"),
            ("rss", "VmRSS", ms),
            ("pss", "Pss", "#aec7e8"),
        )
    ):
        vals = []
        for h in hosts:
            e = mem[h]
            m = e.get("memory") or {}
            v = {"held": e.get("shard_bytes_held"), "used": e.get("used_bytes"), "rss": m.get("rss"), "pss": m.get("pss")}[kind]
            vals.append((v or 0) / GiB)
        ax.bar([x + (i - 1.5) * w for x in xs], vals, w, label=label, color=color)
    ax.set_xticks(xs, hosts)
    ax.set_ylabel("GiB")
    ax.set_title(f"store memory after the saves [{head['name']}]", fontsize=10)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.06), ncol=4)

    # leak check
    ax = axes[1][2]
    leak = result["leak_check"]
    if leak.get("processes"):
        for label, v in leak["processes"].items():
            ys = [(x or 0) / MiB for x in v["rss_series"]]
            ax.plot(range(1, len(ys) + 1), ys, label=f"{label} ({_fmt_pct(v['growth_percent'])})")
        ax.axvline(leak["reference_save"], color=ref, ls=":")
        ax.set_xlabel("save #")
        ax.set_ylabel("VmRSS (MiB)")
        ax.set_title(f"RSS over {leak['saves']} saves of {_short_size(leak['size'])} (leak check)", fontsize=10)
        ax.legend(fontsize=7)
    else:
        ax.set_axis_off()
        ax.set_title("leak check skipped", fontsize=10)

    m = result["machine"]
    cond = result["conditions"]
    busy = cond.get("cpu_pressure_some_share_during_run")
    fig.suptitle(
        f"memstore bench: headline {head['name']} ({_fmt_bytes(nb)} shard), {len(result['scenarios'])} scenario(s); "
        f"{m['cpu_count']} CPUs, {_fmt_bytes(m['ram_bytes'])} RAM, torch {m['torch']}; CPU pressure "
        f"{'-' if busy is None else f'{busy * 100:.0f}%'}",
        fontsize=11,
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
