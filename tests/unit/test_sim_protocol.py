"""Unit tests for memstore.sim.protocol: the restore protocol's messages and restart timeline (``memstore simulate protocol``)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from memstore.cli import main as memstore_main
from memstore.sim import ProtocolConfig, run_protocol, run_protocol_sweep
from memstore.sim.cli import main
from memstore.sim.protocol import group, growth, growth_exponent, legacy, transfer_seconds

pytestmark = pytest.mark.unit

SMALL = ProtocolConfig(hosts=4, ranks_per_host=2, replicas=2, keep=2)  # W = 8


# --------------------------------------------------------------------------------------------------
# Message counts
# --------------------------------------------------------------------------------------------------


def test_message_counts_by_hand_4_hosts_2_ranks_2_replicas() -> None:
    leg, grp, fb = legacy(SMALL), group(SMALL), group(SMALL, fallback=True)
    # legacy: each of 8 ranks asks twice; each ask = 1 LatestStep + 3 ListShards (one per other store).
    assert leg.rpcs_per_rank == 8 and leg.rpcs_max_per_rank == 8
    assert leg.rpcs_total == 64 and leg.list_shards_total == 48
    assert leg.list_shards_served_per_store == 12  # 48 spread over 4 stores: 2 rounds x the 6 ranks on other hosts
    assert leg.collectives == 0
    # group: each rank 1 LatestStep + 1 ListShards (its one group peer); each store serves its peer's 2 ranks.
    assert grp.rpcs_per_rank == 2 and grp.rpcs_total == 16 and grp.list_shards_total == 8
    assert grp.list_shards_served_per_store == 2
    assert grp.collectives == 3 and grp.durable_listings == 1
    # fallback: rank 0 asks its store cluster-wide once (1 + 3 RPCs) and shares the answer: length + bytes, 2 collectives.
    assert fb.rpcs_total == 20 and fb.list_shards_total == 11 and fb.rpcs_max_per_rank == 2 + 4
    assert fb.rpcs_per_rank == pytest.approx(20 / 8)
    assert fb.list_shards_served_per_store == 3 and fb.collectives == 5
    # Restore RPCs are the same for both: Fetch + Open per rank, one pull per shard of the replaced host.
    assert leg.restore_rpcs == grp.restore_rpcs == 2 * 8 + 1 * 2
    # 2 steps x (8 shards + 8 manifests + 1) = 34 objects: one LIST request per listing.
    assert SMALL.durable_objects == 34 and SMALL.durable_pages == 1


def test_durable_listings_legacy_2w_or_w_when_cached_group_one() -> None:
    # Without the listing cache every ask lists the durable tier: 2W; the group protocol lists it once.
    nocache = replace(SMALL, durable_cache_s=0.0)
    assert legacy(nocache).durable_listings == 2 * 8 and legacy(nocache).durable_list_requests == 16
    assert group(nocache).durable_listings == 1
    assert group(nocache, fallback=True).durable_listings == 2  # the fallback's listing can't reuse a cache of 0 s
    # With the 1 s cache, a small job's second ask comes back within the cache: W listings; the fallback reuses it.
    assert legacy(SMALL).durable_listings == 8
    assert group(SMALL, fallback=True).durable_listings == 1
    # At 1,000 hosts the second ask's fan-out alone outlasts the cache: 2W again.
    big = replace(SMALL, hosts=1000, ranks_per_host=8)
    assert legacy(big).durable_listings == 2 * 8000 and group(big).durable_listings == 1
    assert legacy(big).durable_list_requests == 2 * 8000 * big.durable_pages
    # No durable tier: nothing listed, no time spent on it.
    off = replace(big, durable=False)
    for cost in (legacy(off), group(off), group(off, fallback=True)):
        assert cost.durable_listings == 0 and cost.durable_list_requests == 0
        assert cost.phases["latest_step.durable_listing"] == 0.0


@pytest.mark.parametrize("replicas", [2, 3])
def test_legacy_rpcs_per_rank_grow_linearly_group_stays_constant(replicas: int) -> None:
    hosts = [8, 64, 512, 4096]
    points = run_protocol_sweep(ProtocolConfig(hosts=8, replicas=replicas), hosts)
    for n, p in zip(hosts, points, strict=True):
        assert p.costs["legacy"].rpcs_per_rank == 2 * n
        assert p.costs["legacy"].list_shards_served_per_store == 2 * 8 * (n - 1)
        assert p.costs["group"].rpcs_per_rank == replicas
        assert p.costs["group"].list_shards_served_per_store == 8 * (replicas - 1)
        assert p.costs["legacy"].rpcs_total == 2 * 8 * n * n  # 2 G N^2
    exps = growth(points)
    assert exps["rpcs_per_rank"]["legacy"] == pytest.approx([1.0, 1.0, 1.0])
    assert exps["rpcs_per_rank"]["group"] == [0.0, 0.0, 0.0]
    assert exps["rpcs_total"]["legacy"] == pytest.approx([2.0, 2.0, 2.0])
    assert exps["rpcs_total"]["group"] == pytest.approx([1.0, 1.0, 1.0])
    assert exps["collectives"]["group"] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("hosts", [2, 4, 33, 1000, 10000])
def test_fallback_adds_n_minus_1_list_shards_and_two_collectives(hosts: int) -> None:
    cfg = ProtocolConfig(hosts=hosts)
    plain, fb = group(cfg), group(cfg, fallback=True)
    assert fb.list_shards_total - plain.list_shards_total == hosts - 1
    assert fb.rpcs_total - plain.rpcs_total == hosts  # ... plus rank 0's one request to its own store
    assert fb.collectives - plain.collectives == 2  # trainer_client.agreement shares the answer as length, then bytes
    assert fb.phases["latest_step.fallback"] >= 2 * cfg.collective_s + cfg.rpc_s
    assert fb.phases["latest_step.fallback"] > 0 and "latest_step.fallback" not in plain.phases
    assert fb.latest_step_s > plain.latest_step_s
    assert fb.load_s == plain.load_s  # load(group=pg) reuses the agreed answer either way


def test_expected_row_mixes_by_probability() -> None:
    assert "group_expected" not in run_protocol(ProtocolConfig(hosts=100)).costs
    point = run_protocol(ProtocolConfig(hosts=100, fallback_probability=0.25))
    plain, fb, mix = point.costs["group"], point.costs["group_fallback"], point.costs["group_expected"]
    assert mix.rpcs_total == pytest.approx(0.75 * plain.rpcs_total + 0.25 * fb.rpcs_total)
    assert mix.collectives == pytest.approx(0.75 * 3 + 0.25 * 5)
    assert mix.restart_s == pytest.approx(0.75 * plain.restart_s + 0.25 * fb.restart_s)


# --------------------------------------------------------------------------------------------------
# Timeline
# --------------------------------------------------------------------------------------------------


def test_timeline_is_monotone_in_n_and_legacy_explodes() -> None:
    hosts = [4, 16, 64, 256, 1024, 4096, 16384]
    points = run_protocol_sweep(ProtocolConfig(hosts=4), hosts)
    for proto in ("legacy", "group", "group_fallback"):
        for attr in ("latest_step_s", "load_s", "restart_s"):
            values = [getattr(p.costs[proto], attr) for p in points]
            assert values == sorted(values), (proto, attr, values)
    legacy_restart = [p.costs["legacy"].restart_s for p in points]
    assert legacy_restart[-1] > 100 * legacy_restart[0]
    group_restart = [p.costs["group"].restart_s for p in points]
    assert group_restart[-1] < 2 * group_restart[0]  # start + restore dominate at every scale
    assert all(p.costs["group"].restart_s < p.costs["legacy"].restart_s for p in points)


def test_phases_follow_the_formulas() -> None:
    cfg = ProtocolConfig(hosts=10000, durable=False)  # G=8, R=2, K=2, P=32
    w, g = cfg.world, cfg.ranks_per_host
    svc = cfg.list_service_s + g * 2 * 2 * cfg.list_entry_s
    assert cfg.list_service_total_s == pytest.approx(svc)
    leg = legacy(cfg)
    # Each store serves W - G ListShards per round, one at a time: the queue bounds the fan-out, not the pool.
    queue = (w - g) * svc + cfg.rpc_s + cfg.list_transfer_s
    pool = math.ceil(g * (cfg.hosts - 1) / cfg.fanout_threads) * cfg.list_round_trip_s
    assert queue > pool
    assert leg.phases["latest_step.peer_listing"] == pytest.approx(queue)
    assert leg.phases["load.query"] == pytest.approx(cfg.rpc_s + queue)  # asks again; no durable tier to list
    assert leg.restart_s == pytest.approx(sum(leg.phases.values()))
    assert leg.restart_s == pytest.approx(cfg.start_s + leg.latest_step_s + leg.load_s)
    # Replaced host: legacy pulls its G shards through one stream one after another, group pulls them at once.
    one = transfer_seconds(cfg.shard_gb, cfg.stream_gbps)
    assert leg.phases["load.data"] == pytest.approx(g * (cfg.rpc_s + one))
    grp = group(cfg)
    rate = min(g * cfg.stream_gbps, cfg.link_gbps)
    assert grp.phases["load.data"] == pytest.approx(cfg.rpc_s + transfer_seconds(g * cfg.shard_gb, rate))
    assert grp.phases["load.query"] == 0.0
    # 3 collectives of 2 * ceil(log2 80000) = 34 hops each.
    assert cfg.collective_s == pytest.approx(cfg.collective_hop_s * 34)
    assert grp.phases["latest_step.collectives"] == pytest.approx(3 * 34 * cfg.collective_hop_s)
    # No replaced host: every rank reads local RAM.
    healthy = replace(cfg, failed_hosts=0)
    assert legacy(healthy).phases["load.data"] == group(healthy).phases["load.data"] == transfer_seconds(1.0, cfg.local_gbps)


def test_durable_listings_queue_at_the_prefix_rate_limit() -> None:
    cfg = ProtocolConfig(hosts=1000)  # W = 8000; 2 x (16,000 + 1) objects = 33 pages per listing
    assert cfg.durable_pages == 33
    leg, grp = legacy(cfg), group(cfg)
    assert leg.phases["latest_step.durable_listing"] == pytest.approx(8000 * 33 / cfg.durable_list_rate)
    assert grp.phases["latest_step.durable_listing"] == pytest.approx(cfg.durable_list_s + cfg.durable_list_per_1000_s * 32.002)
    faster = replace(cfg, durable_list_rate=cfg.durable_list_rate * 10)
    assert legacy(faster).latest_step_s < leg.latest_step_s
    assert group(faster).latest_step_s == grp.latest_step_s  # one listing never hits the limit


def test_growth_exponent() -> None:
    assert growth_exponent(10, 1.0, 100, 100.0) == pytest.approx(2.0)
    assert growth_exponent(10, 5.0, 1000, 5.0) == 0.0
    assert growth_exponent(10, 0.0, 100, 0.0) == 0.0
    assert growth_exponent(10, 0.0, 100, 3.0) is None
    assert growth_exponent(10, 1.0, 10, 2.0) is None


def test_deterministic_and_validated() -> None:
    a, b = run_protocol(ProtocolConfig(hosts=1234)), run_protocol(ProtocolConfig(hosts=1234))
    assert a.to_dict() == b.to_dict()
    with pytest.raises(ValueError, match="--replicas 5 is more than --hosts 4"):
        ProtocolConfig(hosts=4, replicas=5)
    with pytest.raises(ValueError, match="--failed-hosts"):
        ProtocolConfig(hosts=4, replicas=1)


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def test_cli_prints_and_writes_the_tables(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    out, md = tmp_path / "p.json", tmp_path / "p.md"
    argv = ["protocol", "--hosts", "32,1000,10000", "--json", str(out), "--markdown", str(md)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    for needle in ("legacy (no process group)", "group + fallback", "restart timeline", "growth with N", "not measurements"):
        assert needle in text
    doc = json.loads(out.read_text())
    assert doc["tool"] == "memstore simulate protocol" and doc["version"] == 1 and "not measurements" in doc["note"]
    assert doc["parameters"]["hosts"] == [32, 1000, 10000] and doc["parameters"]["replicas"] == 2
    assert [p["hosts"] for p in doc["points"]] == [32, 1000, 10000]
    assert [p["protocols"]["legacy"]["rpcs_per_rank"] for p in doc["points"]] == [64, 2000, 20000]
    assert [p["protocols"]["group"]["rpcs_per_rank"] for p in doc["points"]] == [2, 2, 2]
    for p in doc["points"]:
        assert set(p["protocols"]) == {"legacy", "group", "group_fallback"}
        for cost in p["protocols"].values():
            assert cost["restart_s"] == pytest.approx(sum(cost["phases"].values()))
    assert doc["growth"]["rpcs_per_rank"]["legacy"] == pytest.approx([1.0, 1.0])
    assert doc["growth"]["durable_listings"]["group"] == [0.0, 0.0]
    assert doc["complexity"]["rpcs_per_rank"]["legacy"].startswith("O(N)")
    markdown = md.read_text()
    assert "| hosts | ranks | protocol |" in markdown and "| 10,000 | 80,000 | legacy (no process group) | 20,000 |" in markdown
    # Through the `memstore` command, same document.
    again = tmp_path / "again.json"
    assert memstore_main(["simulate", "protocol", "--hosts", "32,1000,10000", "--no-table", "--json", str(again)]) == 0
    assert json.loads(again.read_text()) == doc


def test_cli_flags_reach_the_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "p.json"
    flags = "--hosts 100 --ranks-per-host 4 --replicas 3 --rpc-ms 2 --collective-hop-us 50 --no-durable --fallback-probability 0.5"
    argv = ["protocol", *flags.split(), "--no-table", "--json", str(out)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    params, point = doc["parameters"], doc["points"][0]
    assert params["rpc_s"] == pytest.approx(0.002) and params["collective_hop_s"] == pytest.approx(50e-6) and params["durable"] is False
    assert point["ranks"] == 400
    assert point["protocols"]["group"]["rpcs_per_rank"] == 3
    assert point["protocols"]["group"]["durable_listings"] == 0
    assert point["protocols"]["group_expected"]["collectives"] == pytest.approx(4.0)  # half 3, half 5


@pytest.mark.parametrize(
    ("argv", "flag", "value"),
    [
        (["protocol", "--hosts", "0"], "--hosts", "0"),
        (["protocol", "--hosts", "32,abc"], "--hosts", "abc"),
        (["protocol", "--replicas", "0"], "--replicas", "0"),
        (["protocol", "--hosts", "2", "--replicas", "3"], "--replicas", "3"),
        (["protocol", "--hosts", "4", "--failed-hosts", "4"], "--failed-hosts", "4"),
        (["protocol", "--replicas", "1"], "--failed-hosts", "1"),
        (["protocol", "--rpc-ms", "-1"], "--rpc-ms", "-1"),
        (["protocol", "--stream-gbps", "nan"], "--stream-gbps", "nan"),
        (["protocol", "--durable-list-rate", "0"], "--durable-list-rate", "0"),
        (["protocol", "--fallback-probability", "1.5"], "--fallback-probability", "1.5"),
        (["protocol", "--ranks-per-host", "two"], "--ranks-per-host", "two"),
        (["--days", "3", "protocol"], "--days", "protocol"),
        (["protocol", "--bogus"], "--bogus", "--bogus"),
    ],
)
def test_cli_rejects_bad_flags(argv: list[str], flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "memstore simulate" in err and "error:" in err
    assert flag in err and value in err


def test_cli_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["protocol", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: memstore simulate protocol") and "--fanout-threads" in out and "--no-durable" in out
    assert main(["--help"]) == 0
    assert "protocol" in capsys.readouterr().out  # the sweep's help names the mode
