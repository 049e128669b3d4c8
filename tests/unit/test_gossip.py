"""Membership gossip at a constant cost: a Hello carries the asker's table version, the answer omits an unchanged
table, and an asked store that is behind pulls from the asker (push-pull)."""

from __future__ import annotations

import random
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from memstore.core.slots import SlotTable, next_table
from memstore.core.status import HelloReport
from memstore.membership import FedMembers
from memstore.server.convert import hello_from_pb, hello_to_pb
from memstore.server.discovery import GOSSIP_FANOUT, ClusterFollower
from memstore.server.membership import Membership

pytestmark = pytest.mark.unit


def _members(n: int) -> dict[str, tuple[str, str]]:
    return {f"h{i}": (f"10.0.0.{i % 250}:{7000 + i}", "") for i in range(n)}


def _table(n: int) -> SlotTable:
    return next_table(SlotTable(), _members(n))


def _report(host: str, table: SlotTable) -> HelloReport:
    m = table.members()
    return HelloReport(host, "1", 2, tuple(m), tuple(m.values()), "", "", 1, 1, "mixed", 0, slots=table)


def test_a_brief_answer_is_the_same_size_at_8_and_1000_members() -> None:
    sizes = {n: hello_to_pb(_report("h0", _table(n)), brief=True).ByteSize() for n in (8, 1000)}
    assert sizes[8] == sizes[1000]
    assert hello_to_pb(_report("h0", _table(1000))).ByteSize() > 50 * sizes[1000]  # the whole answer grows with N
    brief = hello_from_pb(hello_to_pb(_report("h0", _table(1000)), brief=True))
    assert brief.slots == SlotTable() and brief.peer_ids == () and brief.host_id == "h0"


def test_answer_gossip_sends_a_newer_table_and_pulls_from_a_newer_asker() -> None:
    m = Membership("h0", "mixed", 2)
    m.apply(_members(4))
    ours = m.view.table
    assert m.answer_gossip(ours, 0, "x", "h1") is True  # the asker is behind: send ours
    assert m.answer_gossip(ours, ours.version, ours.digest, "h1") is False  # same: nothing to send
    assert m.take_newer_at(0) == []
    assert m.answer_gossip(ours, ours.version + 1, "d", "h2") is False  # the asker is ahead: pull from it
    assert m.answer_gossip(ours, ours.version + 1, "d", "stranger") is False  # not a member we could ask
    assert m.take_newer_at(0) == ["h2"]
    assert m.take_newer_at(0) == []


def test_take_newer_at_waits_until_a_hint_or_wake() -> None:
    m = Membership("h0", "mixed", 2)
    start = time.monotonic()
    assert m.take_newer_at(0.05) == [] and time.monotonic() - start >= 0.05
    threading.Timer(0.05, m.wake).start()
    start = time.monotonic()
    assert m.take_newer_at(10) == [] and time.monotonic() - start < 5


class _Peer:
    def __init__(self, stores: dict[str, Any], host: str, calls: list[int]) -> None:
        self.stores, self.host, self.calls = stores, host, calls

    def hello(self, timeout: float, known: SlotTable | None = None, asker: str = "") -> HelloReport:
        """What the servicer's Hello does, through the wire format."""
        self.calls.append(0)
        asked = self.stores[self.host]
        report = _report(self.host, asked.membership.view.table)
        if known is None:
            return hello_from_pb(hello_to_pb(report))
        newer = asked.membership.answer_gossip(report.slots, known.version, known.digest, asker)
        return hello_from_pb(hello_to_pb(report, brief=not newer))


def _cluster(n: int) -> tuple[dict[str, Any], dict[str, ClusterFollower], list[int]]:
    stores: dict[str, Any] = {}
    calls: list[int] = []
    for h in _members(n):
        membership = Membership(h, "mixed", 2)
        membership.apply(_members(n))
        peers = {p: _Peer(stores, p, calls) for p in _members(n)}
        stores[h] = SimpleNamespace(host_id=h, membership=membership, peers=peers)
    config = SimpleNamespace(discovery_interval=1.0, peer_timeout=1.0, discovery="", peers=(), host_ids=())
    followers = {h: ClusterFollower(s, config, FedMembers()) for h, s in stores.items()}  # type: ignore[arg-type]
    return stores, followers, calls


def _rounds_until_everyone_has(stores: dict[str, Any], followers: dict[str, ClusterFollower], new: SlotTable) -> int:
    rng = random.Random(7)
    for round_ in range(1, 50):
        for h, f in followers.items():  # one interval: every store asks GOSSIP_FANOUT random members
            others = stores[h].membership.view.others()
            f.gossip_round(rng.sample(others, min(GOSSIP_FANOUT, len(others))), 1.0)
        for h, f in followers.items():  # and pulls from the askers that showed it a newer table
            f.gossip_round(stores[h].membership.take_newer_at(0), 1.0)
        if all(s.membership.view.table.same_assignment(new) and s.membership.view.table.version == new.version for s in stores.values()):
            return round_
    raise AssertionError("gossip did not converge")


def test_push_pull_rounds_spread_a_new_table_in_log_rounds_with_a_constant_number_of_hellos() -> None:
    n = 32
    stores, followers, calls = _cluster(n)
    calls.clear()
    for h, f in followers.items():  # an idle interval: nothing new, only brief answers
        f.gossip_round(stores[h].membership.view.others()[:GOSSIP_FANOUT], 1.0)
    assert len(calls) == n * GOSSIP_FANOUT
    members = dict(stores["h0"].membership.members)
    del members[f"h{n - 1}"]
    stores["h0"].membership.apply(members)  # only h0's source saw the change
    new = stores["h0"].membership.view.table
    rounds = _rounds_until_everyone_has(stores, followers, new)
    assert rounds <= 8  # log_3(32) + ln(32)/3 ~ 4.3 rounds in expectation
