"""The save-path and gossip model of ``memstore simulate protocol``: what grows with N and what does not."""

from __future__ import annotations

import pytest

from memstore.sim.report import save_path_markdown, save_rows
from memstore.sim.save_path_model import SaveConfig, gossip_rounds, save_cost, save_growth

pytestmark = pytest.mark.unit


def test_today_lists_every_store_and_the_floor_costs_o_r_per_store() -> None:
    small, big = save_cost(SaveConfig(32, replicas=2)), save_cost(SaveConfig(10_000, replicas=2))
    assert small.list_per_store == 31 and small.save_total_today == 32 * (3 + 1 + 31)
    assert small.save_per_store_floor == big.save_per_store_floor == 3 + 1
    assert save_cost(SaveConfig(32, replicas=3)).save_per_store_floor == 3 + 2
    exps = save_growth([small, save_cost(SaveConfig(1000)), big])
    assert exps["save_total_today"][-1] == pytest.approx(2.0, abs=0.01)
    assert exps["save_total_floor"] == [pytest.approx(1.0), pytest.approx(1.0)]
    assert exps["save_per_store_floor"] == [0.0, 0.0]
    assert exps["hello_bytes_per_store_push_pull"] == [0.0, 0.0]
    assert exps["hello_bytes_per_store_full"][-1] == pytest.approx(1.0, abs=0.01)


def test_gossip_rounds_grow_like_log_n_and_push_pull_is_not_slower() -> None:
    for n in (8, 32, 1000, 10_000):
        assert gossip_rounds(n, 3) <= gossip_rounds(n, 3, push=False)
    assert gossip_rounds(10_000, 3) <= 2 * gossip_rounds(100, 3)
    assert gossip_rounds(10_000, 1) > gossip_rounds(10_000, 3)


def test_the_table_has_a_column_per_host_count() -> None:
    costs = [save_cost(SaveConfig(n)) for n in (8, 1000)]
    headers, rows = save_rows(costs)
    assert headers[1:3] == ["N=8", "N=1,000"] and len(rows[0]) == len(headers)
    assert "| List per store (today) | 7 | 999 |" in save_path_markdown(costs)


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError):
        SaveConfig(1)
    with pytest.raises(ValueError):
        SaveConfig(4, replicas=5)


def test_model_fanout_is_the_store_s() -> None:
    from memstore.server.discovery import GOSSIP_FANOUT

    assert SaveConfig(4).fanout == GOSSIP_FANOUT
