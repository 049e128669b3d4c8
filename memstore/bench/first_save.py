"""What a user sees from the first save (issue 16), evaluated: per save series its figures by phase (save 1, saves
2..keep+2, steady state) against the paired memcpy and raw TCP, and its targets; the small states' fixed cost per
save, the per-tensor cost, the path without shared memory. Pure: it only reads typed results."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from memstore.bench.first_save_results import FirstSaveRuns, NoShmRun, PerTensorRun, SaveSeries, SmallState, series_label
from memstore.bench.jsonable import FLATTEN, OMIT_NONE
from memstore.bench.results import Summary
from memstore.bench.scenario_results import SaveSample, ScenarioMeasurement
from memstore.bench.series import EARLY, FIRST, STEADY
from memstore.bench.target import (
    COMMITTED_TCP_MIN,
    FIRST_SAVE_MEMCPY_MAX,
    LATER_SAVES_MEMCPY_MAX,
    NO_SHM_TCP_MIN,
    Target,
)
from memstore.bench.units import ratio

US = 1e6


def _summary(values: list[float]) -> Summary | None:
    return Summary.of(values) if values else None


def _saves_text(samples: list[SaveSample]) -> str:
    """Which saves: series start at step 1, so a save's number is its step."""
    first, last = samples[0].step, samples[-1].step
    return str(first) if first == last else f"{first}..{last}"


@dataclass
class PhaseFigures:
    """One phase of a series: its saves' stall and call -> committed, against the paired memcpy and raw TCP."""

    saves: str  # which saves ("1", "2..4", "5..9")
    n: int
    stall_seconds: Summary
    paired_memcpy_seconds: Summary | None
    stall_over_memcpy_max: float | None
    stall_over_standalone_memcpy_max: float | None  # against the memcpy measured before the stores started (reference)
    committed_seconds: Summary | None  # saves that reached R copies
    committed_bytes_per_second_min: float | None
    committed_over_raw_tcp_min: float | None


def phase_figures(samples: list[SaveSample], tcp_bps: float | None, standalone: float | None = None) -> PhaseFigures | None:
    if not samples:
        return None
    ok = [s for s in samples if not s.error]
    stall_ratios = [s.stall_over_memcpy for s in samples if s.stall_over_memcpy is not None]
    paired = [s.paired_memcpy_seconds for s in samples if s.paired_memcpy_seconds]
    worst_rate = min(0.0 if s.error else (s.committed_bytes_per_second or 0.0) for s in samples)  # not committed: 0
    return PhaseFigures(
        saves=_saves_text(samples),
        n=len(samples),
        stall_seconds=Summary.of([s.save_wall_seconds for s in samples]),
        paired_memcpy_seconds=_summary(paired),
        stall_over_memcpy_max=max(stall_ratios, default=None),
        stall_over_standalone_memcpy_max=ratio(max(s.save_wall_seconds for s in samples), standalone),
        committed_seconds=_summary([s.committed_seconds for s in ok]),
        committed_bytes_per_second_min=worst_rate,
        committed_over_raw_tcp_min=ratio(worst_rate, tcp_bps),
    )


@dataclass
class SeriesTargets:
    first_save_stall_vs_memcpy: Target
    later_saves_stall_vs_memcpy: Target
    committed_vs_raw_tcp_every_save: Target

    def items(self) -> list[tuple[str, Target]]:
        return [(f.name, getattr(self, f.name)) for f in fields(self)]


@dataclass
class SeriesFigures:
    """A series' figures: by phase, the worst later save, the worst call -> committed, and its targets."""

    raw_tcp_bytes_per_second: float | None
    first: PhaseFigures | None
    early: PhaseFigures | None
    steady: PhaseFigures | None
    later_stall_over_memcpy_max: float | None  # saves 2..N
    committed_over_raw_tcp_min: float | None  # every save; a save that did not reach R copies counts as 0
    committed_over_raw_tcp: list[float | None]  # per save
    targets: SeriesTargets


def series_targets(first: PhaseFigures | None, later_max: float | None, committed_min: float | None, note: str = "") -> SeriesTargets:
    return SeriesTargets(
        first_save_stall_vs_memcpy=Target.check(
            f"save 1 (fresh job, fresh stores): stall <= {FIRST_SAVE_MEMCPY_MAX:.0f}x a memcpy of the same bytes into pre-faulted memory",
            first.stall_over_memcpy_max if first else None, lambda v: v <= FIRST_SAVE_MEMCPY_MAX, note,
        ),
        later_saves_stall_vs_memcpy=Target.check(
            f"every later save (2..N): stall <= {LATER_SAVES_MEMCPY_MAX}x its paired memcpy (worst save)", later_max,
            lambda v: v <= LATER_SAVES_MEMCPY_MAX, note,
        ),
        committed_vs_raw_tcp_every_save=Target.check(
            f"every save incl. the first: state bytes / (save() call -> committed) >= {COMMITTED_TCP_MIN}x raw TCP (worst save)",
            committed_min, lambda v: v >= COMMITTED_TCP_MIN, note,
        ),
    )  # fmt: skip


def series_figures(saves: list[SaveSample], tcp_bps: float | None, note: str = "", standalone: float | None = None) -> SeriesFigures:
    """``standalone``: the memcpy floor measured before any store started, for reference (the targets use the paired one)."""
    first = phase_figures([s for s in saves if s.phase == FIRST], tcp_bps, standalone)
    early = phase_figures([s for s in saves if s.phase == EARLY], tcp_bps, standalone)
    steady = phase_figures([s for s in saves if s.phase == STEADY], tcp_bps, standalone)
    later = [s.stall_over_memcpy for s in saves if s.phase != FIRST and s.stall_over_memcpy is not None]
    per_save = [None if s.error else ratio(s.committed_bytes_per_second, tcp_bps) for s in saves]
    worst = [0.0 if s.error else (v or 0.0) for s, v in zip(saves, per_save, strict=True)]
    committed_min = min(worst) if saves and tcp_bps else None
    later_max = max(later, default=None)
    return SeriesFigures(
        raw_tcp_bytes_per_second=tcp_bps,
        first=first,
        early=early,
        steady=steady,
        later_stall_over_memcpy_max=later_max,
        committed_over_raw_tcp_min=committed_min,
        committed_over_raw_tcp=per_save,
        targets=series_targets(first, later_max, committed_min, note),
    )


@dataclass
class SeriesResult:
    measured: SaveSeries = field(metadata=FLATTEN)
    figures: SeriesFigures


def scenario_series(scn: ScenarioMeasurement, command: str, state_bytes: int, shard_bytes: int, keep: int = 2) -> SaveSeries:
    """The scenario's own saves as a series (its stores were started for it, its job fresh)."""
    return SaveSeries(
        label=series_label(scn.prefault, shard_bytes, keep), prefault=scn.prefault, command=command, store_command=scn.store_command,
        job=scn.job, hosts=scn.hosts, replicas=scn.replicas, state_bytes=state_bytes, shard_bytes=shard_bytes,
        cluster_start_seconds=scn.cluster_start_seconds, stores_idle_wait_seconds=scn.stores_idle_wait_seconds, saves=scn.saves,
    )  # fmt: skip


# -- the fixed costs ----------------------------------------------------------------------------------------------


@dataclass
class SmallStateResult:
    measured: SmallState = field(metadata=FLATTEN)
    first_stall_seconds: float
    first_committed_seconds: float
    stall_seconds: Summary  # the saves after the first
    committed_seconds: Summary | None
    paired_memcpy_seconds: Summary | None
    stall_minus_memcpy_p50_seconds: float | None  # what a save costs beyond copying its bytes


def small_state_result(m: SmallState) -> SmallStateResult:
    first, rest = m.saves[0], m.saves[1:] or m.saves[:1]
    stall = Summary.of([s.save_wall_seconds for s in rest])
    paired = _summary([s.paired_memcpy_seconds for s in rest if s.paired_memcpy_seconds])
    return SmallStateResult(
        measured=m,
        first_stall_seconds=first.save_wall_seconds,
        first_committed_seconds=first.committed_seconds,
        stall_seconds=stall,
        committed_seconds=_summary([s.committed_seconds for s in rest if not s.error]),
        paired_memcpy_seconds=paired,
        stall_minus_memcpy_p50_seconds=stall.p50 - paired.p50 if paired else None,
    )


@dataclass
class PerTensorResult:
    measured: PerTensorRun = field(metadata=FLATTEN)
    many_save_stall_seconds: float  # p50 of the steady-state saves
    one_save_stall_seconds: float
    many_first_save_seconds: float
    one_first_save_seconds: float
    many_load_seconds: float  # p50
    one_load_seconds: float
    save_stall_us_per_tensor: float  # (many - one) / count
    load_us_per_tensor: float


def _steady_p50(saves: list[SaveSample]) -> float:
    steady = [s.save_wall_seconds for s in saves if s.phase == STEADY] or [s.save_wall_seconds for s in saves]
    return Summary.of(steady).p50


def per_tensor_result(m: PerTensorRun) -> PerTensorResult:
    many, one = _steady_p50(m.many.saves), _steady_p50(m.one.saves)
    return PerTensorResult(
        measured=m,
        many_save_stall_seconds=many,
        one_save_stall_seconds=one,
        many_first_save_seconds=m.many.saves[0].save_wall_seconds,
        one_first_save_seconds=m.one.saves[0].save_wall_seconds,
        many_load_seconds=m.many.load_seconds.p50,
        one_load_seconds=m.one.load_seconds.p50,
        save_stall_us_per_tensor=(many - one) / m.count * US,
        load_us_per_tensor=(m.many.load_seconds.p50 - m.one.load_seconds.p50) / m.count * US,
    )


@dataclass
class NoShmResult:
    measured: NoShmRun = field(metadata=FLATTEN)
    raw_tcp_bytes_per_second: float | None
    first_stall_seconds: float
    first_committed_seconds: float
    stall_seconds: Summary  # every save, the first included
    committed_seconds: Summary | None
    stall_over_raw_tcp: float | None  # state bytes / stall p50, over raw TCP
    first_stall_over_raw_tcp: float | None
    committed_over_raw_tcp: float | None  # state bytes / (call -> committed) p50, over raw TCP
    load_over_raw_tcp: float | None  # state bytes / load p50, over raw TCP


def no_shm_result(m: NoShmRun, tcp_bps: float | None) -> NoShmResult:
    stall = Summary.of([s.save_wall_seconds for s in m.saves])
    committed = _summary([s.committed_seconds for s in m.saves if not s.error])
    nb = m.state_bytes
    return NoShmResult(
        measured=m,
        raw_tcp_bytes_per_second=tcp_bps,
        first_stall_seconds=m.saves[0].save_wall_seconds,
        first_committed_seconds=m.saves[0].committed_seconds,
        stall_seconds=stall,
        committed_seconds=committed,
        stall_over_raw_tcp=ratio(nb / stall.p50, tcp_bps),
        first_stall_over_raw_tcp=ratio(nb / m.saves[0].save_wall_seconds, tcp_bps),
        committed_over_raw_tcp=ratio(nb / committed.p50, tcp_bps) if committed else None,
        load_over_raw_tcp=ratio(nb / m.load_seconds.p50, tcp_bps),
    )


def no_shm_targets(r: NoShmResult | None, note: str) -> tuple[Target, Target, Target]:
    what = "without shared memory (use_shared_memory=False, bytes over gRPC)"
    if r is None:
        return (
            Target.na(f"{what}: save stall p50 >= {NO_SHM_TCP_MIN}x raw TCP", note),
            Target.na(f"{what}: save() call -> committed p50 >= {NO_SHM_TCP_MIN}x raw TCP", note),
            Target.na(f"{what}: load() p50 >= {NO_SHM_TCP_MIN}x raw TCP", note),
        )
    return (
        Target.check(f"{what}: state bytes / save stall p50 >= {NO_SHM_TCP_MIN}x raw TCP", r.stall_over_raw_tcp,
                     lambda v: v >= NO_SHM_TCP_MIN),
        Target.check(f"{what}: state bytes / (save() call -> committed) p50 >= {NO_SHM_TCP_MIN}x raw TCP", r.committed_over_raw_tcp,
                     lambda v: v >= NO_SHM_TCP_MIN),
        Target.check(f"{what}: state bytes / (connect + load()) p50 >= {NO_SHM_TCP_MIN}x raw TCP", r.load_over_raw_tcp,
                     lambda v: v >= NO_SHM_TCP_MIN),
    )  # fmt: skip


# -- the whole section --------------------------------------------------------------------------------------------


@dataclass
class FirstSaveResult:
    """From the first save (issue 16), for the headline scenario: ``series[0]`` is its own saves (the store's defaults,
    or --prefault), ``series[1]`` the same on fresh stores with (keep+2)x the state pre-faulted (when --prefault is not given)."""

    headline: str
    prefault_supported: bool
    series: list[SeriesResult]
    small_states: list[SmallStateResult]
    per_tensor: PerTensorResult | None = field(metadata=OMIT_NONE)
    no_shared_memory: NoShmResult | None = field(metadata=OMIT_NONE)
    notes: list[str]


def evaluate_first_save(
    runs: FirstSaveRuns, head: ScenarioMeasurement, command: str, state_bytes: int, shard_bytes: int, tcp_bps: float | None,
    memcpy_standalone: float | None = None, keep: int = 2,
) -> FirstSaveResult:  # fmt: skip
    own = scenario_series(head, command, state_bytes, shard_bytes, keep)
    series = [SeriesResult(own, series_figures(own.saves, tcp_bps, standalone=memcpy_standalone))]
    if runs.prefault_series is not None:
        p = runs.prefault_series
        note = p.error or ("" if runs.prefault_supported else "the stores do not know --prefault: MEMSTORE_PREFAULT was ignored")
        series.append(SeriesResult(p, series_figures(p.saves, tcp_bps, note, memcpy_standalone)))
    return FirstSaveResult(
        headline=runs.headline,
        prefault_supported=runs.prefault_supported,
        series=series,
        small_states=[small_state_result(m) for m in runs.small_states if m.saves],
        per_tensor=per_tensor_result(runs.per_tensor) if runs.per_tensor else None,
        no_shared_memory=no_shm_result(runs.no_shared_memory, tcp_bps) if runs.no_shared_memory else None,
        notes=runs.notes,
    )
