"""The bench's ratios, targets and table, from a run document of known numbers; its flags; and the table of targets
in docs/benchmarks.md, which must be the one the bench holds its ratios to."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from memstore.bench import add_arguments, config_of
from memstore.bench.measure import EARLY, FIRST, STEADY, phase_of
from memstore.bench.targets import RATIOS, compute_ratios, evaluate, markdown_table, text_table

pytestmark = pytest.mark.unit

B = 1 << 30
DOCS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"


def save(step: int, phase: str, stall: float, memcpy: float, committed: float, error: str = "", busy: float = 0.9) -> dict[str, Any]:
    """One save; ``busy``: the share of the machine's 2 cores it kept busy from the call to committed."""
    return {"step": step, "phase": phase, "stall_seconds": stall, "committed_seconds": committed, "memcpy_seconds": memcpy,
            "copies": 0 if error else 2, "error": error,
            "cpu": {"trainer": 0.2, "h0": 0.1, "h1": 0.5, "machine": 2 * committed * busy, "wall": committed,
                    "cores_busy": busy}}  # fmt: skip


def dp(degree: int, path: str, stall: float, captured: int, copies: int, restore: float, read: float) -> dict[str, Any]:
    return {"degree": degree, "path": path, "stall_max": stall, "captured_max": captured, "ram_bytes": copies * B,
            "ram_copies": float(copies), "restore_max": restore, "restore_read_max": read}  # fmt: skip


def document() -> dict[str, Any]:
    """A run of 1 GiB, keep 2: raw TCP moves it in 0.4 s, a memcpy takes 0.1 s, torch.load 0.5 s."""
    saves = [save(1, FIRST, 0.3, 0.1, 1.0, busy=0.8)]
    saves += [save(i, EARLY, 0.12, 0.1, 0.7) for i in (2, 3, 4)]
    saves += [save(5, STEADY, 0.125, 0.1, 0.625), save(6, STEADY, 0.125, 0.1, 0.625)]
    dcp_mode = {"blocking_seconds": [0.5], "blocking_p50": 0.5, "total_p50": 2.0, "unavailable": None}
    return {
        "config": {"replicas": 2, "keep": 2},
        "machine": {"cpus": 2},
        "state": {"bytes": B, "shard_bytes": B},
        "floors": {
            "memcpy": {"p50": 0.1},
            "tcp": {"p50": B / 0.4},
            "hash": {"p50": 0.045},
            "disk": {"save_fsync_seconds": 4.0, "load_warm_p50": 0.5},
            "dcp": {"default": dcp_mode, "reused_stager": {**dcp_mode, "blocking_p50": 0.25}},
        },
        "saves": saves,
        "prepared": {"prepare_seconds": 2.0, "save": save(1, FIRST, 0.2, 0.1, 0.8)},
        "ram": {"ram_multiple_peak": 6.02, "ram_multiple_settled": 6.0, "ram_multiple_idle": 5.0},
        "small_saves": {"stall_p50": 0.0008},
        "restores": {"local": {"p50": 0.05, "load_p50": 0.05}, "peer": {"p50": 0.8, "load_p50": 0.5}},
        "streams": {"bytes": B, "p1": {"p50": 0.5}, "p2": {"p50": 0.4}, "p4": {"p50": 0.32}},
        "data_parallel": {"replicas": 2, "state_bytes": B, "cases": [
            dp(2, "no_dedup", 0.2, B, 4, 0.1, 0.3), dp(2, "dedup", 0.1, B // 2, 2, 0.12, 0.3),
            dp(4, "no_dedup", 0.4, B, 8, 0.1, 0.4), dp(4, "dedup", 0.12, B // 4, 2, 0.2, 0.44),
        ]},
    }  # fmt: skip


def test_every_ratio_from_its_parts() -> None:
    values, why = compute_ratios(document())
    assert values == pytest.approx({
        "first_save_stall_over_memcpy": 3.0,
        "first_save_prepared_stall_over_memcpy": 2.0,
        "later_saves_stall_over_memcpy_max": 1.25,
        "stall_over_memcpy": 1.25,
        "ram_peak_over_state": 6.02,
        "ram_settled_over_state": 6.0,
        "ram_idle_over_state": 5.0,
        "small_save_stall_ms": 0.8,
        "torch_save_fsync_over_stall": 32.0,
        "stall_over_dcp_blocking": 0.25,
        "stall_over_dcp_blocking_reused_stager": 0.5,
        "replication_over_tcp": 0.8,  # 1 GiB in 0.625 - 0.125 s against 0.4 s
        "committed_over_tcp_min": 0.4,  # save 1: 1 GiB in 1.0 s (no paired TCP here: against the floor)
        "committed_over_tcp_first": 0.4,
        "committed_over_tcp_first_prepared": 0.5,  # 1 GiB in 0.8 s after prepare()
        "save_cores_busy_min": 0.8,  # save 1 kept 80% of the cores busy, the others 90%
        "tcp_over_cpu_floor_min": 0.5,  # save 1 took 1.6 CPU seconds: 0.8 s on 2 cores, against 0.4 s of TCP
        "torch_load_over_restore_local": 10.0,
        "restore_local_over_hash_floor": 0.9,  # from load(): 0.05 s against 0.045 s of verification
        "restore_peer_over_tcp": 0.8,  # from load(): 1 GiB in 0.5 s against 0.4 s
        "restore_peer_from_accept_over_tcp": 0.5,  # from the replacement's port accepting: 0.8 s
        "torch_load_over_restore_peer": 1.0,
        "stream_p1_over_tcp": 0.8,  # 1 GiB pushed in 0.5 s against 0.4 s
        "stream_p2_over_tcp": 1.0,
        "stream_p4_over_tcp": 1.25,
        "dp2_stall_over_no_dedup": 0.5,
        "dp4_stall_over_no_dedup": 0.3,
        "dp4_captured_over_no_dedup": 0.25,
        "dp4_ram_over_no_dedup": 0.25,  # R copies against 4 x R
        "dp4_ram_copies": 2.0,
        "dp4_restore_over_no_dedup": 2.0,
        "dp4_restore_read_over_no_dedup": 1.1,
    })  # fmt: skip
    assert why == {} and set(values) == {r.name for r in RATIOS}


def test_pass_miss_and_the_table() -> None:
    rows = evaluate(document())
    verdicts = {r["ratio"]: r["pass"] for r in rows}
    assert verdicts == {
        "first_save_stall_over_memcpy": True,  # 3.0 <= 5 (without prepare)
        "first_save_prepared_stall_over_memcpy": True,  # 2.0 <= 3
        "later_saves_stall_over_memcpy_max": True,
        "stall_over_memcpy": True,
        "ram_peak_over_state": True,  # 6.02 <= (keep + 1) x R + 0.5
        "ram_settled_over_state": None,  # reported, no target
        "ram_idle_over_state": True,
        "small_save_stall_ms": True,
        "torch_save_fsync_over_stall": True,
        "stall_over_dcp_blocking": False,
        "stall_over_dcp_blocking_reused_stager": None,  # reported, no target
        "replication_over_tcp": True,
        "committed_over_tcp_min": False,
        "committed_over_tcp_first": None,  # reported, no target of its own (the min holds save 1 to 0.7)
        "committed_over_tcp_first_prepared": True,  # 0.5 >= 0.5
        "save_cores_busy_min": None,  # reported, no target
        "tcp_over_cpu_floor_min": None,
        "torch_load_over_restore_local": True,
        "restore_local_over_hash_floor": True,  # 0.9 >= 0.8
        "restore_peer_over_tcp": True,
        "restore_peer_from_accept_over_tcp": None,  # reported, no target
        "torch_load_over_restore_peer": False,
        "stream_p1_over_tcp": None,  # reported, no target
        "stream_p2_over_tcp": None,
        "stream_p4_over_tcp": None,
        "dp2_stall_over_no_dedup": None,
        "dp4_stall_over_no_dedup": True,
        "dp4_captured_over_no_dedup": True,
        "dp4_ram_over_no_dedup": True,
        "dp4_ram_copies": None,
        "dp4_restore_over_no_dedup": False,  # 2.0 > 1.5
        "dp4_restore_read_over_no_dedup": None,
    }
    lines = text_table(rows).splitlines()
    assert lines[0].split() == ["ratio", "measured", "target", "result"] and len(lines) == 2 + len(RATIOS)
    row = next(x for x in lines if x.startswith("committed_over_tcp_min "))
    assert row.split() == ["committed_over_tcp_min", "0.4", "≥", "0.7", "MISS"]
    assert json.loads(json.dumps(rows)) == rows  # what the JSON holds


def test_a_save_is_compared_with_the_tcp_transfer_paired_with_it() -> None:
    """Each save carries the raw TCP time of its bytes measured right before it: its ratio is against that, not against
    the run's floor, so a machine that got faster or slower over the run moves both."""
    doc = document()
    for s in doc["saves"]:
        s["tcp_seconds"] = 0.35
    doc["saves"][0]["tcp_seconds"] = 0.5  # the machine was slower at save 1: 1 GiB over TCP took 0.5 s then
    values, _ = compute_ratios(doc)
    assert values["committed_over_tcp_first"] == pytest.approx(0.5)  # 0.5 s of TCP against 1.0 s to committed
    assert values["committed_over_tcp_min"] == pytest.approx(0.5)  # the early saves: 0.35 / 0.7
    assert values["tcp_over_cpu_floor_min"] == pytest.approx(0.35 / 0.63)  # an early save: 1.26 CPU seconds on 2 cores
    doc["saves"][2]["tcp_seconds"] = 0.28
    assert compute_ratios(doc)[0]["committed_over_tcp_min"] == pytest.approx(0.4)  # 0.28 / 0.7


def test_a_restore_is_compared_with_the_tcp_transfer_paired_with_it() -> None:
    doc = document()
    doc["restores"]["peer"]["runs"] = [
        {"seconds": 0.8, "load_seconds": 0.5, "tcp_seconds": 0.45},  # the machine was slower then: TCP took 0.45 s
        {"seconds": 0.6, "load_seconds": 0.4, "tcp_seconds": 0.3},
        {"seconds": 0.7, "load_seconds": 0.6, "tcp_seconds": 0.3},
    ]
    values, _ = compute_ratios(doc)
    assert values["restore_peer_over_tcp"] == pytest.approx(0.75)  # p50 of 0.9, 0.75 and 0.5
    assert values["restore_peer_from_accept_over_tcp"] == pytest.approx(0.5)  # p50 of 0.5625, 0.5 and 0.43
    doc["restores"]["peer"]["runs"][0].pop("tcp_seconds")  # a run without its pair: the run's floor for all
    assert compute_ratios(doc)[0]["restore_peer_over_tcp"] == pytest.approx(0.8)


def test_saves_that_measured_no_cpu_report_no_cpu_bound() -> None:
    doc = document()
    for s in doc["saves"]:
        s.pop("cpu")
    values, why = compute_ratios(doc)
    assert values["save_cores_busy_min"] is None and values["tcp_over_cpu_floor_min"] is None
    assert why["save_cores_busy_min"] == why["tcp_over_cpu_floor_min"] == "not measured"


def test_a_save_that_did_not_commit_counts_zero_and_r1_has_no_peer_figures() -> None:
    doc = document()
    doc["saves"][4] = save(5, STEADY, 0.125, 0.1, 9.0, error="PrepareReceive timed out")
    doc["config"]["replicas"] = 1
    doc["restores"]["peer"] = None
    values, why = compute_ratios(doc)
    assert values["committed_over_tcp_min"] == 0.0
    assert values["restore_peer_over_tcp"] is None and why["restore_peer_over_tcp"] == "R=1 keeps no peer copy"
    assert values["torch_load_over_restore_peer"] is None and "small_save_stall_ms" not in why
    doc.pop("small_saves")
    assert compute_ratios(doc)[1]["small_save_stall_ms"] == "not measured (--small-saves 0)"
    doc.pop("data_parallel")
    values, why = compute_ratios(doc)
    dp_names = [r.name for r in RATIOS if r.name.startswith("dp")]
    assert len(dp_names) == 7 and all(values[n] is None and why[n] == "not measured (--dp-size 0)" for n in dp_names)


def test_phases_of_a_series() -> None:
    assert [phase_of(i, keep=2) for i in range(6)] == [FIRST, EARLY, EARLY, EARLY, STEADY, STEADY]


def _config(argv: list[str]) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return config_of(p.parse_args(argv))


def test_flags_quick_and_defaults() -> None:
    assert _config([])["size"] == B and _config([])["saves"] == 5 and _config([])["small_saves"] == 30
    assert (
        _config([])["dp_size"] == 256 << 20 and _config(["--quick"])["dp_size"] == 16 << 20 and _config(["--dp-size", "0"])["dp_size"] == 0
    )
    quick = _config(["--quick"])
    assert (quick["size"], quick["saves"], quick["restores"], quick["small_saves"]) == (64 << 20, 2, 1, 5)
    assert _config(["--quick", "--saves", "7"])["saves"] == 7  # a flag given wins over --quick
    assert _config(["--prefault", "auto", "--store-env", "A=1"])["store_env"] == {"A": "1", "MEMSTORE_PREFAULT": "auto"}
    for bad in (["--replicas", "3"], ["--saves", "0"], ["--size", "lots"]):
        with pytest.raises(ValueError):
            _config(bad)


def test_a_bad_trainer_switch_is_refused_by_name_before_anything_runs(monkeypatch, capsys) -> None:
    from memstore.bench import main

    monkeypatch.setenv("MEMSTORE_TRAINER_HASHING", "maybe")
    assert main(["--quick"]) == 2
    assert "memstore bench: error: MEMSTORE_TRAINER_HASHING='maybe' is invalid: expected on or off" in capsys.readouterr().err


def test_docs_show_the_targets_the_bench_holds_ratios_to() -> None:
    """docs/benchmarks.md's table of targets is markdown_table()'s output, verbatim: one source of truth."""
    assert markdown_table() in DOCS.read_text(), "regenerate the table in docs/benchmarks.md from memstore.bench.targets.markdown_table()"
