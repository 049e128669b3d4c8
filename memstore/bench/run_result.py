"""The result of a whole run: every scenario with its ratios and targets, the baselines per state size, the leak
check and the conditions; :func:`assemble` puts it together. Field names are the JSON keys."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from memstore.bench.first_save import FirstSaveResult, evaluate_first_save
from memstore.bench.first_save_results import FirstSaveRuns
from memstore.bench.jsonable import FLATTEN, OMIT_NONE
from memstore.bench.method import method
from memstore.bench.options import BenchConfig
from memstore.bench.results import CostModel, Floors, MachineInfo, RunConditions, SizeResult, StateInfo
from memstore.bench.scenario_results import (
    DurableRestore,
    Endpoints,
    FailedScenario,
    Leak,
    LeakSkipped,
    ScenarioMeasurement,
    Skipped,
)
from memstore.bench.targets import Ratios, Targets, evaluate


@dataclass
class ScenarioResult:
    """One scenario's measurement, with its ratios and targets."""

    measured: ScenarioMeasurement = field(metadata=FLATTEN)
    ratios: Ratios
    targets: Targets
    targets_passed: int
    targets_missed: int

    @classmethod
    def evaluated(cls, scn: ScenarioMeasurement, info: SizeResult, leak: Leak, first: FirstSaveResult | None = None) -> ScenarioResult:
        ratios, targets = evaluate(scn, info, leak, first)
        return cls(measured=scn, ratios=ratios, targets=targets, targets_passed=targets.passed, targets_missed=targets.missed)

    def verified(self) -> list[bool]:
        """Whether each restore of this scenario gave back the saved state."""
        m = self.measured
        durable = m.restore_durable.restore
        restores = (m.restore_local, m.restore_local_copy, m.restore_peer_deleted, m.restore_peer, durable)
        return [r.verified_equal for r in restores if r]


@dataclass
class BenchResult:
    ok: bool
    command: str
    started_unix: float
    duration_seconds: float
    config: BenchConfig
    machine: MachineInfo
    conditions: RunConditions
    endpoints: Endpoints | None
    headline: str
    scenarios: list[ScenarioResult]
    skipped: list[Skipped]
    failed: list[FailedScenario]
    sizes: dict[str, SizeResult]
    leak_check: Leak
    restore_durable: DurableRestore  # the headline's
    from_first_save: FirstSaveResult | None = field(metadata=OMIT_NONE)  # issue 16, for the headline scenario
    # The headline scenario at the top level, as issue 2's JSON had it.
    state: StateInfo
    floors: Floors
    diagnosis: CostModel
    cluster: ScenarioResult
    ratios: Ratios
    targets: Targets
    method: dict[str, str]
    bench_argv: list[str] | None = None

    def size_of(self, scn: ScenarioResult) -> SizeResult:
        return self.sizes[str(scn.measured.size)]


def assemble(
    config: BenchConfig,
    command: str,
    started: float,
    sizes: dict[str, SizeResult],
    measured: list[ScenarioMeasurement],
    skipped: list[Skipped],
    leak: Leak,
    conditions: RunConditions,
    endpoints: Endpoints | None,
    failed: list[FailedScenario],
    first_runs: FirstSaveRuns | None = None,
) -> BenchResult:
    from memstore.bench.sysinfo import machine_info

    verified = [not failed, not (isinstance(leak, LeakSkipped) and leak.failed)]
    head_scn = next(m for m in measured if m.headline)
    head_info = sizes[str(head_scn.size)]
    first = None
    if first_runs is not None:
        fl = head_info.floors
        first = evaluate_first_save(
            first_runs, head_scn, command, head_info.state.bytes, head_info.state.shard_bytes, fl.tcp.bytes_per_second.p50,
            fl.memcpy.torch_copy_seconds.p50, keep=config.keep,
        )  # fmt: skip
        verified += _first_verified(first)
    results: list[ScenarioResult] = []
    for scn in measured:
        info = sizes[str(scn.size)]
        results.append(ScenarioResult.evaluated(scn, info, leak, first if scn.headline else None))
        verified += results[-1].verified()
        verified.append(info.floors.disk.load_verified)
    head = next(s for s in results if s.measured.headline)
    head_size = sizes[str(head.measured.size)]
    duration = time.time() - started
    return BenchResult(
        ok=all(verified),
        command=command,
        started_unix=started,
        duration_seconds=duration,
        config=config,
        machine=machine_info(),
        conditions=conditions,
        endpoints=endpoints,
        headline=head.measured.name,
        scenarios=results,
        skipped=skipped,
        failed=failed,
        sizes=sizes,
        leak_check=leak,
        restore_durable=head.measured.restore_durable,
        from_first_save=first,
        state=head_size.state,
        floors=head_size.floors,
        diagnosis=head_size.diagnosis,
        cluster=head,
        ratios=head.ratios,
        targets=head.targets,
        method=method(config.warmup, config.keep),
    )


def _first_verified(first: FirstSaveResult) -> list[bool]:
    """Whether each load of the figures measured once per run gave back the saved state."""
    out = [first.no_shared_memory.measured.verified_equal] if first.no_shared_memory else []
    if first.per_tensor:
        out += [first.per_tensor.measured.many.verified_equal, first.per_tensor.measured.one.verified_equal]
    return out
