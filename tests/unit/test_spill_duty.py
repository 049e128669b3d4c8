"""Who spills a shard: its owner while it holds its slot, else the slot's successor or the next held slot of its group.

The pure decision (``spill_duty``) over slot tables, and the spiller taking over a gone owner's shards of a step it
had already spilled its own ranks of, protecting them from retention until spilled, and collecting them later.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from memstore.core.model import ShardKey
from memstore.core.slots import SlotTable, next_table
from memstore.core.spill_policy import RetentionPolicy, spill_duty
from memstore.spill.spiller import Spiller
from memstore.spill.storage import Durable
from tests.harness.spill_source import FakeSource

pytestmark = pytest.mark.unit


def table_of(*members: str, table: SlotTable | None = None) -> SlotTable:
    return next_table(table or SlotTable(), {h: (f"127.0.0.1:{i + 1}", "") for i, h in enumerate(members)})


OWNERS = ("h0", "h1", "h2", "h3")


def duties(table: SlotTable, strategy: str = "mixed", replicas: int = 2, owners: tuple[str, ...] = OWNERS) -> dict[str, str]:
    placement = table.placement(strategy, replicas)
    return {o: spill_duty(o, table, placement) for o in owners}


def test_the_owner_spills_while_it_holds_its_slot_then_its_successor() -> None:
    full = table_of("h0", "h1", "h2", "h3")  # mixed, R=2: groups (slot0, slot1) and (slot2, slot3)
    assert duties(full) == {"h0": "h0", "h1": "h1", "h2": "h2", "h3": "h3"}

    gone = table_of("h1", "h2", "h3", table=full)  # h0 lost, its slot vacant: its group peer takes over
    assert duties(gone) == {"h0": "h1", "h1": "h1", "h2": "h2", "h3": "h3"}

    replaced = table_of("h9", "h1", "h2", "h3", table=gone)  # a new host in h0's slot: the slot's successor
    assert replaced.slots[0].host_id == "h9" and "h0" in replaced.slots[0].former
    assert duties(replaced, owners=("h0", "h9", "h1")) == {"h0": "h9", "h9": "h9", "h1": "h1"}

    back = table_of("h0", "h1", "h2", "h3", table=gone)  # the same host id restarted (empty): its slot again
    assert duties(back) == {"h0": "h0", "h1": "h1", "h2": "h2", "h3": "h3"}

    group_gone = table_of("h2", "h3", table=full)  # every slot of the group vacant: nobody can
    assert duties(group_gone) == {"h0": "", "h1": "", "h2": "h2", "h3": "h3"}


def test_ring_order_and_no_table() -> None:
    ring = table_of("h0", "h1", "h2", "h3", "h4")
    two_gone = table_of("h2", "h3", "h4", table=ring)  # h0's holders in a ring of R=3: slot0, slot1, slot2
    assert duties(two_gone, "ring", 3, owners=("h0", "h1")) == {"h0": "h2", "h1": "h2"}
    assert spill_duty("h0", SlotTable(), None) == "h0"  # a single store without a table: the owner, as ever
    assert spill_duty("stranger", ring, ring.placement("ring", 3)) == "stranger"  # never in the table: its own
    assert spill_duty("", ring, ring.placement("ring", 3)) == ""  # no owner never matches a vacant slot's ""


def test_exactly_one_live_store_spills_each_owner_as_hosts_come_and_go() -> None:
    table = table_of("h0", "h1", "h2", "h3", "h4", "h5")
    changes = [("h1", "h2", "h3", "h4", "h5"), ("h1", "h3", "h4", "h5"), ("h1", "h3", "h4", "h5", "h7"),
               ("h0", "h1", "h3", "h4", "h5", "h7")]  # fmt: skip
    ever = ("h0", "h1", "h2", "h3", "h4", "h5", "h7")
    for members in changes:
        table = table_of(*members, table=table)
        for strategy, r in (("mixed", 2), ("mixed", 3), ("ring", 2)):
            got = duties(table, strategy, r, owners=tuple(o for o in ever if table.owner_slot(o) is not None))
            for owner, spiller in got.items():
                assert spiller == "" or spiller in members, (members, strategy, owner, spiller)
                if owner in members:
                    assert spiller == owner  # a live owner always spills its own shards


def published(root: Path) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for p in root.glob("job/step-*/rank-*.json"):
        out.setdefault(int(p.parent.name[5:]), set()).add(int(p.name[5:11]))
    return out


def test_a_taken_over_owner_is_spilled_protected_until_then_and_collected(tmp_path: Path) -> None:
    source = FakeSource()
    spiller = Spiller(source, Durable(f"file://{tmp_path}"), every_steps=2, every_seconds=0,  # type: ignore[arg-type]
                      retention=RetentionPolicy(keep_last=1), codec="none", max_rate=0)  # fmt: skip
    for rank, owner in ((0, "h0"), (1, "h0"), (2, "h1"), (3, "h1")):  # h1 holds its own ranks and h0's replicas
        source.hold(2, rank, owner)
    spiller.run_once()
    assert published(tmp_path) == {2: {2, 3}}  # h0 alive: h1 spills its own ranks only
    assert spiller.protected_steps("job") == set()

    source.duty = {"h1", "h0"}  # h0 is gone: h1 is the first held slot of h0's group now
    assert spiller.protected_steps("job") == {2}  # due and not spilled: kept in RAM until it is
    spiller.run_once()
    assert published(tmp_path) == {2: {0, 1, 2, 3}}  # the step h1 had spilled its ranks of: h0's ranks too
    assert spiller.protected_steps("job") == set()
    assert Durable(f"file://{tmp_path}").exists(f"{tmp_path}/job/step-000000000002/rank-000000.shard")

    for rank, owner in ((0, "h0"), (1, "h0"), (2, "h1"), (3, "h1")):
        source.hold(4, rank, owner)
    spiller.run_once()  # step 4 complete: retention (keep 1) drops step 2, h0's ranks included
    spiller.run_once()
    assert published(tmp_path) == {4: {0, 1, 2, 3}}
    assert not list(tmp_path.glob("job/step-000000000002/*"))


def test_a_successor_finds_what_the_owner_published_and_does_not_rewrite_it(tmp_path: Path) -> None:
    durable = Durable(f"file://{tmp_path}")
    before, after = FakeSource(), FakeSource()
    before.host_id, before.duty = "h0", {"h0"}
    for rank in range(4):
        before.hold(2, rank, "h0" if rank < 2 else "h1")
        after.hold(2, rank, "h0" if rank < 2 else "h1")
    kw = {"every_steps": 2, "every_seconds": 0, "retention": RetentionPolicy(keep_last=1), "codec": "none", "max_rate": 0}
    Spiller(before, durable, **kw).run_once()  # type: ignore[arg-type]
    assert published(tmp_path) == {2: {0, 1}}
    mtime = (tmp_path / "job/step-000000000002/rank-000000.shard").stat().st_mtime_ns
    after.duty = {"h0", "h1"}
    taker = Spiller(after, durable, **kw)  # type: ignore[arg-type]
    taker.run_once()
    assert published(tmp_path) == {2: {0, 1, 2, 3}}
    assert (tmp_path / "job/step-000000000002/rank-000000.shard").stat().st_mtime_ns == mtime  # found published: not rewritten
    assert taker.status["job"].bytes_written == 2 * len(after.shards[ShardKey("job", 2, 2, "t1")][1])


def test_retention_deletes_only_the_ranks_whose_owner_this_store_spills_for(tmp_path: Path) -> None:
    durable = Durable(f"file://{tmp_path}")
    everyone = FakeSource()
    everyone.duty = {"h0", "h1"}
    for step in (2, 4):
        for rank in range(4):
            everyone.hold(step, rank, "h0" if rank < 2 else "h1")
    Spiller(everyone, durable, every_steps=2, every_seconds=0, retention=RetentionPolicy(keep_last=5), codec="none",  # type: ignore[arg-type]
            max_rate=0).run_once()  # fmt: skip
    assert published(tmp_path) == {2: {0, 1, 2, 3}, 4: {0, 1, 2, 3}}
    h1_only = FakeSource()  # h0 alive again: h1 collects its own ranks of the doomed step, h0 its own
    Spiller(h1_only, durable, every_steps=2, every_seconds=0, retention=RetentionPolicy(keep_last=1), codec="none",  # type: ignore[arg-type]
            max_rate=0).collect_garbage("job")  # fmt: skip
    assert published(tmp_path) == {2: {0, 1}, 4: {0, 1, 2, 3}}
