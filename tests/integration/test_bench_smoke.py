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

    for key in ("command", "config", "machine", "state", "floors", "cluster", "ratios", "targets", "method", "diagnosis", "conditions"):
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
    assert _positive(floors["disk"]["save_fsync_seconds"])
    for key in ("load_cold_seconds", "load_warm_seconds"):
        assert _positive(floors["disk"][key]["p50"]), key

    for key in ("grpc_bytes", "grpc_protobuf"):
        assert _positive(floors[key]["bytes_per_second"]["p50"]), key

    cluster = data["cluster"]
    phases = [s["phase"] for s in cluster["saves"]]
    assert phases == ["cold"] * (data["config"]["keep"] + 1) + ["measured"] * 2
    assert all(s["copies"] == 2 for s in cluster["saves"])
    for key in ("stall_seconds", "paired_memcpy_seconds", "committed_seconds", "replication_seconds", "replication_bytes_per_second"):
        assert _positive(cluster[key]["p50"]), key
        assert _positive(cluster[key]["p95"]), key
    assert _positive(cluster["first_save"]["save_wall_seconds"])
    assert cluster["restore_local"]["source_hosts"] == ["h0"]
    assert cluster["restore_peer"]["source_hosts"] == ["h1"]
    assert cluster["restore_replacement"]["source_host"] in ("h0", "h1")
    for key in ("restore_local", "restore_peer"):
        assert _positive(cluster[key]["load_seconds"]["p50"]), key
        assert cluster[key]["verified_equal"] is True, key
    assert _positive(cluster["restore_replacement"]["load_seconds"])
    assert cluster["restore_replacement"]["verified_equal"] is True
    assert _positive(data["conditions"]["memory_peak_pss_bytes"])

    for key, value in data["ratios"].items():
        assert value is None or _positive(value), key
    for key in (
        "stall_p50_over_memcpy",
        "replication_over_raw_tcp",
        "restore_local_over_torch_load_warm",
        "restore_peer_over_torch_load_warm",
    ):
        assert _positive(data["ratios"][key]), key
    for key in ("stall_p50_le_2x_memcpy", "replication_ge_half_raw_tcp"):
        assert isinstance(data["targets"][key]["pass"], bool), key
