"""Smoke test of ``memstore bench --quick``: it runs end to end and writes every figure. No timing thresholds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from memstore.bench import main

pytestmark = pytest.mark.integration


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@pytest.mark.timeout(120)
def test_bench_quick_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    assert main(["--quick", "--json", str(out)]) == 0
    data = json.loads(out.read_text())

    for key in ("command", "config", "machine", "state", "floors", "cluster", "ratios", "targets", "method", "replication_cost_model"):
        assert key in data, key
    assert data["ok"] is True
    assert data["config"]["quick"] is True
    assert data["config"]["size"] == 64 << 20
    assert data["config"]["saves"] == 2
    for key in ("cpu_count", "ram_bytes"):
        assert _positive(data["machine"][key]), key
    for key in ("python", "torch"):
        assert data["machine"][key]

    floors = data["floors"]
    assert _positive(floors["memcpy"]["torch_copy_seconds"]["p50"])
    assert _positive(floors["memcpy"]["memmove_single_thread_seconds"]["p50"])
    assert _positive(floors["tcp"]["bytes_per_second"]["p50"])
    for key in ("save_fsync_seconds", "load_cold_seconds", "load_warm_seconds"):
        assert _positive(floors["disk"][key]), key

    cluster = data["cluster"]
    phases = [s["phase"] for s in cluster["saves"]]
    assert phases[0] == "cold" and phases.count("measured") == 2
    assert all(s["copies"] == 2 for s in cluster["saves"])
    for key in ("stall_seconds", "committed_seconds", "replication_seconds", "replication_bytes_per_second"):
        assert _positive(cluster[key]["p50"]), key
        assert _positive(cluster[key]["p95"]), key
    assert _positive(cluster["cold_save"]["save_wall_seconds"])
    assert cluster["restore_local"]["source_host"] == "h0"
    assert cluster["restore_peer"]["source_host"] == "h1"
    for key in ("restore_local", "restore_peer", "restore_replacement"):
        assert _positive(cluster[key]["load_seconds"]), key
        assert cluster[key]["verified_equal"] is True, key

    for key, value in data["ratios"].items():
        assert _positive(value), key
    for key in ("stall_p50_le_2x_memcpy", "replication_ge_half_raw_tcp"):
        assert isinstance(data["targets"][key]["pass"], bool), key
