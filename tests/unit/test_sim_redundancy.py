"""The simulator under erasure coding (ec:K+M) and side by side with replicas (issue 42)."""

from __future__ import annotations

import json
import re
from fractions import Fraction

import pytest

from memstore.core.placement import make_placement, recovery_probability_exact
from memstore.core.redundancy import Redundancy
from memstore.sim.cli import main
from memstore.sim.redundancy_compare import compare, comparison_schemes
from memstore.sim.replay import FailureEvent, SimConfig, ram_recovery_probability, simulate

pytestmark = pytest.mark.unit

EC = dict(replicas=1, redundancy="ec:4+1")


def test_ec_costs_against_replicas() -> None:
    """Per host: 100 GB. ec:4+1 holds 1.25x and sends one shard of parity contributions, as replicas:2 sends its one
    copy; a lost host is rebuilt from 4 blocks per block through its one NIC: 4x a replica's restore."""
    ec = SimConfig(hosts=10, checkpoint_gb=1000, network_gbps=400, **EC)
    r2 = SimConfig(hosts=10, checkpoint_gb=1000, network_gbps=400, replicas=2)
    assert ec.scheme == Redundancy.erasure(4, 1) and r2.scheme == Redundancy.of_replicas(2)
    assert (ec.ram_multiple, r2.ram_multiple) == (1.25, 2.0)
    assert ec.replication_lag_seconds == r2.replication_lag_seconds == pytest.approx(2.0)  # 100 GB at 400 Gbps
    assert r2.ram_load_seconds == pytest.approx(2.0) and ec.ram_load_seconds == pytest.approx(8.0)
    assert ec.derived()["ram_gb_per_host"] == pytest.approx(125) and ec.derived()["redundancy"] == "ec:4+1"
    two_parities = SimConfig(hosts=12, checkpoint_gb=1200, network_gbps=400, replicas=1, redundancy="ec:4+2")
    assert two_parities.replication_lag_seconds == pytest.approx(4.0)  # M=2: two shards' worth of contributions


def test_remainder_hosts_join_the_last_group_and_count_in_k() -> None:
    ec = SimConfig(hosts=11, checkpoint_gb=1100, network_gbps=400, **EC)  # groups of 5 and 6: K' = 5 in the larger
    assert ec.data_columns == 5
    assert ec.ram_multiple == pytest.approx(1.2) and ec.ram_load_seconds == pytest.approx(10.0)


def test_ram_recovery_probability_is_the_placements() -> None:
    ec = SimConfig(hosts=10, **EC)
    p = make_placement("mixed", [f"h{i}" for i in range(10)], Redundancy.erasure(4, 1))
    for k in range(11):
        assert ram_recovery_probability(ec, k) == pytest.approx(float(recovery_probability_exact(p, k)))
    assert ram_recovery_probability(ec, 2) == pytest.approx(float(Fraction(25, 45)))


def test_two_losses_in_one_group_fall_back_to_the_durable_tier() -> None:
    ec = SimConfig(hosts=5, failures_per_gpu_hour=0.0, days=1, **EC)  # one group of 5: one loss survives, two do not
    one = simulate(ec, [FailureEvent(100.0, 1, 0.99)], "memstore")
    assert (one.ram_recoveries, one.durable_fallbacks) == (1, 0)
    two = simulate(ec, [FailureEvent(100.0, 2, 0.0)], "memstore")
    assert (two.ram_recoveries, two.durable_fallbacks) == (0, 1)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(hosts=4, **EC), "needs at least 5 hosts"),
        (dict(hosts=10, replicas=2, redundancy="ec:4+1"), "--replicas 2 and --redundancy ec:4+1 disagree"),
        (dict(hosts=10, replicas=1, redundancy="ec:4"), "--redundancy 'ec:4' is invalid"),
        (dict(hosts=10, placement="ring", **EC), "--placement ring does not apply"),
    ],
)
def test_bad_ec_configs_name_the_flags(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SimConfig(**fields)  # type: ignore[arg-type]


def test_comparison_schemes() -> None:
    ec = Redundancy.erasure(4, 1)
    assert [str(s) for s in comparison_schemes(ec, "auto")] == ["ec:4+1", "replicas:2", "replicas:1"]
    assert [str(s) for s in comparison_schemes(Redundancy.erasure(4, 4), "auto")] == ["ec:4+4", "replicas:5", "replicas:2"]
    assert [str(s) for s in comparison_schemes(ec, "replicas:3,ec:4+1,replicas:2")] == ["ec:4+1", "replicas:3", "replicas:2"]
    with pytest.raises(ValueError, match="auto compares an ec:K\\+M"):
        comparison_schemes(Redundancy.of_replicas(2), "auto")
    with pytest.raises(ValueError, match="'raid5'"):
        comparison_schemes(ec, "raid5")


def test_comparison_replays_the_same_traces() -> None:
    cfg = SimConfig(hosts=20, trials=3, days=3, failures_per_gpu_hour=1e-3, burst_hosts=2, correlated_fraction=0.5, **EC)
    rows = compare(cfg, comparison_schemes(cfg.scheme, "auto"))
    assert [r.redundancy for r in rows] == ["ec:4+1", "replicas:2", "replicas:1"]
    assert len({r.memstore.failure_events for r in rows}) == 1 and rows[0].memstore.failure_events > 0  # one set of traces
    ec, r2, r1 = rows
    assert (ec.ram_multiple, r2.ram_multiple, r1.ram_multiple) == (1.25, 2.0, 1.0)
    assert ec.p_recover_one == r2.p_recover_one == 1.0 and r1.p_recover_one == 0.0
    assert ec.p_recover_burst < r2.p_recover_burst  # two hosts in one group of 5 are more likely than both of a pair
    assert r1.memstore.ram_recoveries == 0 and ec.memstore.ram_recoveries > 0
    assert ec.restore_seconds == pytest.approx(4 * r2.restore_seconds)


def test_cli_compares_ec_with_replicas(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    out, md = tmp_path / "sim.json", tmp_path / "sim.md"
    argv = ["--hosts", "10,100", "--trials", "2", "--days", "2", "--redundancy", "ec:4+1", "--compare-redundancy"]
    assert main([*argv, "--json", str(out), "--markdown", str(md)]) == 0
    printed = capsys.readouterr().out
    assert "ec:4+1 mixed" in printed and "redundancy schemes on the same traces" in printed
    doc = json.loads(out.read_text())
    assert doc["parameters"]["redundancy"] == "ec:4+1" and doc["parameters"]["replicas"] == 1
    rows = doc["redundancy_comparison"]
    assert [(r["hosts"], r["redundancy"]) for r in rows] == [(n, s) for n in (10, 100) for s in ("ec:4+1", "replicas:2", "replicas:1")]
    assert [r["ram_multiple"] for r in rows[:3]] == [1.25, 2.0, 1.0]
    assert "Redundancy schemes on the same traces" in md.read_text()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--redundancy", "ec:4+1", "--replicas", "3"], "--replicas 3 and --redundancy ec:4+1 disagree"),
        (["--redundancy", "ec:4+"], "--redundancy 'ec:4+' is invalid"),
        (["--hosts", "16,4", "--redundancy", "ec:4+1"], "--redundancy ec:4+1 needs at least 5 hosts (K+M), more than --hosts 4"),
        (["--hosts", "16", "--compare-redundancy"], "--compare-redundancy: --compare-redundancy auto compares an ec:K+M"),
        (["--hosts", "6", "--redundancy", "ec:4+1", "--compare-redundancy", "replicas:7"], "replicas:7 needs 7 hosts"),
    ],
)
def test_cli_rejects_bad_redundancy(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--trials", "1", "--days", "1", *argv]) == 2
    assert message in capsys.readouterr().err
