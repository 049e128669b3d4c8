"""Smoke test of ``memstore bench --quick``: it runs end to end and writes every figure. No timing thresholds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from memstore.bench import main
from tests.unit.test_bench_results import TARGET_ORDER

# A minute on 2 cores: in the slow stage, which CI runs after the default suite (keeps that under 15 minutes).
pytestmark = [pytest.mark.integration, pytest.mark.slow]



def _positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@pytest.mark.timeout(300)
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
        "from_first_save",
    ):
        assert key in data, key
    assert data["ok"] is True
    assert data["config"]["quick"] is True
    assert data["config"]["sizes"] == [64 << 20]
    assert data["config"]["saves"] == 2
    assert data["config"]["prefault"] is None and data["config"]["small_saves"] == 30
    for key in ("cpu_count", "ram_bytes"):
        assert _positive(data["machine"][key]), key
    for key in ("python", "torch"):
        assert data["machine"][key]

    _check_floors(data)
    _check_cluster(data)
    _check_memory_and_leaks(data)
    _check_ratios(data)
    _check_first_save(data)
    _check_fixed_costs_and_no_shm(data)


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
    assert phases == ["first"] + ["early"] * (data["config"]["keep"] + 1) + ["steady"] * 2
    assert all(s["copies"] == 2 for s in cluster["saves"])
    for save in cluster["saves"]:  # every save from the first: paired with a memcpy, timed from the call
        for key in ("save_wall_seconds", "committed_seconds", "paired_memcpy_seconds", "stall_over_memcpy", "committed_bytes_per_second"):
            assert _positive(save[key]), (save["step"], key)
        assert save["committed_seconds"] >= save["save_wall_seconds"]
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
    for run in cluster["restore_peer"]["runs"]:  # timed from the load call; from the replacement's start for reference
        assert _positive(run["start_to_loaded_seconds"]) and run["start_to_loaded_seconds"] >= run["connect_load_seconds"]
    assert cluster["restore_peer"]["timed"] == "connect_load_seconds"

    durable = cluster["restore_durable"]
    assert durable == data["restore_durable"]
    assert durable["available"] is True and "error" not in durable, durable
    assert durable["spill_url"].startswith("file://") and "--spill" in durable["store_command"] and durable["command"]
    assert _positive(durable["spilled_seconds"]) and all(n >= 1 for n in durable["deleted_copies"])
    assert durable["restore"]["source_hosts"] == ["durable"] and durable["restore"]["verified_equal"] is True
    assert _positive(durable["restore"]["seconds"]["p50"])


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
    for key in TARGET_ORDER:  # every target, in the order the unit tests pin
        assert isinstance(data["targets"][key]["pass"], bool), key
        assert _finite(data["targets"][key]["value"]), key


def _check_series(series: dict, keep: int) -> None:  # type: ignore[type-arg]
    assert series["command"] and series["store_command"].startswith(("memstore serve", "MEMSTORE_"))
    assert [s["phase"] for s in series["saves"]][: keep + 2] == ["first"] + ["early"] * (keep + 1)
    fig = series["figures"]
    assert fig["first"]["saves"] == "1" and fig["early"]["saves"] == f"2..{keep + 2}"
    for phase in ("first", "early", "steady"):
        for key in ("stall_seconds", "committed_seconds", "paired_memcpy_seconds"):
            assert _positive(fig[phase][key]["p50"]), (phase, key)
        assert _positive(fig[phase]["stall_over_memcpy_max"]) and _positive(fig[phase]["committed_over_raw_tcp_min"]), phase
    assert _positive(fig["later_stall_over_memcpy_max"]) and _positive(fig["committed_over_raw_tcp_min"])
    assert all(_positive(v) for v in fig["committed_over_raw_tcp"])
    for key, target in fig["targets"].items():
        assert isinstance(target["pass"], bool) and _positive(target["value"]), key


def _check_first_save(data: dict) -> None:  # type: ignore[type-arg]
    first = data["from_first_save"]
    keep = data["config"]["keep"]
    assert first["headline"] == data["headline"]
    labels = [s["label"] for s in first["series"]]
    assert labels[0] == "store defaults" and first["series"][0]["prefault"] is None
    assert first["series"][0]["saves"] == data["cluster"]["saves"]
    _check_series(first["series"][0], keep)
    if first["prefault_supported"]:  # the stores know --prefault: the series with (keep+2)x the state pre-faulted ran
        pre = first["series"][1]
        assert pre["label"].endswith(f"({keep + 2}x state)") and pre["store_command"].startswith("MEMSTORE_PREFAULT=")
        assert "error" not in pre, pre.get("error")
        _check_series(pre, keep)
    for key in ("first_save_stall_over_memcpy", "later_saves_stall_over_memcpy_max", "first_save_committed_over_raw_tcp",
                "committed_over_raw_tcp_min", "torch_load_warm_over_restore_durable", "restore_durable_over_raw_tcp"):  # fmt: skip
        assert _positive(data["ratios"][key]), key


def _check_fixed_costs_and_no_shm(data: dict) -> None:  # type: ignore[type-arg]
    first = data["from_first_save"]
    assert [s["size"] for s in first["small_states"]] == [1 << 20, 16 << 20]
    for small in first["small_states"]:
        assert len(small["saves"]) == 31 and small["saves"][0]["phase"] == "first"
        assert small["stall_seconds"]["n"] == 30 and _positive(small["stall_seconds"]["p50"]) and _positive(small["stall_seconds"]["p95"])
        assert _positive(small["committed_seconds"]["p50"]) and _positive(small["first_stall_seconds"])
        assert small["command"] and small["store_command"]
    pt = first["per_tensor"]
    assert pt["count"] == 10_000 and pt["tensor_bytes"] == 4096
    assert pt["many"]["tensors"] == 10_000 and pt["one"]["tensors"] == 1 and pt["many"]["state_bytes"] == pt["one"]["state_bytes"]
    assert pt["many"]["verified_equal"] is True and pt["one"]["verified_equal"] is True
    for key in ("many_save_stall_seconds", "one_save_stall_seconds", "many_load_seconds", "one_load_seconds"):
        assert _positive(pt[key]), key
    for key in ("save_stall_us_per_tensor", "load_us_per_tensor"):  # a difference: finite, its sign is the measurement's
        assert _finite(pt[key]), key
    ns = first["no_shared_memory"]
    assert ns["shared_memory"] is False and ns["verified_equal"] is True and len(ns["saves"]) == 4
    for key in ("stall_over_raw_tcp", "first_stall_over_raw_tcp", "committed_over_raw_tcp", "load_over_raw_tcp"):
        assert _positive(ns[key]), key
    assert all(s["copies"] == 2 for s in ns["saves"])
