"""A whole ``memstore bench`` run: plan, then per state size its baselines and scenarios, the leak check, the
tables, the JSON and the figures."""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from memstore.bench.first_save_results import FirstSaveRuns
from memstore.bench.first_save_runs import NO_SHM_SAVES, PREFAULT_STEADY_SAVES
from memstore.bench.floors import FLOOR_STEPS
from memstore.bench.jsonable import json_default, to_json
from memstore.bench.options import SMALL_SIZES, BenchConfig, config_from_args
from memstore.bench.plan import Scenario, plan_scenarios
from memstore.bench.results import SizeResult, StateInfo
from memstore.bench.run_result import BenchResult, assemble
from memstore.bench.scenario_results import (
    DURABLE_ENDPOINTS_NOTE,
    Endpoints,
    FailedScenario,
    Leak,
    LeakSkipped,
    ScenarioMeasurement,
    Skipped,
)
from memstore.bench.units import short_size
from memstore.errors import BenchSetupError

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

    from memstore.bench.sysinfo import Monitor

BENCH_EXTRA = "pip install 'memstore[bench]'"
STATE_LAYOUT = "4 layers x (weight, exp_avg, exp_avg_sq) + 4 scalar step tensors, torch.rand; one rank of world size 1"


def _console() -> Console:
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # logs and pipes: don't squeeze the tables into 80 columns
    return console


def _plot_unavailable(args: argparse.Namespace) -> str | None:
    """Why an explicitly asked --plot cannot be written (matplotlib, the [bench] extra, is missing), or None."""
    if not args.plot_path or args.no_plot or importlib.util.find_spec("matplotlib") is not None:
        return None
    return f"--plot needs matplotlib, which comes with the [bench] extra: {BENCH_EXTRA}"


def run_from_args(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Run with parsed ``memstore bench`` flags; ``argv`` is recorded in the JSON as ``bench_argv``. The exit code."""
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"memstore bench: error: {exc}", file=sys.stderr)
        return 2
    missing = _plot_unavailable(args)
    if missing:
        print(f"memstore bench: error: {missing}", file=sys.stderr)
        return 2
    console = _console()
    try:
        result = run_bench(config, shlex.join([sys.executable, *sys.argv]), console)
    except BenchSetupError as exc:
        print(f"memstore bench: error: {exc}", file=sys.stderr)
        return 2
    result.bench_argv = argv
    _write_outputs(result, config, console)
    return 0 if result.ok else 1


def _write_outputs(result: BenchResult, config: BenchConfig, console: Console) -> None:
    from memstore.bench.render import render

    render(result, console)
    if config.json_path:
        path = Path(config.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(to_json(result), indent=2, default=json_default) + "\n")
        console.print(f"raw numbers written to {path}")
    if config.plot_path and result.scenarios:
        try:
            from memstore.bench.plot import write_plot

            write_plot(result, config.plot_path)
            console.print(f"figures written to {config.plot_path}")
        except ImportError as exc:
            console.print(f"[yellow]no figures: {exc} (matplotlib comes with the [bench] extra: {BENCH_EXTRA})[/]")


def _progress(console: Console) -> Progress:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(
        SpinnerColumn(),
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


def _scenario_steps(config: BenchConfig, scn: Scenario) -> int:
    return 5 + config.warmup + scn.saves + scn.restores + 3 * scn.restores


def _first_save_steps(config: BenchConfig, head: Scenario, endpoints: Endpoints | None) -> int:
    """Progress steps of what a run measures once for its headline (issue 16)."""
    prefault = 0 if config.prefault is not None or endpoints is not None else 1 + config.warmup + min(head.saves, PREFAULT_STEADY_SAVES)
    durable = 0 if endpoints is not None else 1 + head.restores
    small = len(SMALL_SIZES) + 3 if config.small_saves else 0
    return prefault + NO_SHM_SAVES + 2 + durable + small


def _announce(console: Console, scenarios: list[Scenario], skipped: list[Skipped], endpoints: Endpoints | None) -> None:
    for s in skipped:
        what = f"{short_size(s.size)}, " if s.size else ""
        console.print(f"[yellow]skipped {what}{s.hosts} hosts, R={s.replicas}: {s.reason}[/]")
    if not scenarios:
        raise BenchSetupError("no scenario to run: " + "; ".join(s.reason for s in skipped))
    if endpoints is not None:
        console.print(
            f"[yellow]--endpoints {endpoints.path}: {len(endpoints.hosts)} stores, R={endpoints.replicas}; the restore after a "
            "host loss (SIGKILL and replace a store) is skipped: the stores are not processes of this bench[/]"
        )
    if endpoints is not None:
        console.print(f"[yellow]restore from durable storage and the saves with memory pre-faulted: {DURABLE_ENDPOINTS_NOTE}[/]")


@dataclass
class _Run:
    """What a run collects while it goes, and how it reports progress."""

    config: BenchConfig
    endpoints: Endpoints | None
    console: Console
    monitor: Monitor
    step_done: Callable[[str], None]
    describe: Callable[[str], None]
    command: str
    first: FirstSaveRuns
    sizes: dict[str, SizeResult] = field(default_factory=dict)
    measured: list[ScenarioMeasurement] = field(default_factory=list)
    failed: list[FailedScenario] = field(default_factory=list)


def _measure_size(run: _Run, size: int, todo: list[Scenario]) -> None:
    """The baselines of one state size, then each of its scenarios (one failing does not lose the others)."""
    from memstore.bench.floors import measure_floors
    from memstore.bench.scenario import measure_scenario
    from memstore.bench.state import make_state, nbytes_of, state_fingerprint, state_tensors
    from trainer_client import serialization

    config, label = run.config, short_size(size)
    run.monitor.phase = f"{label}: generate"
    run.describe(f"{label}: generating the state")
    t0 = time.perf_counter()
    state = make_state(size, config.seed)
    tensors = state_tensors(state)
    state_bytes = nbytes_of(tensors)
    shard_bytes = serialization.plan(state).nbytes
    gen_seconds = time.perf_counter() - t0
    fingerprint = state_fingerprint(state)
    run.step_done(f"{label}: baseline memcpy")
    reps = max(s.restores for s in todo)
    floors, cost = measure_floors(state, tensors, shard_bytes, state_bytes, config, reps, run.step_done, run.monitor, label)
    info = StateInfo(state_bytes, shard_bytes, len(tensors), "float32", STATE_LAYOUT, gen_seconds, fingerprint)
    run.sizes[str(size)] = SizeResult(state=info, floors=floors, diagnosis=cost)
    for scn in todo:
        try:
            m = measure_scenario(config, scn, state, fingerprint, shard_bytes, run.endpoints, run.step_done, run.monitor)
            run.measured.append(m)
        except Exception as exc:  # one scenario failing (a real outcome) must not lose the others
            run.failed.append(FailedScenario(name=scn.name, size=scn.size, hosts=scn.hosts, replicas=scn.replicas, error=repr(exc)))
            run.console.print(f"[bold red]scenario {scn.name} failed: {exc!r}[/]")
            continue
        if scn.headline:
            _headline_extras(run, scn, m, state, fingerprint, shard_bytes)
    del state, tensors
    gc.collect()


def _note(run: _Run, what: str, exc: BaseException) -> None:
    run.first.notes.append(f"{what} failed: {exc!r}")
    run.console.print(f"[bold red]{what} failed: {exc!r}[/]")


def _headline_extras(run: _Run, scn: Scenario, m: ScenarioMeasurement, state: object, fingerprint: str, shard_bytes: int) -> None:
    """On the headline's state, on stores of their own: the saves from the first with memory pre-faulted (when --prefault is
    not given), the path without shared memory, the restore from durable storage."""
    from memstore.bench.durable import measure_durable
    from memstore.bench.first_save_runs import measure_no_shm, measure_prefault_series

    config, endpoints = run.config, run.endpoints
    if config.prefault is None and endpoints is None:
        run.first.prefault_series = measure_prefault_series(config, scn, state, shard_bytes, run.command, run.step_done, run.monitor)
    elif endpoints is not None:
        run.first.notes.append("saves with memory pre-faulted: skipped with --endpoints (the stores are not this bench's)")
    else:
        run.first.notes.append(f"--prefault {config.prefault} given: the headline's own saves ran with it, no second series")
    try:
        run.first.no_shared_memory = measure_no_shm(
            config, scn, state, fingerprint, shard_bytes, endpoints, run.command, run.step_done, run.monitor
        )
    except Exception as exc:
        _note(run, "the saves and loads without shared memory", exc)
    m.restore_durable = measure_durable(
        config, scn.hosts, scn.replicas, state, fingerprint, shard_bytes, endpoints, run.command, scn.restores, run.step_done, run.monitor
    )
    if m.restore_durable.error:
        run.console.print(f"[bold red]restore from durable storage failed: {m.restore_durable.error}[/]")


def _fixed_costs(run: _Run, head: Scenario) -> None:
    """Small states and the per-tensor cost, on the headline's cluster shape (once per run; --small-saves 0 skips them)."""
    from memstore.bench.small_states import measure_per_tensor, measure_small_states

    config = run.config
    if not config.small_saves:
        run.first.notes.append("small states and per-tensor cost: skipped (--small-saves 0)")
        return
    try:
        run.first.small_states = measure_small_states(
            config, SMALL_SIZES, head.hosts, head.replicas, run.endpoints, run.command, run.step_done, run.monitor
        )
    except Exception as exc:
        _note(run, "the small states", exc)
    try:
        run.first.per_tensor = measure_per_tensor(config, head.hosts, head.replicas, run.endpoints, run.command, run.step_done, run.monitor)
    except Exception as exc:
        _note(run, "the per-tensor cost", exc)


def _leak_check(run: _Run, head: Scenario) -> Leak:
    from memstore.bench.leak import measure_leak

    try:
        return measure_leak(run.config, head.hosts, head.replicas, run.endpoints, run.step_done, run.monitor)
    except Exception as exc:
        leak = LeakSkipped(skipped=f"the leak check failed: {exc!r}", failed=True)
        run.console.print(f"[bold red]{leak.skipped}[/]")
        return leak


def run_bench(config: BenchConfig, command: str, console: Console | None = None) -> BenchResult:
    """Measure every planned scenario; BenchSetupError when none can run (or every one failed)."""
    from memstore.bench.cluster import load_endpoints
    from memstore.bench.first_save_runs import prefault_supported
    from memstore.bench.sysinfo import Monitor

    console = console or _console()
    started = time.time()
    endpoints = load_endpoints(config.endpoints) if config.endpoints else None
    scenarios, skipped = plan_scenarios(config, endpoints)
    _announce(console, scenarios, skipped, endpoints)
    head = next(s for s in scenarios if s.headline)
    total = sum(_scenario_steps(config, s) for s in scenarios) + FLOOR_STEPS * len({s.size for s in scenarios}) + config.leak_saves + 1
    total += _first_save_steps(config, head, endpoints)
    with Monitor() as monitor, _progress(console) as progress:
        task = progress.add_task("starting", total=total)
        run = _Run(
            config, endpoints, console, monitor,
            step_done=lambda what: progress.update(task, advance=1, description=what),
            describe=lambda what: progress.update(task, description=what),
            command=command, first=FirstSaveRuns(headline=head.name, prefault_supported=prefault_supported()),
        )  # fmt: skip
        for size in config.sizes:
            todo = [s for s in scenarios if s.size == size]
            if todo:
                _measure_size(run, size, todo)
        _fixed_costs(run, head)
        leak = _leak_check(run, head)
        run.step_done("done")
        conditions = monitor.report()
    if not run.measured:
        raise BenchSetupError("every scenario failed: " + "; ".join(f"{f.name}: {f.error}" for f in run.failed))
    if not any(m.headline for m in run.measured):
        run.measured[0].headline = True  # the planned headline failed: the first scenario that ran stands in
    return assemble(config, command, started, run.sizes, run.measured, skipped, leak, conditions, endpoints, run.failed, run.first)
