"""What a user sees from the first save (issue 16), as the bench evaluates it: the save series by phase against the paired
memcpy and raw TCP, the fixed costs, the path without shared memory, the durable restore, the store's pool, the
--prefault option, and the table and figures that show them. Pure: no processes, no torch."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from memstore.bench.first_save import (
    evaluate_first_save,
    no_shm_result,
    per_tensor_result,
    series_figures,
    small_state_result,
)
from memstore.bench.first_save_results import (
    FirstSaveRuns,
    NoShmRun,
    PerTensorRun,
    SaveSeries,
    SmallState,
    TensorState,
    prefault_for,
    series_label,
)
from memstore.bench.jsonable import json_default, to_json
from memstore.bench.results import CpuReport, RunConditions
from memstore.bench.run_result import assemble
from memstore.bench.scenario_results import DurableRestore, HeldBytes, LeakSkipped, SaveSample
from memstore.bench.series import EARLY, FIRST, STEADY, phase_of
from memstore.bench.targets import evaluate
from memstore.bench.units import GiB, MiB
from tests.unit.test_bench_results import NB, config, leak, measurement, restores, s, size_result

pytestmark = pytest.mark.unit

TCP = 2 * GiB  # size_result()'s raw TCP
COMMITTED = 0.5  # every save of series() is committed 0.5 s after its call
TCP_08 = NB / COMMITTED / 0.8  # a raw TCP those saves reach 0.8x of


def sample(step: int, phase: str, stall: float, committed: float, paired: float | None = 0.1, error: str = "") -> SaveSample:
    return SaveSample(
        step, phase, stall, stall, committed, 0 if error else 2, committed - stall, NB / max(committed - stall, 1e-9), paired, error,
        stall / paired if paired else None, NB / committed,
    )  # fmt: skip


def series(stalls: list[float], keep: int = 2) -> list[SaveSample]:
    """Saves 1..N with the given stalls, each committed COMMITTED s after its call (0.8x of TCP_08)."""
    return [sample(i + 1, phase_of(i, keep), v, COMMITTED) for i, v in enumerate(stalls)]


def cpu() -> CpuReport:
    return CpuReport(1.0, None, None, None, None, None, 0.5, 0.1, 0.05, None)


# -- the series --------------------------------------------------------------------------------------------------


def test_phases_of_a_series() -> None:
    assert [phase_of(i, keep=2) for i in range(7)] == [FIRST, EARLY, EARLY, EARLY, STEADY, STEADY, STEADY]
    assert [phase_of(i, keep=1) for i in range(4)] == [FIRST, EARLY, EARLY, STEADY]


def test_series_figures_by_phase_and_the_worst_save() -> None:
    f = series([0.25, 0.14, 0.12, 0.1, 0.11, 0.12])
    assert f and f[0].stall_over_memcpy == pytest.approx(2.5)
    fig = series_figures(f, TCP_08)
    assert fig.first and fig.early and fig.steady
    assert (fig.first.saves, fig.early.saves, fig.steady.saves) == ("1", "2..4", "5..6")
    assert fig.first.stall_over_memcpy_max == pytest.approx(2.5)
    assert fig.later_stall_over_memcpy_max == pytest.approx(1.4)  # save 2
    assert fig.steady.stall_seconds.p50 == pytest.approx(0.115)  # saves 5 and 6
    assert fig.committed_over_raw_tcp_min == pytest.approx(0.8, rel=1e-3)
    t = fig.targets
    assert (t.first_save_stall_vs_memcpy.passed, t.later_saves_stall_vs_memcpy.passed, t.committed_vs_raw_tcp_every_save.passed) == (
        True,
        True,
        True,
    )

    assert fig.first.stall_over_standalone_memcpy_max is None  # no standalone memcpy given
    with_floor = series_figures(f, TCP_08, standalone=0.05)  # the memcpy measured before the stores started, for reference
    assert with_floor.first and with_floor.first.stall_over_standalone_memcpy_max == pytest.approx(5.0)
    assert with_floor.targets == fig.targets  # the targets use the paired memcpy

    slow_first = series_figures(series([0.31, 0.1, 0.1, 0.1, 0.16]), TCP_08)
    assert slow_first.targets.first_save_stall_vs_memcpy.passed is False
    assert slow_first.targets.later_saves_stall_vs_memcpy.passed is False  # save 5: 1.6x
    assert [k for k, _ in slow_first.targets.items()] == [
        "first_save_stall_vs_memcpy",
        "later_saves_stall_vs_memcpy",
        "committed_vs_raw_tcp_every_save",
    ]


def test_a_save_that_did_not_commit_counts_as_zero_throughput() -> None:
    saves = series([0.2, 0.1, 0.1, 0.1])
    saves[2] = sample(3, EARLY, 0.1, 5.0, error="step 3 did not reach R copies")
    fig = series_figures(saves, TCP_08)
    assert fig.committed_over_raw_tcp_min == 0.0 and fig.committed_over_raw_tcp[2] is None
    assert fig.early and fig.early.committed_seconds and fig.early.committed_seconds.n == 2  # left out of the times
    assert fig.targets.committed_vs_raw_tcp_every_save.passed is False


def test_a_series_without_saves_or_raw_tcp_is_not_evaluated() -> None:
    fig = series_figures([], TCP, note="the stores rejected the setting")
    assert fig.first is None and fig.committed_over_raw_tcp_min is None
    assert all(t.passed is None and t.note == "the stores rejected the setting" for _, t in fig.targets.items())
    assert series_figures(series([0.2, 0.1]), None).committed_over_raw_tcp_min is None


def test_prefault_for_is_twice_the_shard_in_whole_mib() -> None:
    assert prefault_for(GiB + 4096, 2) == "4100MiB" and prefault_for(64 * MiB, 2) == "256MiB" and prefault_for(GiB, 1) == "3GiB"
    assert series_label(None, GiB, 2) == "store defaults"
    assert series_label("4GiB", GiB, 2) == "--prefault 4GiB (4x state)" and series_label("8GiB", GiB, 2) == "--prefault 8GiB"


# -- the fixed costs and the path without shared memory --------------------------------------------------------------


def small(size: int = MiB, stall: float = 0.0008) -> SmallState:
    saves = [sample(1, FIRST, 0.005, 0.01, paired=0.0002)] + [sample(i, STEADY, stall, 0.003, paired=0.0002) for i in range(2, 32)]
    return SmallState(size, 16, size, size + 4096, "cmd", "store cmd", "bench-small", 0.5, saves, cpu())


def tensor_state(layout: str, tensors: int, stall: float, load: float) -> TensorState:
    saves = [sample(1, FIRST, stall * 2, stall * 3)] + [sample(i, STEADY, stall, stall * 2) for i in range(2, 8)]
    return TensorState(layout, tensors, 40 * MiB, 41 * MiB, "bench-tensors-x", saves, s(load), True)


def per_tensor(many_stall: float = 0.05, one_stall: float = 0.02, many_load: float = 0.04, one_load: float = 0.01) -> PerTensorRun:
    many = tensor_state("10000 x float32[1024]", 10_000, many_stall, many_load)
    one = tensor_state("1 x float32[10240000]", 1, one_stall, one_load)
    return PerTensorRun(10_000, 4096, "cmd", "store cmd", many, one)


def no_shm(stall: float = 0.05, committed: float = 0.08, load: float = 0.06) -> NoShmRun:
    saves = [sample(1, FIRST, stall * 2, committed * 2, paired=None)] + [sample(i, EARLY, stall, committed, paired=None) for i in (2, 3, 4)]
    return NoShmRun("cmd", "store cmd", "bench-noshm", False, NB, NB + 4096, saves, s(load), True)


def test_small_state_per_tensor_and_no_shm_figures() -> None:
    r = small_state_result(small())
    assert r.first_stall_seconds == 0.005 and r.stall_seconds.n == 30 and r.stall_seconds.p50 == pytest.approx(0.0008)
    assert r.stall_minus_memcpy_p50_seconds == pytest.approx(0.0006)
    pt = per_tensor_result(per_tensor())
    assert pt.save_stall_us_per_tensor == pytest.approx(3.0) and pt.load_us_per_tensor == pytest.approx(3.0)
    assert pt.many_first_save_seconds == pytest.approx(0.1)
    ns = no_shm_result(no_shm(), TCP)
    assert ns.stall_seconds.n == 4 and ns.first_stall_seconds == pytest.approx(0.1)
    assert ns.stall_over_raw_tcp == pytest.approx((NB / 0.05) / TCP) and ns.load_over_raw_tcp == pytest.approx((NB / 0.06) / TCP)


def first_runs(**kw: object) -> FirstSaveRuns:
    pre = SaveSeries("--prefault 130MiB (2x state)", "130MiB", "cmd", "store cmd", "bench-prefault", 2, 2, NB, NB + 4096, 0.5, 0.6,
                     series([0.2, 0.1, 0.1, 0.1, 0.1]))  # fmt: skip
    values: dict[str, object] = dict(
        headline="64MiB-2h-R2", prefault_supported=True, prefault_series=pre, small_states=[small(), small(16 * MiB, 0.01)],
        per_tensor=per_tensor(), no_shared_memory=no_shm(stall=NB / TCP / 0.8, committed=NB / TCP / 0.5, load=NB / TCP / 0.9),
    )  # fmt: skip
    values.update(kw)
    return FirstSaveRuns(**values)  # type: ignore[arg-type]


def test_headline_targets_use_the_runs_figures() -> None:
    head = measurement()
    first = evaluate_first_save(first_runs(), head, "memstore bench --quick", NB, NB + 4096, TCP)
    assert [x.measured.label for x in first.series] == ["store defaults", "--prefault 130MiB (2x state)"]
    assert first.series[0].measured.saves is head.saves and first.series[0].measured.store_command == head.store_command
    _, tg = evaluate(head, size_result(), leak(), first)
    assert tg.small_state_stall.passed is True and tg.small_state_stall.value == pytest.approx(0.0008)
    assert tg.per_tensor_save_stall.passed is True and tg.per_tensor_load.passed is True  # exactly 3 us
    assert tg.no_shm_save_vs_raw_tcp.passed is True  # 0.8x
    assert tg.no_shm_committed_vs_raw_tcp.passed is False  # 0.5x
    assert tg.no_shm_load_vs_raw_tcp.passed is True  # 0.9x

    bare = evaluate_first_save(
        first_runs(per_tensor=None, small_states=[], no_shared_memory=None, notes=["small states: skipped"]), head, "c", NB, NB, TCP
    )
    _, tg2 = evaluate(head, size_result(), leak(), bare)
    assert tg2.small_state_stall.passed is None and tg2.small_state_stall.note == "not measured (--small-saves 0)"
    assert tg2.no_shm_load_vs_raw_tcp.passed is None and tg2.no_shm_load_vs_raw_tcp.note == "small states: skipped"


def test_failed_prefault_series_is_reported_not_evaluated() -> None:
    failed = SaveSeries("--prefault 130MiB (2x state)", "130MiB", "cmd", "", "bench-prefault", 2, 2, NB, NB, 0.0, 0.0, [],
                        error="RuntimeError('store h0 exited with 2')")  # fmt: skip
    first = evaluate_first_save(first_runs(prefault_series=failed), measurement(), "c", NB, NB, TCP)
    data = to_json(first.series[1])
    assert data["error"] == "RuntimeError('store h0 exited with 2')" and data["saves"] == []
    assert data["figures"]["targets"]["first_save_stall_vs_memcpy"]["pass"] is None
    unknown = evaluate_first_save(first_runs(prefault_supported=False), measurement(), "c", NB, NB, TCP)
    assert "ignored" in unknown.series[1].figures.targets.first_save_stall_vs_memcpy.note


# -- the durable restore and the store's pool -----------------------------------------------------------------------


def test_durable_restore_ratios_and_json() -> None:
    m = measurement()
    assert to_json(m.restore_durable) == {"available": False, "note": "measured once per run, for the headline scenario"}
    m.restore_durable = DurableRestore(
        available=True, note="spilled", command="cmd", store_command="memstore serve --spill file:///x", spill_url="file:///x",
        save=sample(1, FIRST, 0.2, 0.4), spilled_seconds=1.5, deleted_copies=[2], restore=restores(0.25),
    )  # fmt: skip
    ra, _ = evaluate(m, size_result(load_warm=0.5), leak())
    assert ra.torch_load_warm_over_restore_durable == pytest.approx(2.0)
    assert ra.restore_durable_over_raw_tcp == pytest.approx((NB / 0.25) / TCP)
    data = to_json(m.restore_durable)
    assert data["spill_url"] == "file:///x" and data["restore"]["seconds"]["p50"] == 0.25 and "error" not in data


def test_held_bytes_reports_the_stores_pool_when_it_has_one() -> None:
    assert "pooled_bytes" not in to_json(HeldBytes(1, 10, 20, 10, 100))
    data = to_json(HeldBytes(1, 10, 20, 10, 100, pooled_bytes=10, reserve_bytes=4))
    assert (data["pooled_bytes"], data["reserve_bytes"]) == (10, 4)


def test_rpc_field_reads_only_fields_the_protocol_has() -> None:
    from memstore.bench.rpc import _field
    from memstore.v1 import store_pb2 as pb

    msg = pb.HealthResponse(used_bytes=5)
    assert _field(msg, "used_bytes") == 5 and _field(msg, "no_such_field") is None


# -- the --prefault option ------------------------------------------------------------------------------------------


def test_prefault_option_and_the_store_environment() -> None:
    from memstore.bench.cluster import store_env

    assert config([]).prefault is None and store_env(config([])) == {}
    c = config(["--prefault", "2GiB", "--store-env", "A=1"])
    assert c.prefault == "2GiB" and store_env(c) == {"A": "1", "MEMSTORE_PREFAULT": "2GiB"}
    assert store_env(c, "130MiB")["MEMSTORE_PREFAULT"] == "130MiB"  # the pre-faulted series overrides it
    assert config(["--prefault", "AUTO"]).prefault == "auto"
    assert config(["--store-env", "MEMSTORE_PREFAULT=1GiB"]).prefault == "1GiB"  # given through the environment: no second series
    assert to_json(c)["prefault"] == "2GiB" and config(["--small-saves", "0"]).small_saves == 0


# -- the whole result: JSON, table, figures -------------------------------------------------------------------------


def bench_result(first: FirstSaveRuns | None) -> object:
    cond = RunConditions(1, "x", 1, None, None, None, None, None, 1.0, None, None, None)
    info = size_result()
    return assemble(config(["--quick"]), "memstore bench --quick", 0.0, {str(NB): info}, [measurement()], [], LeakSkipped("--leak-saves 0"),
                    cond, None, [], first)  # fmt: skip


def test_result_json_render_and_plot(tmp_path: Path) -> None:
    from rich.console import Console

    from memstore.bench.render import render

    result = bench_result(first_runs())
    data = json.loads(json.dumps(to_json(result), default=json_default))
    first = data["from_first_save"]
    assert [x["label"] for x in first["series"]] == ["store defaults", "--prefault 130MiB (2x state)"]
    assert first["series"][0]["figures"]["first"]["saves"] == "1" and first["series"][0]["command"] == "memstore bench --quick"
    assert {"small_states", "per_tensor", "no_shared_memory", "notes", "prefault_supported"} <= set(first)
    assert data["targets"]["small_state_stall"]["pass"] is True
    assert data["scenarios"][0]["ratios"]["first_save_stall_over_memcpy"] == pytest.approx(2.5)

    out = io.StringIO()
    render(result, Console(file=out, width=160))  # type: ignore[arg-type]
    text = out.getvalue()
    for needle in ("from the first save", "save 1: stall", "saves 2..4", "--prefault 130MiB", "per tensor", "no shared memory",
                   "restore from durable storage", "store RSS / (shard bytes held + pool)", "PASS", "MISS"):  # fmt: skip
        assert needle in text, needle

    pytest.importorskip("matplotlib")
    from memstore.bench.plot import write_plot

    write_plot(result, str(tmp_path / "b.png"))  # type: ignore[arg-type]
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    without = bench_result(None)
    assert "from_first_save" not in to_json(without)
    write_plot(without, str(tmp_path / "c.png"))  # type: ignore[arg-type]
    render(without, Console(file=io.StringIO(), width=160))  # type: ignore[arg-type]
