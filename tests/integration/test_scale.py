"""The restore protocol on 32 real store processes: what latest_step() and a full restore cost per rank."""

from __future__ import annotations

import json

import pytest

from tools import scale

pytestmark = [pytest.mark.integration, pytest.mark.slow]
HOSTS, R = 32, 2


def test_agreement_costs_each_rank_a_constant_number_of_calls_at_32_hosts() -> None:
    result = scale.run(hosts=HOSTS, ranks_per_host=1, replicas=R)
    print(json.dumps(result, indent=1))
    cluster_wide, agreed = result["latest_step"], result["latest_step_group"]
    # Without a group every rank's store lists every other store: 1 + (hosts - 1) calls per rank.
    assert cluster_wide["calls"] == {"LatestStep": HOSTS, "List": HOSTS * (HOSTS - 1)}
    # With one: its store asks its placement group only, 1 + (R - 1) per rank, whatever the host count.
    assert agreed["calls"] == {"LatestStep": HOSTS, "List": HOSTS * (R - 1)}
    # A full restore after a replacement: the replaced host's ranks pull from its group peer either way.
    assert {*result["restore"]["replaced_host_sources"], *result["restore_group"]["replaced_host_sources"]} <= {"h0", "h1"}
    assert result["restore_group"]["calls"].get("List", 0) <= HOSTS * (R - 1) + 2 * (R - 1)  # + the replacement's own asks
    # Without a group every store lists every other; the replacement's own store may list fewer (its member table can
    # still be filling by gossip when its ranks ask), so only the other hosts' ranks are counted whole.
    assert result["restore"]["calls"]["List"] >= (HOSTS - 1) * (HOSTS - 1)
    assert result["restore_group"]["calls_per_rank"] * 4 < result["restore"]["calls_per_rank"]


def test_gossip_hello_rate_per_store_is_independent_of_n_and_a_change_converges_in_log_rounds() -> None:
    from memstore.sim.save_path_model import gossip_rounds

    small, large = scale.run_gossip(16), scale.run_gossip(HOSTS)
    print(json.dumps([small, large], indent=1))
    rate16, rate32 = small["idle"]["hello_per_store_per_s"], large["idle"]["hello_per_store_per_s"]
    assert 0 < rate32 <= 1.5 * rate16
    # Each store asks GOSSIP_FANOUT members per 0.5 s round and answers as many: about 3 / 0.5 Hellos served per second.
    assert rate32 <= 2 * large["fanout"] / large["interval"]
    # A change one store's source sees reaches all 32 by gossip within a few times the model's O(log N) rounds
    # (plus a round of slack for polling every store's Hello on a loaded machine).
    assert large["convergence"]["rounds"] <= 3 * gossip_rounds(HOSTS, large["fanout"]) + 2
    # A gossip answer to a store holding the same table leaves the table and member list out: its size does not grow.
    assert large["hello_bytes"]["gossip"] <= small["hello_bytes"]["gossip"] + 16
    assert 2 * large["hello_bytes"]["gossip"] < large["hello_bytes"]["full"]
