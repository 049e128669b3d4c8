"""Smoke test of ``memstore bench --quick``: it runs end to end and writes every figure. No timing thresholds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from memstore.bench import main

pytestmark = pytest.mark.integration

TARGETS = (
    "stall_vs_memcpy",
    "stall_vs_torch_save_fsync",
    "stall_vs_dcp_async_save",
    "replication_vs_raw_tcp",
    "restore_peer_vs_raw_tcp",
    "restore_peer_vs_torch_load",
    "restore_local_vs_torch_load",
    "store_rss_vs_held",
    "rss_growth_over_saves",
)


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@pytest.mark.timeout(180)
def test_bench_quick_writes_json_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    assert main(["--quick", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    png = tmp_path / "b.png"  # written next to the JSON by default
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    for key in (
        "command",
        "config",
        "machine",
        "state",
        "floors",
        "cluster",
        "ratios",
        "targets",
        "method",
        "diagnosis",
        "conditions",
        "scenarios",
        "sizes",
        "leak_check",
        "headline",
        "skipped",
        "restore_durable",
    ):
        assert key in data, key
    assert data["ok"] is True
    assert data["config"]["quick"] is True
    assert data["config"]["sizes"] == [64 << 20]
    assert data["config"]["saves"] == 2
    assert data["restore_durable"]["available"] is False
    for key in ("cpu_count", "ram_bytes"):
        assert _positive(data["machine"][key]), key
    for key in ("python", "torch"):
        assert data["machine"][key]

    _check_floors(data)
    _check_cluster(data)
    _check_memory_and_leaks(data)
    _check_ratios(data)


def _check_floors(data: dict) -> None:  # type: ignore[type-arg]
    assert len(data["scenarios"]) == 1
    scn = data["scenarios"][0]
    assert scn["headline"] is True and data["headline"] == scn["name"] == "64MiB-2h-R2"
    assert data["cluster"]["name"] == scn["name"]

    floors = data["floors"]
    assert _positive(floors["memcpy"]["torch_copy_seconds"]["p50"])
    assert _positive(floors["memcpy"]["memmove_single_thread_seconds"]["p50"])
    assert _positive(floors["tcp"]["bytes_per_second"]["p50"])
    assert _positive(floors["disk"]["save_fsync_seconds"])
    for key in ("load_cold_seconds", "load_warm_seconds"):
        assert _positive(floors["disk"][key]["p50"]), key
    for key in ("grpc_bytes", "grpc_protobuf"):
        assert _positive(floors[key]["bytes_per_second"]["p50"]), key
    for mode in ("default", "reused_stager"):
        for key in ("blocking_seconds", "total_seconds"):
            assert _positive(floors["dcp"][mode][key]["p50"]), (mode, key)
    assert _positive(floors["dcp"]["file_bytes"])


def _check_cluster(data: dict) -> None:  # type: ignore[type-arg]
    cluster = data["cluster"]
    phases = [s["phase"] for s in cluster["saves"]]
    assert phases == ["cold"] * (data["config"]["keep"] + 1) + ["measured"] * 2
    assert all(s["copies"] == 2 for s in cluster["saves"])
    for key in ("stall_seconds", "paired_memcpy_seconds", "committed_seconds", "replication_seconds", "replication_bytes_per_second"):
        assert _positive(cluster[key]["p50"]), key
        assert _positive(cluster[key]["p95"]), key
    assert _positive(cluster["first_save"]["save_wall_seconds"])

    # restores: each in a new process, verified by fingerprint
    assert cluster["restore_local"]["source_hosts"] == ["h0"]
    assert cluster["restore_peer_deleted"]["source_hosts"] == ["h1"]
    assert cluster["restore_peer"]["source_hosts"] in (["h0"], ["h1"])  # the replacement's repair pass may win the race
    for key in ("restore_local", "restore_local_copy", "restore_peer_deleted", "restore_peer"):
        assert _positive(cluster[key]["seconds"]["p50"]), key
        assert cluster[key]["verified_equal"] is True, key
        for run in cluster[key]["runs"]:
            assert run["pid"] > 0 and _positive(run["import_seconds"]), key
    assert cluster["restore_local"]["runs"][0]["zero_copy"] is True
    assert cluster["restore_local_copy"]["runs"][0]["zero_copy"] is False
    assert _positive(cluster["restore_peer"]["bytes_per_second"])
    assert _positive(cluster["restore_peer"]["runs"][0]["restart_seconds"])
    assert _positive(cluster["peer_pull"]["seconds"]["p50"])
    assert cluster["restore_durable"]["available"] is False


def _check_memory_and_leaks(data: dict) -> None:  # type: ignore[type-arg]
    cluster, scn = data["cluster"], data["scenarios"][0]
    # store memory: RSS/PSS of each store against the shard bytes it holds
    mem = cluster["store_memory"]
    assert set(mem["stores"]) == {"h0", "h1"}
    for host, entry in mem["stores"].items():
        assert entry["pid"] > 0, host
        for key in ("rss", "rss_anon", "rss_shmem", "pss"):
            assert _positive(entry["memory"][key]), (host, key)
        for key in ("shard_bytes_held", "used_bytes", "rss_over_held", "rss_over_held_plus_pooled"):
            assert _positive(entry[key]), (host, key)
        assert entry["shards"] == data["config"]["keep"], host
    assert _positive(mem["rss_over_held_max"])

    # leak check: RSS of the stores and of the saving process over 100 saves
    leak = data["leak_check"]
    assert leak["saves"] == 100 and leak["reference_save"] == 10
    assert set(leak["processes"]) == {"client", "store h0", "store h1"}
    for label, proc in leak["processes"].items():
        assert _positive(proc["rss_after_save_ref"]) and _positive(proc["rss_after_last_save"]), label
        assert _finite(proc["growth_percent"]), label
        assert len(proc["rss_series"]) == 100, label
    assert _finite(leak["max_growth_percent"])

    fresh = data["diagnosis"]["save_path"]["fresh_segment_seconds"]
    assert _positive(fresh["seconds"]["p50"]) and _positive(fresh["fallocate_seconds"]["p50"])
    need = scn["ram_need"]
    assert _positive(need["total_bytes"]) and need["one_rank_per_host_bytes"] >= need["total_bytes"]

    cond = scn["conditions"]
    assert _positive(cond["seconds"]) and _positive(cond["memory_peak_pss_bytes"])
    assert _positive(data["conditions"]["memory_peak_pss_bytes"])


def _check_ratios(data: dict) -> None:  # type: ignore[type-arg]
    for key, value in data["ratios"].items():
        assert value is None or _positive(value), key
    for key in (
        "stall_p50_over_memcpy",
        "stall_p50_over_dcp_async_blocking",
        "torch_save_fsync_over_stall_p50",
        "replication_over_raw_tcp",
        "torch_load_warm_over_restore_local",
        "restore_peer_over_raw_tcp",
        "torch_load_warm_over_restore_peer",
        "peer_pull_over_raw_tcp",
        "store_rss_over_held_max",
        "store_rss_over_held_plus_pooled_max",
    ):
        assert _positive(data["ratios"][key]), key
    for key in TARGETS:
        assert isinstance(data["targets"][key]["pass"], bool), key
        assert _finite(data["targets"][key]["value"]), key
