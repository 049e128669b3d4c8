"""``memstore simulate``: ETTR and wasted GPU-hours of memstore vs remote-storage checkpoints at scale.

:func:`add_arguments` and :func:`run` are the command (``memstore.cli.simulate`` wires them into ``memstore``);
:func:`main` parses a list of arguments itself. Bad flags print the usage and ``memstore simulate: error: ...``
naming the flag, exit code 2: argparse's own checks, and :func:`run`'s checks of the flags together, which raise
:class:`argparse.ArgumentError` for the parser to report.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from memstore.core.redundancy import Redundancy
from memstore.sim import protocol_cli
from memstore.sim.flags import (
    fraction,
    host_list,
    integer,
    interval,
    nonnegative_float,
    positive_float,
    positive_int,
)
from memstore.sim.redundancy_compare import SchemeResult, compare, comparison_schemes
from memstore.sim.replay import (
    DEFAULT_FAILURE_DATA,
    FAILURE_DATA,
    PointResult,
    SimConfig,
    failures_per_gpu_hour_from_job,
    run_point,
)

DEFAULT_HOSTS = "16,128,1000,4096,16384"
#: Upper bound on failure events simulated in one invocation (all host counts, all trials, one strategy).
MAX_EVENTS = 5_000_000
#: The flags' defaults (a configuration's fields; the host count is a placeholder).
DEFAULTS = SimConfig(hosts=16)


# --------------------------------------------------------------------------------------------------
# Parser
# --------------------------------------------------------------------------------------------------


DESCRIPTION = (
    "Seeded scale simulator: replays one Poisson failure trace per trial against memstore (checkpoint to peer RAM "
    "every iteration, spill to storage in the background) and a baseline (checkpoint to remote storage every X "
    "minutes), and reports ETTR and wasted GPU-hours. `memstore simulate protocol`: message counts and restart time of the "
    "restore protocol at 1,000s of hosts. See docs/simulator.md."
)
#: The help shows every flag's default.
FORMATTER = argparse.ArgumentDefaultsHelpFormatter


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memstore simulate", description=DESCRIPTION, formatter_class=FORMATTER)
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every ``memstore simulate`` flag, in groups, and the ``protocol`` mode with flags of its own."""
    _add_job_arguments(p)
    _add_failure_arguments(p)
    _add_memstore_arguments(p)
    _add_baseline_arguments(p)
    _add_output_arguments(p)
    modes = p.add_subparsers(
        dest="simulate_mode",
        title="modes",
        metavar="{protocol}",
        description="without a mode: the ETTR sweep above. `memstore simulate protocol --help` for the restore protocol's model",
    )
    q = modes.add_parser("protocol", help=protocol_cli.HELP, description=protocol_cli.DESCRIPTION, formatter_class=FORMATTER)
    protocol_cli.add_arguments(q)


def _add_job_arguments(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    g = p.add_argument_group("job")
    g.add_argument("--hosts", type=host_list, default=DEFAULT_HOSTS, metavar="N[,N...]", help="host counts to sweep")
    g.add_argument("--gpus-per-host", type=positive_int, default=d.gpus_per_host, help="GPUs per host")
    g.add_argument(
        "--replicas", type=positive_int, default=None, help=f"copies of each checkpoint, owner included (GEMINI's m; default {d.replicas})"
    )
    g.add_argument(
        "--redundancy",
        default=None,
        metavar="replicas:R|ec:K+M",
        help="how each checkpoint is protected in RAM, instead of --replicas: R copies, or erasure coding in groups of K+M",
    )
    g.add_argument("--placement", choices=("mixed", "ring"), default=d.placement, help="replica placement (GEMINI mixed groups or ring)")
    g.add_argument("--days", type=positive_float, default=d.days, help="wall-clock length of the simulated job")
    g.add_argument("--iteration-seconds", type=positive_float, default=d.iteration_seconds, help="training iteration time")
    g.add_argument(
        "--checkpoint-gb", type=positive_float, default=None, help=f"total checkpoint size, 10^9 bytes (default {d.checkpoint_gb:g})"
    )
    g.add_argument(
        "--checkpoint-gb-per-host", type=positive_float, default=None, help="checkpoint size per host instead (total grows with --hosts)"
    )


def _add_failure_arguments(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    g = p.add_argument_group("failures")
    rate = g.add_mutually_exclusive_group()
    rate.add_argument(
        "--failure-data",
        choices=sorted(FAILURE_DATA),
        default=None,
        help=f"published failure figure giving a per-GPU rate (default {DEFAULT_FAILURE_DATA}): "
        + "; ".join(f"{k}: {v.job_mttf_hours:.2f} h job MTTF at {v.gpus:,} GPUs" for k, v in FAILURE_DATA.items()),
    )
    rate.add_argument("--mttf-hours", type=positive_float, default=None, help="job mean time to failure in hours (see --rate-at-hosts)")
    rate.add_argument("--failures-per-day", type=nonnegative_float, default=None, help="job failures per day (see --rate-at-hosts)")
    g.add_argument(
        "--rate-at-hosts",
        type=positive_int,
        default=None,
        help="host count at which --mttf-hours / --failures-per-day hold; the per-GPU rate derived there scales to the other host "
        "counts. Default: the figure holds as given for every simulated host count",
    )
    g.add_argument(
        "--correlated-fraction",
        type=fraction,
        default=d.correlated_fraction,
        help="fraction of failures that hit --burst-hosts hosts at once",
    )
    g.add_argument("--burst-hosts", type=positive_int, default=d.burst_hosts, help="hosts lost in a correlated failure (rack / switch)")
    g.add_argument("--restart-seconds", type=nonnegative_float, default=d.restart_seconds, help="detection + job restart per failure")


def _add_memstore_arguments(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    g = p.add_argument_group("memstore")
    g.add_argument(
        "--memstore-stall-seconds", type=nonnegative_float, default=d.memstore_stall_seconds, help="training stall per RAM checkpoint"
    )
    g.add_argument(
        "--network-gbps", type=positive_float, default=d.network_gbps, help="per-host network bandwidth (replication, peer restore)"
    )
    g.add_argument(
        "--spill-every-minutes", type=positive_float, default=d.spill_every_minutes, help="background spill to durable storage every H"
    )
    g.add_argument(
        "--compare-redundancy",
        nargs="?",
        const="auto",
        default=None,
        metavar="auto|SCHEME[,SCHEME...]",
        help="also replay every trace with these schemes and print them side by side (RAM, P(recover from RAM), restore "
        "time, ETTR); auto (the default value): an ec:K+M --redundancy against replicas:M+1 (as many losses) and the "
        "replicas that fit in its RAM",
    )


def _add_baseline_arguments(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    g = p.add_argument_group("baseline (remote storage)")
    g.add_argument("--storage-gbps", type=positive_float, default=d.storage_gbps, help="aggregate remote storage bandwidth of the job")
    g.add_argument(
        "--baseline-every-minutes",
        type=interval,
        default=None,
        metavar="MIN|auto",
        help="checkpoint interval; auto = Young/Daly sqrt(2 * write time * MTTF)",
    )
    g.add_argument(
        "--baseline-async-fraction",
        type=fraction,
        default=d.baseline_async_fraction,
        help="share of the storage write hidden from training (0 = the whole write stalls)",
    )


def _add_output_arguments(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    g = p.add_argument_group("run and output")
    g.add_argument("--seed", type=integer, default=d.seed, help="random seed (same seed, same result)")
    g.add_argument("--trials", type=positive_int, default=20, help="independent failure traces per host count")
    g.add_argument("--json", metavar="PATH", default=None, help="write all results as JSON")
    g.add_argument("--plot", metavar="PATH.png", default=None, help="write ETTR / wasted GPU-hours plots (matplotlib)")
    g.add_argument("--markdown", metavar="PATH", default=None, help="write the tables as Markdown")
    g.add_argument("--no-table", action="store_true", help="don't print the tables")


# --------------------------------------------------------------------------------------------------
# From flags to configurations
# --------------------------------------------------------------------------------------------------


def _usage_error(message: str) -> argparse.ArgumentError:
    """A problem with the flags together: the parser reports it (usage, ``memstore simulate: error: ...``, exit code 2)."""
    return argparse.ArgumentError(None, message)


def _rate_model(args: argparse.Namespace) -> tuple[Callable[[int], float], dict[str, Any]]:
    """(host count -> per-GPU failure rate, description for the report)."""
    gph = args.gpus_per_host
    if args.mttf_hours is None and args.failures_per_day is None:
        if args.rate_at_hosts is not None:
            raise _usage_error("--rate-at-hosts only applies with --mttf-hours or --failures-per-day")
        data = FAILURE_DATA[args.failure_data or DEFAULT_FAILURE_DATA]
        rate = data.failures_per_gpu_hour
        return (lambda n: rate), {
            "kind": "published",
            "name": data.name,
            "source": data.source,
            "job_mttf_hours": data.job_mttf_hours,
            "at_gpus": data.gpus,
            "failures_per_gpu_hour": rate,
        }
    figure = {"mttf_hours": args.mttf_hours, "failures_per_day": args.failures_per_day}
    if args.rate_at_hosts is not None:
        fixed = failures_per_gpu_hour_from_job(**figure, gpus=args.rate_at_hosts * gph)
        return (lambda n: fixed), {
            "kind": "job figure scaled per GPU",
            **figure,
            "at_hosts": args.rate_at_hosts,
            "failures_per_gpu_hour": fixed,
        }
    return (lambda n: failures_per_gpu_hour_from_job(**figure, gpus=n * gph)), {
        "kind": "job figure at every host count",
        **figure,
    }


def configs_from_args(args: argparse.Namespace) -> tuple[list[SimConfig], dict[str, Any]]:
    """One :class:`SimConfig` per host count, plus the parameters for the JSON; :class:`argparse.ArgumentError` on bad input."""
    if args.checkpoint_gb is not None and args.checkpoint_gb_per_host is not None:
        raise _usage_error("give either --checkpoint-gb or --checkpoint-gb-per-host, not both")
    try:
        scheme = Redundancy.resolve(args.replicas, args.redundancy, DEFAULTS.replicas)
    except ValueError as exc:
        raise _usage_error(str(exc) if args.replicas is not None and args.redundancy is not None else f"--{exc}") from None
    too_few = [n for n in args.hosts if n < scheme.group_size]
    if too_few and not scheme.erasure_coded:
        raise _usage_error(f"--replicas {scheme.replicas} is more than --hosts {too_few[0]} (replicas counts the owner's own copy)")
    if too_few:
        raise _usage_error(f"--redundancy {scheme} needs at least {scheme.group_size} hosts (K+M), more than --hosts {too_few[0]}")
    rate_for, rate_info = _rate_model(args)
    configs: list[SimConfig] = []
    for n in args.hosts:
        if args.checkpoint_gb_per_host is not None:
            ckpt = args.checkpoint_gb_per_host * n
        else:
            ckpt = args.checkpoint_gb if args.checkpoint_gb is not None else SimConfig.checkpoint_gb
        fields: dict[str, Any] = dict(
            hosts=n,
            replicas=scheme.replicas,
            redundancy=str(scheme) if scheme.erasure_coded else "",
            placement=args.placement,
            gpus_per_host=args.gpus_per_host,
            days=args.days,
            seed=args.seed,
            trials=args.trials,
            failures_per_gpu_hour=rate_for(n),
            correlated_fraction=args.correlated_fraction,
            burst_hosts=args.burst_hosts,
            iteration_seconds=args.iteration_seconds,
            memstore_stall_seconds=args.memstore_stall_seconds,
            restart_seconds=args.restart_seconds,
            network_gbps=args.network_gbps,
            storage_gbps=args.storage_gbps,
            checkpoint_gb=ckpt,
            spill_every_minutes=args.spill_every_minutes,
            baseline_every_minutes=args.baseline_every_minutes,
            baseline_async_fraction=args.baseline_async_fraction,
        )
        try:
            configs.append(SimConfig(**fields))
        except ValueError as exc:  # validate_config's messages name the flags
            raise _usage_error(str(exc)) from None
    events = sum(c.job_failures_per_day * c.days * c.trials for c in configs)
    if events > MAX_EVENTS:
        raise _usage_error(
            f"about {events:,.0f} failure events to simulate (more than {MAX_EVENTS:,}): lower --failures-per-day / raise --mttf-hours, "
            "or reduce --days, --trials or --hosts"
        )
    common = asdict(configs[0])
    for k in ("hosts", "failures_per_gpu_hour", "checkpoint_gb"):
        common.pop(k)
    parameters: dict[str, Any] = {
        "hosts": list(args.hosts),
        **common,
        "checkpoint": (
            {"gb_per_host": args.checkpoint_gb_per_host}
            if args.checkpoint_gb_per_host is not None
            else {"gb_total": configs[0].checkpoint_gb}
        ),
        "failure_rate": rate_info,
    }
    return configs, parameters


def title_of(parameters: dict[str, Any]) -> str:
    rate = parameters["failure_rate"]
    if rate["kind"] == "published":
        fail = f"failures: {rate['name']} ({rate['job_mttf_hours']:.2f} h MTTF at {rate['at_gpus']:,} GPUs)"
    else:
        what = f"{rate['mttf_hours']:g} h MTTF" if rate.get("mttf_hours") is not None else f"{rate['failures_per_day']:g} failures/day"
        fail = f"failures: {what} " + (f"at {rate['at_hosts']:,} hosts, scaled per GPU" if "at_hosts" in rate else "at every host count")
    ckpt = parameters["checkpoint"]
    size = f"{ckpt['gb_total']:g} GB ckpt" if "gb_total" in ckpt else f"{ckpt['gb_per_host']:g} GB ckpt/host"
    scheme = parameters["redundancy"] or f"R={parameters['replicas']}"
    return (
        f"memstore simulate: {parameters['days']:g} days x {parameters['trials']} trials, seed {parameters['seed']}; {fail}; "
        f"{parameters['correlated_fraction']:.0%} bursts of {parameters['burst_hosts']} hosts; {scheme} "
        f"{parameters['placement']}; {size}; iteration {parameters['iteration_seconds']:g} s; restart {parameters['restart_seconds']:g} s; "
        f"network {parameters['network_gbps']:g} Gbps/host; storage {parameters['storage_gbps']:g} Gbps; spill every "
        f"{parameters['spill_every_minutes']:g} min"
    )


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) as ``memstore simulate`` flags and run; the exit code (2: bad flags)."""
    parser = build_parser()
    try:
        return run(parser.parse_args(sys.argv[1:] if argv is None else argv))
    except argparse.ArgumentError as exc:
        try:
            parser.error(str(exc))
        except SystemExit as usage:
            return _exit_code(usage)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return _exit_code(exc)


def _exit_code(exc: SystemExit) -> int:
    return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)


def run(args: argparse.Namespace) -> int:
    """Run ``memstore simulate`` with flags parsed by a parser :func:`add_arguments` filled; the exit code.

    Raises :class:`argparse.ArgumentError` if the flags do not fit together (before simulating anything).
    """
    if getattr(args, "simulate_mode", None) == "protocol":
        _reject_sweep_flags(args)
        return protocol_cli.run(args)
    configs, parameters = configs_from_args(args)
    schemes = _comparison_schemes(args, configs[0])
    started = time.perf_counter()
    points: list[PointResult] = [run_point(cfg) for cfg in configs]
    comparison = [r for cfg in configs for r in compare(cfg, schemes)] if schemes else []
    elapsed = time.perf_counter() - started
    title = title_of(parameters)
    if not args.no_table:
        _print_tables(points, title, f"{sum(c.trials for c in configs)} traces simulated in {elapsed:.2f} s", comparison)
    return _write_outputs(args, points, parameters, title, comparison)


def _comparison_schemes(args: argparse.Namespace, first: SimConfig) -> list[Redundancy]:
    """The schemes ``--compare-redundancy`` asks for (none without it); each must fit every host count."""
    if args.compare_redundancy is None:
        return []
    try:
        schemes = comparison_schemes(first.scheme, args.compare_redundancy)
    except ValueError as exc:
        raise _usage_error(f"--compare-redundancy: {exc}") from None
    too_big = next((s for s in schemes if s.group_size > min(args.hosts)), None)
    if too_big is not None:
        raise _usage_error(f"--compare-redundancy: {too_big} needs {too_big.group_size} hosts, more than --hosts {min(args.hosts)}")
    return schemes


def _reject_sweep_flags(args: argparse.Namespace) -> None:
    """``memstore simulate --days 3 protocol``: the sweep's flags would be ignored; say so instead."""
    defaults = vars(build_parser().parse_args([]))
    given = [k for k, v in defaults.items() if k != "simulate_mode" and getattr(args, k, v) != v]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise _usage_error(
            f"{flag} is a flag of the ETTR sweep; `memstore simulate protocol` takes its own flags after the word protocol "
            "(see memstore simulate protocol --help)"
        )


def _print_tables(points: list[PointResult], title: str, footer: str, comparison: list[SchemeResult]) -> None:
    from rich.console import Console

    from memstore.sim.report import render_compare, render_derived, render_table

    console = Console()
    if not console.is_terminal:  # piped / captured: don't squeeze the table into 80 columns
        console = Console(width=200)
    render_table(points, console, title)
    render_derived(points, console)
    if comparison:
        render_compare(comparison, console)
    console.print(f"[dim]{footer}[/]")


def _write_outputs(
    args: argparse.Namespace, points: list[PointResult], parameters: dict[str, Any], title: str, comparison: list[SchemeResult]
) -> int:
    """--json, --markdown and --plot; the exit code (1: --plot without matplotlib)."""
    if args.json:
        from memstore.sim.report import to_json, write_json

        out = write_json(args.json, to_json(points, parameters, comparison))
        print(f"wrote {out}")
    if args.markdown:
        from memstore.sim.report import markdown, write_text

        print(f"wrote {write_text(args.markdown, markdown(points, title, comparison))}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:  # pragma: no cover - matplotlib comes with the [bench] extra
            print(f"memstore simulate: error: --plot needs the [bench] extra: pip install 'memstore[bench]' ({exc})", file=sys.stderr)
            return 1
        from memstore.sim.report import plot

        out = plot(points, args.plot, title)
        print(f"wrote {out}")
    return 0
