"""The bench's typed results: summaries, the JSON they write (keys, omitted and flattened fields), ratios and the
PASS/MISS of the targets, and the scenario plan. Pure: no processes, no torch."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from memstore.bench import add_arguments
from memstore.bench.jsonable import json_default, to_json
from memstore.bench.options import BenchConfig, config_from_args
from memstore.bench.plan import plan_scenarios, ram_need
from memstore.bench.results import (
    CostModel,
    CpuReport,
    DcpFloor,
    DcpMode,
    DiskFloor,
    Floors,
    GrpcFloor,
    MemcpyFloor,
    ProcMemory,
    ScenarioConditions,
    SizeResult,
    StateInfo,
    Summary,
    TcpFloor,
)
from memstore.bench.run_result import ScenarioResult
from memstore.bench.scenario_results import (
    DurableRestore,
    Endpoints,
    HeldBytes,
    HostLoss,
    LeakCheck,
    LeakSkipped,
    PeerPull,
    PullNote,
    PullRun,
    RestoreReport,
    RestoreRun,
    RestoreSummary,
    SaveSample,
    ScenarioMeasurement,
    StoreMemory,
    StoreMemoryEntry,
    StoreRatios,
)
from memstore.bench.targets import Target, Targets, evaluate
from memstore.bench.units import GiB, MiB, percentile, ratio, short_size

pytestmark = pytest.mark.unit

NB = 64 * MiB


def s(p50: float, n: int = 3) -> Summary:
    return Summary.of([p50] * n)


# -- builders of a plausible run, every figure chosen so the ratios are easy to check ---------------------------


def size_result(tcp_bps: float = 2 * GiB, load_warm: float = 0.5) -> SizeResult:
    floors = Floors(
        memcpy=MemcpyFloor(NB, 2, s(0.2), s(0.1), s(0.15), s(0.12)),
        tcp=TcpFloor(NB, 3, 4 * MiB, 1 << 20, s(NB / tcp_bps), s(tcp_bps)),
        grpc_bytes=GrpcFloor("bytes", NB, 3, 4 * MiB, s(0.2), s(tcp_bps / 2)),
        grpc_protobuf=GrpcFloor("protobuf", NB, 3, 4 * MiB, s(0.3), s(tcp_bps / 4)),
        disk=DiskFloor("/tmp/x", "ext4", NB, 2.0, 1.0, 3.0, s(1.0), True, s(load_warm), True),
        dcp=DcpFloor("2.x", "w", "none", 3, "/tmp/y", "ext4", NB, DcpMode(s(0.4), s(2.0)), DcpMode(s(0.2), s(1.5))),
    )
    state = StateInfo(NB, NB, 16, "float32", "layout", 0.1, "f" * 32)
    cost = CostModel(NB, 4 * MiB, 16, {"xxh3_checksum": 0.01}, {"xxh3_checksum": NB / 0.01}, 0.02, 0.03, "notes")
    return SizeResult(state=state, floors=floors, diagnosis=cost)


def save(step: int, phase: str, wall: float = 0.1, error: str = "", paired: float = 0.1) -> SaveSample:
    return SaveSample(step, phase, wall, wall * 0.9, wall + 0.2, 2, 0.2, NB / 0.2, paired, error, wall / paired, NB / (wall + 0.2))


def restore_run(seconds: float, source: str = "h0", fingerprint: str = "f" * 32, host_loss: HostLoss | None = None) -> RestoreRun:
    report = RestoreReport(1.0, 1.0 + seconds, 0.01, seconds - 0.01, seconds, source, True, True, ProcMemory(rss=1, pss=2))
    return RestoreRun(report=report, fingerprint=fingerprint, bench_wall_seconds=seconds, import_seconds=1.0, pid=42, host_loss=host_loss)


def restores(seconds: float, timed: str = "connect_load_seconds", **kw: object) -> RestoreSummary:
    runs = [restore_run(seconds, **kw)]  # type: ignore[arg-type]
    for r in runs:
        r.verified_equal = True
    return RestoreSummary(s(seconds), timed, s(seconds), s(0.01), ["h0"], True, runs)


def store_memory(rss: int = 3 * NB, held: int = 2 * NB, used: int = 3 * NB) -> StoreMemory:
    entry = StoreMemoryEntry(
        pid=7,
        memory=ProcMemory(rss=rss, pss=rss),
        held=HeldBytes(2, held, used, used - held, 4 * NB),
        ratios=StoreRatios(rss / held, rss / used, rss / held),
    )
    return StoreMemory({"h0": entry}, "h0", rss / held, rss / used, True, "")


def measurement(replicas: int = 2, peer: bool = True, stall: float = 0.05) -> ScenarioMeasurement:
    saves = [save(1, "first", 0.25), save(2, "early", 0.14), save(3, "early", 0.1), save(4, "steady", stall), save(5, "steady", stall)]
    peer_pull = PeerPull(s(0.05), s(NB / 0.05), ["h1"], [PullRun(0.05, "h1", 1, NB / 0.05)]) if replicas >= 2 else None
    deleted = restores(0.1) if replicas >= 2 else None
    host_loss = None
    if replicas >= 2 and peer:
        loss = HostLoss(0.5, 10.0, 0.25, 0.4, 0.25, [PullNote("repair", "k", "h1")], 0, 1, [])
        host_loss = restores(0.25, timed="restore_seconds", host_loss=loss)
        host_loss.bytes_per_second = NB / 0.25
        host_loss.pulled_by = ["repair"]
    note = None if host_loss else ("R=1: none" if replicas < 2 else "host loss skipped")
    cpu = CpuReport(1.0, None, None, None, None, None, 0.5, None, None, None)
    return ScenarioMeasurement(
        name=f"64MiB-2h-R{replicas}", size=NB, hosts=2, replicas=replicas, saves_measured=2, restores=1, headline=True,
        ram_need=ram_need(NB, replicas, 2, 2), cluster_start_seconds=1.0, local_cluster=True, job="bench", shared_memory=True,
        store_version="0.1.0", store_data_port=1234, data_plane="raw TCP data channel", errors=[], last_step=5, saves=saves,
        stall_seconds=s(stall), stall_inside_save_seconds=s(stall), paired_memcpy_seconds=s(0.1), failed_saves=0,
        committed_seconds=s(0.3), replication_seconds=s(0.2), replication_bytes_per_second=s(NB / 0.2), first_save=saves[0],
        cold_saves_stall_seconds=s(0.4), store_memory=store_memory(), restore_local=restores(0.05), restore_local_copy=restores(0.2),
        peer_pull=peer_pull, restore_peer_deleted=deleted, restore_peer=host_loss, restore_peer_note=note,
        restore_durable=DurableRestore(), store_memory_end=store_memory(),
        conditions=ScenarioConditions(**vars(cpu), memory_peak_pss_bytes=123),
    )  # fmt: skip


def leak(growth: float = 1.0) -> LeakCheck:
    from memstore.bench.scenario_results import LeakProcess

    proc = LeakProcess(100, int(100 * (1 + growth / 100)), growth, 0, 0, None, [100] * 20)
    cpu = CpuReport(1.0, None, None, None, None, None, 0.5, None, None, None)
    return LeakCheck(16 * MiB, 20, 2, 2, 10, {"client": proc}, growth, "client", s(0.01), [2], [], False, cpu)


# -- helpers ------------------------------------------------------------------------------------------------------


def test_summary_and_percentile() -> None:
    x = Summary.of([3.0, 1.0, 2.0, 4.0])
    assert (x.n, x.min, x.max) == (4, 1.0, 4.0)
    assert x.p50 == pytest.approx(2.5) and x.p95 == pytest.approx(3.85)  # numpy's linear interpolation
    assert x.values == [3.0, 1.0, 2.0, 4.0]
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        Summary.of([])


def test_ratio_and_sizes() -> None:
    assert ratio(1.0, 4.0) == 0.25
    assert ratio(None, 1.0) is None and ratio(1.0, None) is None and ratio(1.0, 0.0) is None
    assert short_size(GiB) == "1GiB" and short_size(64 * MiB) == "64MiB" and short_size(1000) == "1000B"


# -- JSON shape -----------------------------------------------------------------------------------------------


def test_proc_memory_leaves_out_what_the_kernel_did_not_report() -> None:
    assert to_json(ProcMemory(rss=1, pss=2)) == {"rss": 1, "pss": 2}
    mem = ProcMemory.from_json({"rss_peak": 3, "rss": 1})
    assert mem == ProcMemory(rss_peak=3, rss=1)
    assert ProcMemory.from_json(None) is None


def test_store_memory_entry_flattens_held_and_ratios() -> None:
    assert to_json(StoreMemoryEntry(pid=None, memory=None, held=None)) == {"pid": None, "memory": None}
    entry = store_memory().stores["h0"]
    keys = list(to_json(entry))
    assert keys[:2] == ["pid", "memory"]
    assert keys[2:7] == ["shards", "shard_bytes_held", "used_bytes", "pooled_bytes_estimate", "capacity_bytes"]
    assert keys[7:] == ["rss_over_held", "rss_over_held_plus_pooled", "pss_over_held"]


def test_restore_run_json() -> None:
    loss = HostLoss(0.5, None, None, 0.4, 0.4, [PullNote("fetch", "bench/5/0", "h1")], 1, 0, [])
    r = restore_run(0.3, host_loss=loss)
    r.verified_equal = True
    data = to_json(r)
    assert "fingerprint" not in data and list(data)[-1] == "verified_equal"
    assert data["pulls"] == [{"by": "fetch", "key": "bench/5/0", "from": "h1"}]  # "from" is a Python keyword
    assert data["serving_unix"] is None and data["restore_seconds"] == 0.4
    assert list(data)[:3] == ["accept_unix", "loaded_unix", "connect_seconds"]
    assert {"bench_wall_seconds", "import_seconds", "pid"} <= set(data)
    plain = to_json(restore_run(0.3))
    assert "restore_seconds" not in plain and "pulls" not in plain
    assert RestoreReport.from_json({**to_json(r.report), "fingerprint": "x"}) == r.report


def test_restore_run_times_the_right_figure() -> None:
    loss = HostLoss(0.5, 10.0, 0.2, 0.4, 0.2, [], 0, 0, [])
    r = restore_run(0.3, host_loss=loss)
    assert r.seconds("connect_load_seconds") == 0.3 and r.seconds("restore_seconds") == 0.2


def test_scenario_json_keys_and_optional_parts() -> None:
    info = size_result()
    r2 = ScenarioResult.evaluated(measurement(), info, leak())
    data = to_json(r2)
    keys = list(data)
    assert keys[:3] == ["name", "size", "hosts"]
    assert keys[-5:] == ["stores_idle_wait_seconds", "ratios", "targets", "targets_passed", "targets_missed"]
    assert {"conditions", "prefault", "store_command"} <= set(keys)
    assert "errors" not in data and "restore_peer_note" not in data
    assert {"peer_pull", "restore_peer_deleted", "restore_peer"} <= set(data)
    assert data["restore_peer"]["bytes_per_second"] == NB / 0.25 and data["restore_peer"]["pulled_by"] == ["repair"]
    assert "bytes_per_second" not in data["restore_local"]
    assert data["conditions"]["memory_peak_pss_bytes"] == 123 and data["conditions"]["seconds"] == 1.0
    stall = data["targets"]["stall_vs_memcpy"]
    assert stall == {"target": stall["target"], "value": 0.5, "pass": True, "note": ""}
    assert data["restore_durable"] == {"available": False, "note": "measured once per run, for the headline scenario"}
    json.dumps(data, default=json_default)  # plain JSON

    r1 = to_json(ScenarioResult.evaluated(measurement(replicas=1), info, leak()))
    assert "peer_pull" not in r1 and "restore_peer_deleted" not in r1
    assert r1["restore_peer"] is None and r1["restore_peer_note"] == "R=1: none"

    m = measurement()
    m.errors.append("save of step 4: timed out")
    assert to_json(m)["errors"] == ["save of step 4: timed out"]


def test_leak_json() -> None:
    assert to_json(LeakSkipped("--leak-saves 0")) == {"skipped": "--leak-saves 0"}
    assert to_json(LeakSkipped("the leak check failed: x", failed=True)) == {"skipped": "the leak check failed: x", "failed": True}
    data = to_json(leak())
    assert list(data)[:5] == ["size", "saves", "hosts", "replicas", "reference_save"] and "skipped" not in data


def test_endpoints_and_config_are_plain_json() -> None:
    e = Endpoints("e.json", {"h0": "127.0.0.1:1"}, 2, GiB, "0.1.0", "mixed", 0, {"h0": None})
    assert to_json(e)["local_pids"] == {"h0": None}
    cfg = config([])
    assert to_json(cfg)["combos"] == [[2, 2]]  # tuples as lists, as json.dumps writes them


# -- ratios and targets ---------------------------------------------------------------------------------------


def test_ratios() -> None:
    ra, _ = evaluate(measurement(stall=0.05), size_result(tcp_bps=2 * GiB, load_warm=0.5), leak())
    assert ra.stall_p50_over_memcpy == pytest.approx(0.5)  # 50 ms stall vs 100 ms paired copy
    assert ra.torch_save_fsync_over_stall_p50 == pytest.approx(60.0)
    assert ra.stall_p50_over_dcp_async_blocking == pytest.approx(0.125)
    assert ra.replication_over_raw_tcp == pytest.approx((NB / 0.2) / (2 * GiB))
    assert ra.torch_load_warm_over_restore_local == pytest.approx(10.0)
    assert ra.restore_peer_over_raw_tcp == pytest.approx((NB / 0.25) / (2 * GiB))  # the host-loss restore
    assert ra.torch_load_warm_over_restore_peer_deleted == pytest.approx(5.0)
    assert ra.store_rss_over_held_max == pytest.approx(1.5)


TARGET_ORDER = [
    "first_save_stall_vs_memcpy",
    "later_saves_stall_vs_memcpy",
    "committed_vs_raw_tcp_every_save",
    "small_state_stall",
    "per_tensor_save_stall",
    "per_tensor_load",
    "no_shm_save_vs_raw_tcp",
    "no_shm_committed_vs_raw_tcp",
    "no_shm_load_vs_raw_tcp",
    "restore_local_vs_torch_load",
    "restore_peer_vs_raw_tcp",
    "store_rss_vs_held",
    "stall_vs_memcpy",
    "stall_vs_torch_save_fsync",
    "stall_vs_dcp_async_save",
    "replication_vs_raw_tcp",
    "restore_peer_vs_torch_load",
    "rss_growth_over_saves",
]
HEADLINE_ONLY = {"small_state_stall", "per_tensor_save_stall", "per_tensor_load", "no_shm_save_vs_raw_tcp",
                 "no_shm_committed_vs_raw_tcp", "no_shm_load_vs_raw_tcp"}  # fmt: skip


def test_targets_pass_miss_and_na() -> None:
    _, tg = evaluate(measurement(stall=0.05), size_result(), leak(growth=1.0))
    verdicts = {k: t.passed for k, t in tg.items()}
    assert list(verdicts) == TARGET_ORDER
    assert verdicts["stall_vs_memcpy"] is True and verdicts["stall_vs_dcp_async_save"] is True
    assert verdicts["first_save_stall_vs_memcpy"] is True  # 250 ms vs a 100 ms memcpy: 2.5x <= 3x
    assert verdicts["later_saves_stall_vs_memcpy"] is True  # worst later save: 140 ms / 100 ms = 1.4x
    assert verdicts["committed_vs_raw_tcp_every_save"] is False  # 64 MiB in 450 ms is far below 2 GiB/s
    assert verdicts["restore_local_vs_torch_load"] is True  # exactly 10x
    # RSS 3 x NB over held 2 x NB + pool 1 x NB: 1.0x (RSS / held alone, 1.5x, is a reference)
    assert verdicts["store_rss_vs_held"] is True and tg.store_rss_vs_held.value == pytest.approx(1.0)
    assert verdicts["rss_growth_over_saves"] is True
    for key in HEADLINE_ONLY:  # measured once per run: n/a without the run's figures
        assert verdicts[key] is None and "headline" in getattr(tg, key).note, key
    assert tg.passed + tg.missed == len(TARGET_ORDER) - len(HEADLINE_ONLY)

    _, slow = evaluate(measurement(stall=0.2), size_result(), leak(growth=6.0))
    assert slow.stall_vs_memcpy.passed is False and slow.rss_growth_over_saves.passed is False
    assert slow.later_saves_stall_vs_memcpy.passed is False and slow.later_saves_stall_vs_memcpy.value == pytest.approx(2.0)


def test_r1_and_endpoints_targets() -> None:
    _, tg = evaluate(measurement(replicas=1), size_result(), leak())
    for key in ("replication_vs_raw_tcp", "restore_peer_vs_raw_tcp", "restore_peer_vs_torch_load"):
        t: Target = getattr(tg, key)
        assert t.passed is None and t.value is None and t.note.startswith("n/a: R=1")
    _, remote = evaluate(measurement(peer=False), size_result(), leak())  # --endpoints: no host loss
    assert "owner's copy deleted" in remote.restore_peer_vs_raw_tcp.target
    assert remote.restore_peer_vs_torch_load.value == pytest.approx(5.0)


def test_unavailable_dcp_staging_makes_its_ratios_and_target_na() -> None:
    why = "unavailable on torch 2.11.0+cu130: KeyError: <class 'type'> in torch's DCP stager"
    info = size_result()
    info.floors.dcp.reused_stager = DcpMode.not_measured(why)
    ra, tg = evaluate(measurement(), info, leak())
    assert ra.stall_p50_over_dcp_async_blocking_reused_stager is None and ra.stall_p50_over_dcp_async_blocking == pytest.approx(0.125)
    assert ra.unavailable == {"stall_p50_over_dcp_async_blocking_reused_stager": why} and tg.stall_vs_dcp_async_save.passed is True
    assert to_json(info.floors.dcp.reused_stager) == {"blocking_seconds": None, "total_seconds": None, "unavailable": why}

    info.floors.dcp.default = DcpMode.not_measured(why)
    ra, tg = evaluate(measurement(), info, leak())
    assert ra.stall_p50_over_dcp_async_blocking is None and ra.committed_p50_over_dcp_async_total is None
    assert set(to_json(ra)["unavailable"]) == {
        "stall_p50_over_dcp_async_blocking", "stall_p50_over_dcp_async_blocking_reused_stager", "committed_p50_over_dcp_async_total",
    }  # fmt: skip
    t = tg.stall_vs_dcp_async_save
    assert (t.passed, t.value, t.note) == (None, None, f"n/a: DCP async_save (default staging) {why}")
    assert "unavailable" not in to_json(evaluate(measurement(), size_result(), leak())[0])  # every baseline measured: no key


def test_leak_target_when_skipped() -> None:
    _, tg = evaluate(measurement(), size_result(), LeakSkipped("--leak-saves 0"))
    t = tg.rss_growth_over_saves
    assert t.passed is None and t.note == "--leak-saves 0"
    assert t.target == "RSS growth < 5% from save 10 to save - (stores and client; - state, - hosts, R=-; percent)"
    assert isinstance(tg, Targets) and tg.passed + tg.missed == len(TARGET_ORDER) - len(HEADLINE_ONLY) - 1


def test_target_json_uses_pass() -> None:
    assert to_json(Target.check("x <= 1", 2.0, lambda v: v <= 1)) == {"target": "x <= 1", "value": 2.0, "pass": False, "note": ""}
    assert to_json(Target.check("x", None, lambda v: True, "n/a"))["pass"] is None


# -- options and plan ---------------------------------------------------------------------------------------------


def config(argv: list[str]) -> BenchConfig:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return config_from_args(p.parse_args(argv))


def test_config_defaults_and_quick() -> None:
    c = config([])
    assert (c.sizes, c.hosts, c.replicas, c.keep, c.warmup) == ([GiB], [2], [2], 2, 3)
    assert (c.saves, c.restores, c.leak_saves, c.leak_size) == (5, 3, 100, 64 * MiB)
    assert (c.prefault, c.small_saves) == (None, 30)
    q = config(["--quick", "--json", "/tmp/b.json"])
    assert (q.sizes, q.saves, q.restores, q.leak_size, q.plot_path) == ([64 * MiB], 2, 1, 16 * MiB, "/tmp/b.png")
    assert config(["--json", "/tmp/b.json", "--no-plot"]).plot_path is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--size", "1KiB"], "too small"),
        (["--hosts", "9"], "--hosts 9"),
        (["--hosts", "a"], "integers"),
        (["--saves", "0"], "--saves"),
        (["--leak-saves", "5"], "--leak-saves"),
        (["--store-env", "NOVALUE"], "KEY=VALUE"),
        (["--prefault", "lots"], "--prefault"),
        (["--small-saves", "-1"], "--small-saves"),
    ],
)
def test_config_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config(argv)


def test_plan_skips_and_headline() -> None:
    c = config(["--size", "64MiB,1GiB", "--hosts", "2", "--replicas", "1,2,3"])
    scenarios, skipped = plan_scenarios(c, None)
    assert [x.name for x in scenarios] == ["64MiB-2h-R1", "64MiB-2h-R2", "1GiB-2h-R1", "1GiB-2h-R2"]
    assert [x.name for x in scenarios if x.headline] == ["1GiB-2h-R2"]
    assert (c.size, c.hosts_headline, c.replicas_headline) == (GiB, 2, 2)
    assert skipped[0].size is None and "R=3 needs at least 3 hosts" in skipped[0].reason
    assert "ram_need" not in to_json(skipped[0])

    small = config(["--size", "1GiB", "--max-ram", "1GiB"])
    scenarios, skipped = plan_scenarios(small, None)
    assert not scenarios and skipped[0].ram_need is not None and "--max-ram" in skipped[0].reason
    assert to_json(skipped[0])["ram_need"]["total_bytes"] == ram_need(GiB, 2, 2, 2).total_bytes


def test_ram_need() -> None:
    need = ram_need(GiB, 2, 4, 2)
    assert need.total_bytes == need.stores_bytes + need.bench_bytes + need.processes_bytes
    assert need.one_rank_per_host_bytes == need.stores_bytes * 4 + need.bench_bytes + need.processes_bytes
    assert need.stores_bytes >= 3 * GiB * 2
