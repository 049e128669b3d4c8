"""The result of a whole run: every scenario with its ratios and targets, the baselines per state size, the leak
check and the conditions; :func:`assemble` puts it together. Field names are the JSON keys."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from memstore.bench.jsonable import FLATTEN
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
    def evaluated(cls, scn: ScenarioMeasurement, info: SizeResult, leak: Leak) -> ScenarioResult:
        ratios, targets = evaluate(scn, info, leak)
        return cls(measured=scn, ratios=ratios, targets=targets, targets_passed=targets.passed, targets_missed=targets.missed)

    def verified(self) -> list[bool]:
        """Whether each restore of this scenario gave back the saved state."""
        m = self.measured
        return [r.verified_equal for r in (m.restore_local, m.restore_local_copy, m.restore_peer_deleted, m.restore_peer) if r]


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
    restore_durable: DurableRestore
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
) -> BenchResult:
    from memstore.bench.sysinfo import machine_info

    verified = [not failed, not (isinstance(leak, LeakSkipped) and leak.failed)]
    results: list[ScenarioResult] = []
    for scn in measured:
        info = sizes[str(scn.size)]
        results.append(ScenarioResult.evaluated(scn, info, leak))
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
        restore_durable=DurableRestore(),
        state=head_size.state,
        floors=head_size.floors,
        diagnosis=head_size.diagnosis,
        cluster=head,
        ratios=head.ratios,
        targets=head.targets,
        method=method(config.warmup, config.keep),
    )
