"""Smoke test of ``memstore bench``: a tiny run end to end, on real stores and floors; it prints the table and writes
every ratio. No timing thresholds: a ratio must exist and be a positive number, not meet its target. The data-parallel
section's RAM (R copies with a replica group, D x R without), bytes captured and restores are checked exactly."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from memstore.bench import main
from memstore.bench.floors_dcp import CLOSED_STAGER_HINT
from memstore.bench.targets import RATIOS
from tests.harness.torch_versions import TORCH_MINOR

pytestmark = pytest.mark.integration

ARGV = ["--size", "4MiB", "--saves", "1", "--restores", "1", "--small-saves", "2", "--dp-size", "2MiB"]


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
        if row["ratio"] in ("save_cores_busy_min", "tcp_over_cpu_floor_min"):  # 4 MiB saves last a few 10 ms CPU ticks
            assert value is None or (math.isfinite(value) and value >= 0), row
            continue
        assert isinstance(value, float) and math.isfinite(value) and value > 0, row
        assert row["pass"] in ((True, False) if row["target"] != "-" else (None,)), row
    assert data["ratios"] == {row["ratio"]: row["value"] for row in data["targets"]}

    table = [line for line in printed.splitlines() if line.split()[:1] and line.split()[0] in names]
    assert [line.split()[0] for line in table] == names
    assert all(("PASS" in line) != ("MISS" in line) for line in table if "≤" in line or "≥" in line)
    assert not [p for p in os.listdir(tmp_path) if p.startswith("memstore-bench-")]  # the floors' files are gone
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
