"""Unit tests for memstore.sim: the seeded scale simulator behind ``memstore simulate``."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace

import pytest

from memstore.sim import (
    FAILURE_DATA,
    Cadence,
    FailureEvent,
    SimConfig,
    failure_trace,
    failures_per_gpu_hour_from_job,
    ram_recovery_probability,
    run_point,
    simulate,
    trial_rng,
)
from memstore.sim.cli import main

pytestmark = pytest.mark.unit


def per_day(failures_per_day: float, hosts: int, gpus_per_host: int = 8) -> float:
    """Per-GPU hourly rate giving ``failures_per_day`` job failures at ``hosts`` hosts."""
    return failures_per_gpu_hour_from_job(failures_per_day=failures_per_day, gpus=hosts * gpus_per_host)


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------


def test_same_seed_same_result_other_seed_differs() -> None:
    cfg = SimConfig(hosts=256, trials=3, failures_per_gpu_hour=per_day(10, 256), seed=7)
    a, b = run_point(cfg), run_point(cfg)
    assert a.to_dict() == b.to_dict()
    c = run_point(replace(cfg, seed=8))
    assert c.strategies["memstore"].ettr_mean != a.strategies["memstore"].ettr_mean
    # The trace of one host count doesn't depend on which other host counts are simulated.
    assert failure_trace(cfg, trial_rng(7, 256, 0)) == failure_trace(cfg, trial_rng(7, 256, 0))


def test_zero_failures_ettr_is_one_minus_stall_overhead() -> None:
    cfg = SimConfig(hosts=64, failures_per_gpu_hour=0.0, iteration_seconds=9.9, memstore_stall_seconds=0.1, days=7)
    point = run_point(cfg)
    mem, base = point.strategies["memstore"], point.strategies["baseline"]
    assert mem.failure_events == 0
    assert mem.ettr_mean == pytest.approx(1.0 - mem.stall_overhead, abs=1e-12)
    assert mem.ettr_mean == pytest.approx(1.0 - 0.1 / 10.0, abs=1e-9)  # 7 days is a whole number of 10 s periods
    # Without failures Young/Daly never checkpoints: no stall at all.
    assert base.ettr_mean == pytest.approx(1.0, abs=1e-12)
    assert base.stall_overhead == 0.0


def test_ettr_decreases_as_failure_rate_rises() -> None:
    ettrs: dict[str, list[float]] = {"memstore": [], "baseline": []}
    for fpd in (1, 4, 16, 64):
        point = run_point(SimConfig(hosts=512, trials=4, days=3, failures_per_gpu_hour=per_day(fpd, 512)))
        for name in ettrs:
            ettrs[name].append(point.strategies[name].ettr_mean)
    for name, values in ettrs.items():
        assert all(a > b for a, b in itertools.pairwise(values)), (name, values)


def test_memstore_beats_baseline_at_scale() -> None:
    for hosts in (1000, 4096):
        point = run_point(SimConfig(hosts=hosts, trials=3))
        mem, base = point.strategies["memstore"], point.strategies["baseline"]
        assert mem.ettr_mean > base.ettr_mean + 0.2
        assert mem.ettr_min > base.ettr_max
        assert mem.wasted_gpu_hours["total"] < 0.2 * base.wasted_gpu_hours["total"]
        assert mem.seconds_lost_per_failure < base.seconds_lost_per_failure


def test_target_1000_hosts_8_failures_per_day() -> None:
    """The documented target: memstore ETTR >= 95% at 1,000 hosts with 8 failures per day (defaults otherwise)."""
    point = run_point(SimConfig(hosts=1000, trials=10, failures_per_gpu_hour=per_day(8, 1000)))
    assert point.strategies["memstore"].ettr_mean >= 0.95
    assert point.strategies["memstore"].failures_per_run == pytest.approx(8 * 7, rel=0.15)


def test_fallback_frequency_matches_recovery_probability() -> None:
    # Every failure takes out 2 random hosts of 16 (m=2 mixed groups): RAM recovery works with probability
    # 14/15 (GEMINI's 93.3%). Failures are far apart compared to the recovery window, so they don't compound.
    cfg = SimConfig(
        hosts=16,
        replicas=2,
        days=40,
        failures_per_gpu_hour=per_day(100, 16),
        correlated_fraction=1.0,
        burst_hosts=2,
        restart_seconds=1.0,
        iteration_seconds=1.0,
        checkpoint_gb=1.0,
    )
    p_ok = ram_recovery_probability(cfg, 2)
    assert p_ok == pytest.approx(14 / 15)
    point = run_point(cfg)
    mem = point.strategies["memstore"]
    n = mem.failure_events
    assert n > 3500
    assert mem.failures_during_recovery <= 0.01 * n  # a few still land in a previous failure's window
    p_fail = 1 - p_ok
    sigma = math.sqrt(n * p_fail * (1 - p_fail))
    assert abs(mem.durable_fallbacks - n * p_fail) < 4 * sigma
    assert mem.expected_durable_fallbacks == pytest.approx(n * p_fail, rel=0.03)
    assert mem.ram_recoveries + mem.durable_fallbacks == n


def test_failures_inside_the_recovery_window_add_up() -> None:
    cfg = SimConfig(hosts=16, replicas=2, failures_per_gpu_hour=0.0, days=1)
    # Second single-host failure 0.5 s after the first: k=2 in one window -> P(ok | first ok) = (14/15) / 1.
    compound = [FailureEvent(100.0, 1, 0.5), FailureEvent(100.5, 1, 0.95)]
    stats = simulate(cfg, compound, "memstore")
    assert (stats.ram_recoveries, stats.durable_fallbacks, stats.failures_during_recovery) == (1, 1, 1)
    assert stats.expected_durable_fallbacks == pytest.approx(1 / 15)
    # The same draws an hour apart are two independent k=1 failures: both recover from RAM.
    apart = [FailureEvent(100.0, 1, 0.5), FailureEvent(3700.0, 1, 0.95)]
    stats = simulate(cfg, apart, "memstore")
    assert (stats.ram_recoveries, stats.durable_fallbacks) == (2, 0)
    # One replica: every failure loses its owner's only copy.
    single = simulate(replace(cfg, replicas=1), apart, "memstore")
    assert (single.ram_recoveries, single.durable_fallbacks) == (0, 2)


def test_single_failure_closed_form() -> None:
    cfg = SimConfig(hosts=1000, failures_per_gpu_hour=0.0, days=1, checkpoint_gb=1200, spill_every_minutes=30)
    cad = cfg.memstore_cadence
    assert (cad.compute, cad.stall, cad.lag) == (10.0, 0.1, pytest.approx(0.024))
    t = 1000.05  # 99 periods of 10.1 s = 999.9 s, then 0.15 s into the 100th iteration
    stats = simulate(cfg, [FailureEvent(t, 1, 0.0)], "memstore")
    assert stats.ram_recoveries == 1
    assert stats.lost_seconds == pytest.approx(0.15)
    resume = t + cfg.restart_seconds + cfg.ram_load_seconds
    assert stats.recovery_seconds == pytest.approx(resume - t)
    assert stats.useful_seconds == pytest.approx(990.0 + Cadence(10.0, 0.1, 0.024).split(cfg.duration_seconds - resume)[0])
    # Baseline: without failures in the rate Young/Daly never checkpoints, so the failure rolls back to the start.
    base = simulate(cfg, [FailureEvent(t, 1, 0.0)], "baseline")
    assert base.stall_seconds == 0.0
    assert base.lost_seconds == pytest.approx(t)
    assert base.recovery_seconds == pytest.approx(cfg.restart_seconds + cfg.storage_transfer_seconds)


def test_durable_fallback_rolls_back_to_the_newest_spill() -> None:
    cfg = SimConfig(hosts=16, replicas=1, failures_per_gpu_hour=0.0, days=1, spill_every_minutes=30, checkpoint_gb=120)
    w = cfg.storage_transfer_seconds  # 48 s
    t = 3 * 1800 + w + 100  # the third spill (started at 5400 s) completed 100 s ago
    stats = simulate(cfg, [FailureEvent(t, 1, 0.0)], "memstore")
    assert stats.durable_fallbacks == 1
    committed_at_spill = cfg.memstore_cadence.committed_compute(5400.0)
    progress = cfg.memstore_cadence.split(t)[0]
    assert stats.lost_fallback_seconds == pytest.approx(progress - committed_at_spill)
    # A failure while the spill is still being written falls back to the previous one.
    early = simulate(cfg, [FailureEvent(5400.0 + w / 2, 1, 0.0)], "memstore")
    assert early.spills_aborted == 1
    cad = cfg.memstore_cadence
    assert early.lost_fallback_seconds == pytest.approx(cad.split(5400.0 + w / 2)[0] - cad.committed_compute(3600.0))


@pytest.mark.parametrize("seed", range(4))
def test_time_accounting_adds_up(seed: int) -> None:
    cfg = SimConfig(hosts=2048, trials=1, days=2, seed=seed, correlated_fraction=0.3, burst_hosts=8, baseline_async_fraction=0.5)
    trace = failure_trace(cfg, trial_rng(seed, cfg.hosts, 0))
    for strategy in ("memstore", "baseline"):
        s = simulate(cfg, trace, strategy)
        assert s.compute_seconds + s.stall_seconds + s.recovery_seconds == pytest.approx(s.wall_seconds, rel=1e-9)
        assert s.useful_seconds + s.lost_seconds == pytest.approx(s.compute_seconds, rel=1e-9)
        assert s.failure_events == len(trace)


def test_derived_parameters() -> None:
    cfg = SimConfig(hosts=1000, failures_per_gpu_hour=per_day(8, 1000))
    assert cfg.job_failures_per_day == pytest.approx(8)
    assert cfg.storage_transfer_seconds == pytest.approx(480)  # 1200 GB at 20 Gbps
    assert cfg.young_daly_seconds == pytest.approx(math.sqrt(2 * 480 * 3 * 3600))
    assert cfg.baseline_interval_seconds % cfg.iteration_seconds == 0
    assert replace(cfg, baseline_every_minutes=30).baseline_interval_seconds == 1800
    # Replication slower than an iteration: checkpoint every few iterations instead.
    slow = SimConfig(hosts=16, checkpoint_gb=16 * 1000, network_gbps=100)  # 1 TB/host at 100 Gbps = 80 s
    assert slow.memstore_every_iterations == 8
    # Published figures -> per-GPU rates.
    assert FAILURE_DATA["rsc16k"].failures_per_gpu_hour * 16384 * 1.8 == pytest.approx(1.0)
    assert 1 / (FAILURE_DATA["llama3"].failures_per_gpu_hour * 16384) == pytest.approx(54 * 24 / 419)
    with pytest.raises(ValueError, match="--replicas"):
        SimConfig(hosts=2, replicas=3)


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--hosts", "-5"], "--hosts"),
        (["--hosts", "0"], "--hosts"),
        (["--hosts", "16,abc"], "--hosts"),
        (["--hosts", "16,1"], "--replicas"),
        (["--hosts", "16", "--replicas", "32"], "--replicas"),
        (["--replicas", "0"], "--replicas"),
        (["--days", "0"], "--days"),
        (["--correlated-fraction", "1.5"], "--correlated-fraction"),
        (["--mttf-hours", "-1"], "--mttf-hours"),
        (["--mttf-hours", "2", "--failures-per-day", "3"], "--failures-per-day"),
        (["--rate-at-hosts", "100"], "--rate-at-hosts"),
        (["--checkpoint-gb", "10", "--checkpoint-gb-per-host", "1"], "--checkpoint-gb"),
        (["--baseline-async-fraction", "1"], "--baseline-async-fraction"),
        (["--baseline-every-minutes", "soon"], "--baseline-every-minutes"),
        (["--network-gbps", "nan"], "--network-gbps"),
        (["--failures-per-day", "1e9", "--days", "3650"], "--failures-per-day"),
        (["--bogus"], "--bogus"),
    ],
)
def test_cli_rejects_bad_input(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "memstore simulate: error:" in err
    assert flag in err


def test_cli_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "--correlated-fraction" in capsys.readouterr().out


def test_cli_json_has_the_fields(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "sim.json"
    md = tmp_path / "sim.md"
    argv = ["--hosts", "16,1000", "--trials", "2", "--days", "2", "--failures-per-day", "8", "--seed", "3", "--json", str(out)]
    assert main([*argv, "--markdown", str(md)]) == 0
    assert "memstore simulate" in capsys.readouterr().out  # the table
    doc = json.loads(out.read_text())
    assert doc["tool"] == "memstore simulate" and doc["version"] == 1
    assert doc["parameters"]["hosts"] == [16, 1000]
    assert doc["parameters"]["failure_rate"]["failures_per_day"] == 8
    assert [p["hosts"] for p in doc["points"]] == [16, 1000]
    for point in doc["points"]:
        assert point["derived"]["job_failures_per_day"] == pytest.approx(8)
        for name in ("memstore", "baseline"):
            s = point["strategies"][name]
            for key in ("ettr_mean", "ettr_min", "ettr_max", "failure_events", "ram_recoveries", "durable_fallbacks", "failures_per_run"):
                assert key in s
            assert set(s["wasted_gpu_hours"]) == {"checkpoint_stall", "lost_work", "restart_recovery", "total"}
            assert 0 < s["ettr_mean"] <= 1
    assert len(doc["summary"]["memstore_ettr"]) == 2
    assert "| hosts |" in md.read_text()
    # Same flags, same document.
    out2 = tmp_path / "again.json"
    assert main([*argv[:-1], str(out2), "--no-table"]) == 0
    assert json.loads(out2.read_text()) == doc


def test_cli_plot_writes_png(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("matplotlib")
    out = tmp_path / "img" / "sim.png"
    assert main(["--hosts", "16,128", "--trials", "2", "--days", "1", "--no-table", "--plot", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
