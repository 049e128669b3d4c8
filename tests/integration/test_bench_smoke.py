"""Smoke test of ``memstore bench``: a tiny run end to end, on real stores and baselines; it prints the table and writes
every ratio. No timing thresholds: a ratio must exist and be a positive number, not meet its target. The data-parallel
section's RAM (R copies with a replica group, D x R without), bytes captured and restores are checked exactly."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from memstore.bench import main, ranks
from memstore.bench.baselines_dcp import CLOSED_STAGER_HINT
from memstore.bench.targets import RATIOS
from tests.harness.torch_versions import TORCH_MINOR

pytestmark = pytest.mark.integration

ARGV = ["--size", "4MiB", "--saves", "1", "--restores", "1", "--small-saves", "2", "--dp-size", "2MiB", "--idle-wait", "0"]


# The slow stage and the torch stage (CI runs both): ~35 s of the machine's CPU, four fresh processes importing torch
# among it. The default suite keeps the bench's parts (tests/unit/test_bench_*.py, test_redundancy_bench.py).
@pytest.mark.slow
@pytest.mark.torch_stage
@pytest.mark.timeout(240)
def test_a_tiny_run_writes_the_table_and_every_ratio(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MEMSTORE_TRAINER_HASHING", raising=False)
    out = tmp_path / "b.json"
    assert main([*ARGV, "--json", str(out), "--disk-dir", str(tmp_path)]) == 0
    data = json.loads(out.read_text())
    printed = capsys.readouterr().out

    assert data["ok"] is True and data["config"]["size"] == 4 << 20
    assert [s["phase"] for s in data["saves"]] == ["first", "early", "early", "early", "steady"]  # keep 2, --saves 1
    assert all(s["copies"] == 2 and not s["error"] for s in data["saves"])
    assert data["machine"]["trainer_hashing"] is False and data["machine"]["marked_captures"] in (True, False)
    assert all(r["tcp_seconds"] > 0 for r in data["restores"]["peer"]["runs"])  # each restore paired with raw TCP
    for s in data["saves"]:  # the CPU each save took, per process and on the machine (Linux /proc)
        assert set(s["cpu"]) == {"trainer", "h0", "h1", "machine", "wall", "cores_busy"}  # in 10 ms ticks: 0 is possible
        assert all(v is not None and v >= 0 for v in [*s["cpu"].values(), *s["tcp_cpu"].values()]), s
    for kind in ("local", "peer"):
        restore = data["restores"][kind]
        assert restore["verified_equal"] is True and restore["p50"] > 0, kind
    assert data["floors"]["disk"]["load_verified"] is True and len(data["floors"]["disk"]["load_warm_seconds"]) == 1
    assert data["restores"]["peer"]["source_hosts"] == ["h1"]  # the owner h0 was lost: its peer served the restore

    names = [r.name for r in RATIOS]
    assert [row["ratio"] for row in data["targets"]] == names
    dcp = data["floors"]["dcp"]
    unavailable = {
        "stall_over_dcp_blocking": dcp["default"]["unavailable"],
        "stall_over_dcp_blocking_reused_stager": dcp["reused_stager"]["unavailable"],
    }
    if TORCH_MINOR == (2, 11):  # torch 2.11's own reused stager fails (pytorch/pytorch#183413): reported, the run goes on
        assert dcp["default"]["unavailable"] is None and dcp["reused_stager"]["unavailable"].endswith(CLOSED_STAGER_HINT)
    for row in data["targets"]:
        value = row["value"]
        if unavailable.get(row["ratio"]):
            assert value is None and row["note"], row  # this torch's DCP cannot: n/a with the reason
            continue
        if row["ratio"] == "ram_idle_over_state":  # --idle-wait 0: not measured, and said so
            assert value is None and row["note"] == "not measured (--idle-wait 0)", row
            continue
        if row["ratio"] in ("save_cores_busy_min", "tcp_over_cpu_floor_min"):  # 4 MiB saves last a few 10 ms CPU ticks
            assert value is None or (math.isfinite(value) and value >= 0), row
            continue
        assert isinstance(value, float) and math.isfinite(value) and value > 0, row
        assert row["pass"] in ((True, False) if row["target"] != "-" else (None,)), row
    assert data["ratios"] == {row["ratio"]: row["value"] for row in data["targets"]}

    table = [line for line in printed.splitlines() if line.split()[:1] and line.split()[0] in names]
    assert [line.split()[0] for line in table] == names
    assert all(("PASS" in line) != ("MISS" in line) for line in table if ("≤" in line or "≥" in line) and "n/a" not in line)
    assert not [p for p in os.listdir(tmp_path) if p.startswith("memstore-bench-")]  # the baselines' files are gone
    assert "data parallel: a 2.00 MiB state on every rank, 4 stores, R=2" in printed

    dp = data["data_parallel"]  # D ranks of one state: without a replica group D x R copies, with one R copies
    whole = dp["state_bytes"]
    assert [(c["degree"], c["path"]) for c in dp["cases"]] == [(d, p) for d in (1, 2, 4) for p in ("no_dedup", "dedup")]
    for c in dp["cases"]:
        d, dedup = c["degree"], c["path"] == "dedup"
        assert c["ram_copies"] == pytest.approx(2 if dedup else 2 * d, rel=0.05), c
        assert c["captured_max"] == pytest.approx(whole / d if dedup else whole, rel=0.05), c  # each rank captured 1/D
        assert c["copies_min"] == 2 and not c["errors"], c
        assert [len(r) for r in c["restores"]] == [d] and c["verified_equal"] is True, c  # --restores 1: one round of D
        assert all(r["verified_equal"] for r in c["restores"][0]), c
    assert data["ram"]["ram_multiple_peak"] <= 6.5 and data["ram"]["ram_multiple_idle"] is None, data["ram"]
    assert "ranks_per_host" not in data  # --ranks-per-host 1 (the default): the section alone is tested below


@pytest.mark.slow  # ~8 s; the default suite keeps tests/integration/test_ranks_per_host.py (8 ranks on one store)
@pytest.mark.timeout(120)
def test_ranks_per_host_reports_every_rank_and_the_aggregate() -> None:
    """--ranks-per-host's section alone, small: 2 rank processes, 4 MiB in all, keep 2 and one steady save (5 rounds)."""
    section = ranks.measure_ranks(4 << 20, 2, hosts=2, replicas=2, keep=2, steady=1, seed=0, data_plane=None, env={}, shm_root="/dev/shm")
    assert ranks.ok(section), section["errors"]
    assert section["ranks"] == 2 and section["copies_min"] == 2
    assert [[s["rank"] for s in r] for r in section["saves"]] == [[0, 1]] * 5  # every rank saved in every round
    assert [r[0]["phase"] for r in section["saves"]] == ["first", "early", "early", "early", "steady"]
    assert section["rank_state_bytes"] == [section["state_bytes"] // 2] * 2
    for s in (s for r in section["saves"] for s in r):
        assert s["stall_seconds"] > 0 and s["memcpy_seconds"] > 0 and s["committed_seconds"] >= s["stall_seconds"], s
        assert s["stall_over_memcpy"] == pytest.approx(s["stall_seconds"] / s["memcpy_seconds"]), s
        assert s["nbytes"] >= section["state_bytes"] // 2, s  # the rank's shard: its state and a header
    for phase in ("first", "steady"):
        figures = section[phase]
        assert figures["saves"] == 2 and figures["stall_over_memcpy_max"] >= figures["stall_over_memcpy_p50"] > 0, figures
        assert figures["committed_max"] >= figures["committed_p50"] > 0 and figures["committed_bytes_per_second"] > 0, figures
    assert [r["rank"] for r in section["per_rank"]] == [0, 1]
    assert all(r["first_stall_over_memcpy"] > 0 and r["steady_stall_over_memcpy_p50"] > 0 for r in section["per_rank"])
    # R=2 copies of keep 2 steps and one save in flight: (keep + 1) x R, and 0.5 for headers and sampling
    assert section["ram_multiple_needed"] == 6
    assert 2 <= section["ram_multiple_settled"] <= section["ram_multiple_peak"] <= 6.5, section
    assert section["ram_multiple_idle"] is None  # not waited for here
    line = ranks.summary_line(section)
    assert line.startswith("2 ranks on one store, 4 MiB in all") and "RAM / state peak" in line


@pytest.mark.parametrize(("flags", "problem"), [(["--ranks-per-host", "0"], "--ranks-per-host must be >= 1"),
                                                (["--size", "4MiB", "--ranks-per-host", "8"], "less than 1 MiB per rank"),
                                                (["--idle-wait", "-1"], "--idle-wait must be >= 0 seconds")])  # fmt: skip
def test_a_bad_ranks_per_host_is_refused_before_anything_runs(flags: list[str], problem: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(flags) == 2
    assert problem in capsys.readouterr().err
