"""Slot tables: who holds which slot as members come and go, and how stores agree on one table."""

from __future__ import annotations

import itertools
import random

import pytest

from memstore.core.redundancy import Redundancy
from memstore.core.slots import FORMER_KEPT, SlotTable, SlotTableError, next_table
from memstore.server.membership import Membership

pytestmark = pytest.mark.unit


def members(*ids: str, domains: dict[str, str] | None = None) -> dict[str, tuple[str, str]]:
    return {h: (f"127.0.0.1:{7000 + int(h[1:])}", (domains or {}).get(h, "")) for h in ids}


def holders(t: SlotTable) -> list[str]:
    return [s.host_id for s in t.slots]


def test_first_table_takes_the_sources_order() -> None:
    t = next_table(SlotTable(), members("h3", "h1", "h2"))
    assert t.version == 1
    assert holders(t) == ["h3", "h1", "h2"]
    assert t.placement("mixed", 2) is not None
    assert next_table(t, members("h3", "h1", "h2")) is t  # no change, no new version


def test_replacement_under_a_new_name_takes_the_vacant_slot() -> None:
    t1 = next_table(SlotTable(), members("h1", "h2", "h3", "h4"))
    t2 = next_table(t1, members("h1", "h3", "h4", "h5"))
    assert holders(t2) == ["h1", "h5", "h3", "h4"]
    assert t2.slots[1].former == ("h2",)
    assert t2.version == 2
    # The placement over slots is unchanged: every group keeps its slots.
    assert t1.placement("mixed", 2) == t2.placement("mixed", 2)
    # h2's shards belong to slot 1, now held by h5.
    owner = t2.owner_slot("h2")
    assert owner is not None and owner.index == 1 and owner.host_id == "h5"


def test_loss_then_join_equals_both_at_once() -> None:
    t1 = next_table(SlotTable(), members("h1", "h2", "h3", "h4"))
    stepwise = next_table(next_table(t1, members("h1", "h3", "h4")), members("h1", "h3", "h4", "h5"))
    at_once = next_table(t1, members("h1", "h3", "h4", "h5"))
    assert stepwise.slots == at_once.slots
    assert stepwise.version == at_once.version + 1  # versions differ; content (and placement) agree


def test_join_with_no_vacancy_adds_a_slot() -> None:
    t1 = next_table(SlotTable(), members("h1", "h2", "h3", "h4"))
    t2 = next_table(t1, members("h1", "h2", "h3", "h4", "h5"))
    assert holders(t2) == ["h1", "h2", "h3", "h4", "h5"]
    p = t2.placement("mixed", 2)
    assert p is not None and len(p.hosts) == 5


def test_same_host_back_keeps_its_slot_even_after_others_joined() -> None:
    t1 = next_table(SlotTable(), members("h1", "h2", "h3"))
    t2 = next_table(t1, members("h1", "h3"))  # h2 gone: slot 1 vacant
    t3 = next_table(t2, members("h1", "h3", "h9", "h2"))  # h9 listed before h2, but h2 reclaims its slot
    assert holders(t3) == ["h1", "h2", "h3", "h9"]


def test_former_holders_are_bounded_and_the_latest_tenure_wins() -> None:
    t = next_table(SlotTable(), members("h1", "h2"))
    for i in range(3, 3 + FORMER_KEPT + 3):
        t = next_table(t, members("h1", f"h{i}"))
    assert len(t.slots[1].former) == FORMER_KEPT
    assert t.owner_slot("h2") is None  # forgotten long ago
    assert t.owner_slot("h1") == t.slots[0]


def test_domains_apply_when_every_slot_is_labelled() -> None:
    doms = {"h1": "a", "h2": "a", "h3": "b", "h4": "b"}
    t = next_table(SlotTable(), members("h1", "h2", "h3", "h4", domains=doms))
    p = t.placement("mixed", 2)
    assert p is not None
    for group in p.groups():
        assert len({t.slots[int(n[4:])].domain for n in group}) == 2


def test_fewer_slots_than_replicas_caps_r() -> None:
    t = next_table(SlotTable(), members("h1"))
    p = t.placement("mixed", 2)
    assert p is not None and p.replicas == 1


def test_tables_order_by_version_then_digest_and_round_trip() -> None:
    base = next_table(SlotTable(), members("h1", "h2", "h3"))
    a = next_table(base, members("h1", "h3", "h5"))
    b = next_table(base, members("h1", "h3", "h6"))
    assert a.version == b.version and a.digest != b.digest
    assert a.newer_than(b) != b.newer_than(a)
    assert a.newer_than(base) and not base.newer_than(a)
    assert SlotTable.from_dict(a.to_dict()) == a


@pytest.mark.parametrize(
    "bad",
    [
        {"version": 1},
        {"version": "1", "slots": []},
        {"version": 1, "slots": "x"},
        {"version": 1, "slots": [{"index": 1, "host_id": "h1", "address": "a:1"}]},
        {"version": 1, "slots": [{"index": 0, "host_id": "h1", "address": ""}]},
        {"version": 1, "slots": [{"index": 0, "host_id": "h1", "address": "a:1"}, {"index": 1, "host_id": "h1", "address": "a:2"}]},
        {"version": 0, "slots": [{"index": 0, "host_id": "h1", "address": "a:1"}]},
        {"version": 1, "slots": [{"index": 0, "host_id": "", "address": "a:1"}]},
        {"version": 1, "slots": [7]},
        {"version": 1, "slots": [{"index": 0, "host_id": "h1", "address": "a:1", "former": ["h0"], "former_until": []}]},
    ],
)
def test_malformed_tables_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(SlotTableError):
        SlotTable.from_dict(bad)


def test_stores_seeing_changes_in_different_orders_converge() -> None:
    """Gossip model of memstore.server.membership: a store applies its source's *changes*, and adopts (without
    re-applying) any newer table. Once every source has delivered the final membership, gossip alone converges."""
    rng = random.Random(7)
    start = next_table(SlotTable(), members("h1", "h2", "h3", "h4"))
    final_view = members("h1", "h4", "h6", "h5", "h7")
    for order in itertools.permutations(["-h2", "-h3", "+h5", "+h6", "+h7"]):
        tables: list[SlotTable] = []
        for cut in (1, 3, 5):  # three stores see the changes in batches split at different places
            view = dict(members("h1", "h2", "h3", "h4"))
            t = start
            for batch in (order[:cut], order[cut:]):
                for change in batch:
                    if change[0] == "-":
                        view.pop(change[1:])
                    else:
                        view[change[1:]] = final_view[change[1:]]
                t = next_table(t, view)
            tables.append(t)
        for _ in range(60):  # gossip: adopt a newer table, never re-apply the (unchanged) view
            i, j = rng.sample(range(len(tables)), 2)
            if tables[j].newer_than(tables[i]):
                tables[i] = tables[j]
        assert len({t.digest for t in tables}) == 1, order
        assert set(tables[0].members()) == set(final_view), order


def test_a_host_that_held_two_slots_maps_to_the_one_it_left_last() -> None:
    t = next_table(SlotTable(), members("h1", "h2", "h3"))
    t = next_table(t, members("h1", "h2"))  # h3 leaves slot 2
    t = next_table(t, members("h1", "h2", "h8"))  # h8 takes slot 2
    t = next_table(t, members("h1", "h2", "h8", "h3"))  # h3 back: slot 2 is taken, it gets slot 3
    assert t.slot_of("h3") is not None and t.slot_of("h3").index == 3  # type: ignore[union-attr]
    t = next_table(t, members("h1", "h2"))  # h8 and h3 leave (slots 2 and 3 vacant)
    owner = t.owner_slot("h3")
    assert owner is not None and owner.index == 3  # its latest shards were written in slot 3, not slot 2
    t = next_table(t, members("h1", "h2", "h3"))  # h3 returns to the slot it left last
    assert t.slot_of("h3").index == 3  # type: ignore[union-attr]


def test_addresses_are_a_local_view_and_never_bump_the_version() -> None:
    t1 = next_table(SlotTable(), members("h1", "h2"))
    via_proxy = dict(members("h1", "h2"))
    via_proxy["h2"] = ("127.0.0.1:9999", "")
    t2 = next_table(t1, via_proxy)
    assert t2.version == t1.version and t2.digest == t1.digest and t2.same_assignment(t1)
    assert t2.slots[1].address == "127.0.0.1:9999"
    assert not t2.newer_than(t1) and not t1.newer_than(t2)  # two stores with different routes do not fight


def test_a_vacant_group_slot_is_stood_in_for() -> None:
    from memstore.server.membership import ClusterView

    t = next_table(next_table(SlotTable(), members("h1", "h2", "h3", "h4")), members("h1", "h3", "h4"))  # slot 1 vacant
    view = ClusterView("h1", t, t.placement("mixed", 2))
    assert view.replication_targets() == ["h3"]  # slot 1 (h1's group peer) is vacant: the next held slot stands in
    full = next_table(SlotTable(), members("h1", "h2", "h3", "h4"))
    assert ClusterView("h1", full, full.placement("mixed", 2)).replication_targets() == ["h2"]


def test_ec_placement_over_slots() -> None:
    """ec:K+M groups the slots; a vacant slot keeps its place in its group; too few slots for one group: none yet."""
    ec = Redundancy.parse("ec:2+1")
    two = next_table(SlotTable(), members("h1", "h2"))
    assert two.placement("mixed", ec) is None  # no group of K+M can form
    t = next_table(two, members("h1", "h2", "h3", "h4", "h5", "h6", "h7"))
    p = t.placement("mixed", ec)
    assert p is not None and p.scheme == ec
    assert p.erasure_groups == (("slot0", "slot1", "slot2"), ("slot3", "slot4", "slot5", "slot6"))
    assert p.holders("slot4") == ("slot4",)
    vacated = next_table(t, members("h1", "h2", "h3", "h5", "h6", "h7"))  # h4 leaves: slot3 vacant, groups unchanged
    q = vacated.placement("mixed", ec)
    assert q is not None and q.erasure_groups == p.erasure_groups and vacated.slots[3].vacant


def test_ec_through_membership_replicates_to_nobody() -> None:
    """The cluster view callers (replication, repair, drain) see an ec placement as R=1: each owner alone."""
    m = Membership("h0", "mixed", Redundancy.parse("ec:4+1"))
    m.apply(members("h0", "h1", "h2", "h3", "h4"))
    view = m.view
    assert view.placement is not None and view.placement.scheme.erasure_coded
    assert view.replication_targets() == [] and view.owned_slots() == {"slot0"}
    assert view.repair_sources({"slot0"}) == []
