"""``memstore bench`` flags, their defaults, and the checked run configuration they make.

Standard library only: the command line imports this to build its parser without loading torch.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from memstore.bench.units import MiB

MAX_HOSTS = 8
DEFAULT_MAX_RAM = "18GiB"

# --matrix: a sweep that fits ~10 min on a 2-core, 24 GiB machine. The headline scenario (1 GiB, 2 hosts,
# R=2) runs with the full --saves/--restores, the others with fewer.
MATRIX_SIZES = "64MiB,256MiB,1GiB,4GiB"
MATRIX_COMBOS: tuple[tuple[int, int], ...] = ((2, 1), (2, 2), (3, 2), (3, 3), (4, 2), (4, 3))
MATRIX_SAVES = 3
MATRIX_RESTORES = 1

# From the first save (issue 16): the small states (one rank, the headline's cluster shape) and their saves after the first.
SMALL_SIZES = (1 * MiB, 16 * MiB)
SMALL_SAVES = 30
PREFAULT_ENV = "MEMSTORE_PREFAULT"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every ``memstore bench`` flag."""
    _add_scenario_arguments(p)
    _add_repetition_arguments(p)
    _add_output_arguments(p)
    _add_store_arguments(p)
    # --endpoints clusters with tokens/TLS: the bench's clients (and local stores, through the environment) present these.
    from memstore.cli.common import add_credential_arguments

    add_credential_arguments(p)


def _add_scenario_arguments(p: argparse.ArgumentParser) -> None:
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


def _add_repetition_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--saves", type=int, default=None, help="steady-state saves after save 1 and saves 2..keep+2 (default 5; --quick 2)")
    p.add_argument(
        "--restores", type=int, default=None, help="repetitions of each restore and of the disk/DCP baselines (default 3; --quick 1)"
    )
    p.add_argument(
        "--keep", type=int, default=2, help="steps each store keeps (default 2); saves 2..keep+2 are reported apart from the steady state"
    )
    p.add_argument(
        "--small-saves",
        type=int,
        default=None,
        help=f"saves after the first of the {'/'.join(f'{n >> 20} MiB' for n in SMALL_SIZES)} states (fixed cost per save) and "
        f"of the per-tensor states (default {SMALL_SAVES}; 0 = skip those figures)",
    )
    p.add_argument("--leak-saves", type=int, default=None, help="consecutive saves of the RSS leak check (default 100; 0 = skip)")
    p.add_argument("--leak-size", default=None, help="state size of the leak check (default 64MiB; --quick 16MiB)")
    p.add_argument(
        "--max-ram", default=DEFAULT_MAX_RAM, help=f"skip scenarios whose estimated RAM need exceeds this (default {DEFAULT_MAX_RAM})"
    )


def _add_output_arguments(p: argparse.ArgumentParser) -> None:
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


def _add_store_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data-plane",
        choices=("tcp", "grpc"),
        default=None,
        help="passed to the stores as --data-plane (how replicas and pulls travel); default: the store's default",
    )
    p.add_argument(
        "--prefault",
        default=None,
        metavar="SIZE|auto",
        help="passed to the stores as MEMSTORE_PREFAULT (fresh memory they pre-fault at start-up; auto: learn shard sizes and keep "
        "a reserve after the first shard). Default: nothing passed (the store's default), and the headline's saves from the first "
        "are measured a second time on fresh stores with MEMSTORE_PREFAULT = (keep+2)x the state",
    )
    p.add_argument(
        "--store-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment of the store processes, repeatable (e.g. MALLOC_TRIM_THRESHOLD_=268435456 to try allocator tuning)",
    )


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
    # --prefault (or MEMSTORE_PREFAULT in --store-env): what the stores get; None = nothing (the store's default), and the
    # headline's saves from the first are measured a second time with (keep+2)x the state pre-faulted
    prefault: str | None = None
    small_saves: int = SMALL_SAVES
    # the headline scenario, for the JSON's readers of issue 2 (one scenario per run)
    size: int = 0
    hosts_headline: int = 0
    replicas_headline: int = 0


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


def _sizes(args: argparse.Namespace) -> list[int]:
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
    return sorted(set(sizes))


def _repetitions(args: argparse.Namespace) -> tuple[int, int]:
    saves = args.saves if args.saves is not None else (2 if args.quick else 5)
    restores = args.restores if args.restores is not None else (1 if args.quick else 3)
    if saves < 1 or restores < 1:
        raise ValueError(f"--saves {saves} / --restores {restores} are invalid: expected >= 1")
    if args.keep < 1:
        raise ValueError(f"--keep {args.keep} is invalid: expected >= 1")
    return saves, restores


def _topology(args: argparse.Namespace) -> tuple[list[int], list[int], list[tuple[int, int]]]:
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
    return sorted(set(hosts)), sorted(set(replicas)), combos


def _leak(args: argparse.Namespace) -> tuple[int, int]:
    from memstore.core.sizes import parse_size

    leak_saves = args.leak_saves if args.leak_saves is not None else 100
    if leak_saves != 0 and leak_saves < 10:
        raise ValueError(f"--leak-saves {leak_saves} is invalid: expected 0 (skip) or >= 10 (RSS after save 10 is the reference)")
    leak_size = parse_size(args.leak_size or ("16MiB" if args.quick else "64MiB"))
    if leak_size < MiB:
        raise ValueError(f"--leak-size {args.leak_size} is too small: expected at least 1MiB")
    return leak_saves, leak_size


def _store_env(items: list[str] | None) -> dict[str, str]:
    store_env = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--store-env {item!r} is invalid: expected KEY=VALUE")
        store_env[key] = value
    return store_env


def _prefault(args: argparse.Namespace, store_env: dict[str, str]) -> str | None:
    from memstore.core.sizes import parse_size

    value = args.prefault if args.prefault is not None else store_env.get(PREFAULT_ENV)
    if value is None:
        return None
    value = value.strip()
    if value.lower() == "auto":
        return "auto"
    try:
        parse_size(value)
    except ValueError:
        raise ValueError(f"--prefault {value!r} is invalid: expected a size (e.g. 2GiB, 0) or auto") from None
    return value


def _small_saves(args: argparse.Namespace) -> int:
    n = args.small_saves if args.small_saves is not None else SMALL_SAVES
    if n < 0:
        raise ValueError(f"--small-saves {n} is invalid: expected >= 0 (0 skips the small-state and per-tensor figures)")
    return int(n)


def plot_path_of(args: argparse.Namespace) -> str | None:
    """Where the figures go: --plot, else next to --json; None with --no-plot."""
    if args.no_plot:
        return None
    return args.plot_path or (str(Path(args.json_path).with_suffix(".png")) if args.json_path else None)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The checked configuration; ValueError names the bad flag."""
    from memstore.core.sizes import parse_size

    sizes = _sizes(args)
    saves, restores = _repetitions(args)
    hosts, replicas, combos = _topology(args)
    leak_saves, leak_size = _leak(args)
    store_env = _store_env(args.store_env)
    if args.endpoints and not os.path.isfile(args.endpoints):
        raise ValueError(f"--endpoints {args.endpoints} does not exist")
    return BenchConfig(
        sizes=sizes,
        hosts=hosts,
        replicas=replicas,
        saves=saves,
        restores=restores,
        keep=args.keep,
        warmup=args.keep + 1,
        json_path=args.json_path,
        plot_path=plot_path_of(args),
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
        prefault=_prefault(args, store_env),
        small_saves=_small_saves(args),
    )
