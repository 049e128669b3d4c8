"""The Janitor alone: retention over the catalog, with the cluster's holdings and the durable tier faked."""

from __future__ import annotations

import threading
import time

import pytest

from memstore.config import StoreConfig
from memstore.core.floors import Floor, Floors
from memstore.core.model import Holding, ShardKey
from memstore.server.engine import janitor as janitor_module
from memstore.server.engine.eviction import Eviction
from memstore.server.engine.janitor import LEARN_POLL_SECONDS, LEARN_SECONDS, Janitor
from tests.unit.engine_fakes import captured, config, make_catalog, settled

pytestmark = pytest.mark.unit
DATA = bytes(range(256)) * 32  # 8 KiB


def no_tickets(now: float) -> None:
    """The data channel's ticket expiry (``DataPath.expire_tickets``): none issued here."""


def janitor(holdings: list[Holding], floors: Floors | None = None):  # type: ignore[no-untyped-def]
    cfg = config(keep="2")
    catalog, _, stop = make_catalog(cfg)
    asked: list[str] = []

    def cluster_holdings(job: str) -> tuple[list[Holding], list[str]]:
        asked.append(job)
        return holdings, []

    return (
        Janitor(catalog, Eviction(catalog), cfg, cluster_holdings, no_tickets, stop, threading.Event(), floors or Floors()),
        catalog,
        asked,
    )


def test_retention_keeps_k_and_asks_the_cluster_only_when_something_would_go() -> None:
    jan, catalog, asked = janitor([])
    for step in (1, 2):
        settled(catalog, ShardKey("job", step, 0), DATA, created=float(step))
    jan.apply_retention()
    assert asked == []  # two steps, keep 2: nothing to decide
    settled(catalog, ShardKey("job", 3, 0), DATA, created=3.0)
    jan.apply_retention()
    assert asked == ["job"] and sorted(k.step for k, _, _ in catalog.held("job")) == [2, 3]


def test_retention_keeps_the_newest_committed_step_when_newer_ones_rest_on_one_copy() -> None:
    """R=2, two ranks. Step 3 is committed (both ranks on h0 and h1); step 4 is restorable only through rank 0's one
    copy on h0 (its replication to h1 failed); steps 5 and 6 have rank 1 only. h1 keeps 2 steps: it must keep step 3
    too, or losing h0 leaves nothing restorable (the recovery matrix's wire-bit-flip row found this)."""
    cfg = config(keep="2", replicas="2")
    catalog, _, stop = make_catalog(cfg)
    held = [(3, 0), (3, 1), (4, 1), (5, 1), (6, 1)]  # what h1 holds
    for step, rank in held:
        settled(catalog, ShardKey("job", step, rank), DATA, created=float(step))
    view = [Holding("h1", ShardKey("job", s, r), 2, True, float(s)) for s, r in held]
    view += [Holding("h0", ShardKey("job", s, r), 2, True, float(s)) for s, r in [(3, 0), (3, 1), (4, 0), (4, 1)]]
    Janitor(catalog, Eviction(catalog), cfg, lambda job: (view, []), no_tickets, stop, threading.Event(), Floors()).apply_retention()
    assert sorted({k.step for k, _, _ in catalog.held("job")}) == [3, 4, 5, 6]  # 4: the latest restorable; 3: committed
    view = [h for h in view if h.host != "h1" or h.key.step != 3] + [Holding("h1", ShardKey("job", 4, 0), 2, True, 4.0)]
    settled(catalog, ShardKey("job", 4, 0), DATA, created=4.0)  # step 4 committed after all (repair)
    Janitor(catalog, Eviction(catalog), cfg, lambda job: (view, []), no_tickets, stop, threading.Event(), Floors()).apply_retention()
    assert sorted({k.step for k, _, _ in catalog.held("job")}) == [4, 5, 6]  # now step 3 may go


def test_saves_that_settle_while_the_cluster_is_listed_wait_for_the_next_pass() -> None:
    """R=2, two ranks, keep 2. Steps 1..3 are here when a pass starts listing the cluster; the listing takes seconds (a
    lost peer, the durable tier down) and meanwhile steps 4..6 settle for both ranks, then 7 and 8 for rank 1 only (rank
    0's store is gone). The pass decided over steps 1..3 (the newest restorable step it knows of: 3), so it evicts among
    those only. Evicting from the catalog as it was after the listing dropped 4..6, keep-K's window being 7 and 8: every
    committed step newer than 3 (the recovery matrix's s3-outage row restored an older step than it had committed)."""
    cfg = config(keep="2", replicas="2", capacity="256KiB")  # room for every copy: no pressure, retention alone
    catalog, _, stop = make_catalog(cfg)
    for step in (1, 2, 3):
        for rank in (0, 1):
            settled(catalog, ShardKey("job", step, rank), DATA, created=float(step))
    seen = [Holding("h0", k, 2, True, created) for k, _, created in catalog.held("job")]

    def slow_listing(job: str) -> tuple[list[Holding], list[str]]:
        for step, ranks in ((4, (0, 1)), (5, (0, 1)), (6, (0, 1)), (7, (1,)), (8, (1,))):
            for rank in ranks:
                settled(catalog, ShardKey("job", step, rank), DATA, created=float(step))
        return seen, ["h1", "durable"]

    jan = Janitor(catalog, Eviction(catalog), cfg, slow_listing, no_tickets, stop, threading.Event(), Floors())
    jan.apply_retention()
    assert sorted({k.step for k, _, _ in catalog.held("job")}) == [2, 3, 4, 5, 6, 7, 8]  # 1: below the window it saw
    jan.cluster_holdings = lambda job: ([Holding("h0", k, 2, True, c) for k, _, c in catalog.held("job")], ["h1", "durable"])
    jan.apply_retention()  # the next pass sees them: 6 is the newest restorable step, 7 and 8 keep-K's window
    assert sorted({k.step for k, _, _ in catalog.held("job")}) == [6, 7, 8]


def test_while_the_durable_tier_does_not_answer_nothing_from_the_newest_committed_step_on_goes() -> None:
    """R=1, two ranks, keep 2. Steps 1 and 2 are restorable from RAM (rank 1 on h1); of steps 3..5 RAM holds rank 0
    only (here): the durable tier may hold their rank 1, which would make any of them the newest restorable step. While
    it does not answer, step 3 stays; once it answers (holding none of them), step 3 goes as keep-K says."""
    cfg = config(keep="2")
    catalog, _, stop = make_catalog(cfg)
    for step in (1, 2, 3, 4, 5):
        settled(catalog, ShardKey("job", step, 0), DATA, created=float(step))
    view = [Holding("h0", ShardKey("job", s, 0), 2, True, float(s)) for s in (1, 2, 3, 4, 5)]
    view += [Holding("h1", ShardKey("job", s, 1), 2, True, float(s)) for s in (1, 2)]
    answers: list[str] = ["durable"]
    jan = Janitor(catalog, Eviction(catalog), cfg, lambda job: (view, answers), no_tickets, stop, threading.Event(), Floors())
    jan.apply_retention()
    assert sorted(k.step for k, _, _ in catalog.held("job")) == [2, 3, 4, 5]  # 1 is below the newest committed step
    answers.clear()
    jan.apply_retention()
    assert sorted(k.step for k, _, _ in catalog.held("job")) == [2, 4, 5]  # 2: the newest restorable; 4, 5: keep-K


def test_while_the_durable_tier_does_not_answer_and_ram_shows_nothing_restorable_every_version_stays() -> None:
    cfg = config(keep="2")
    catalog, _, stop = make_catalog(cfg)
    for step in (1, 2, 3):
        settled(catalog, ShardKey("job", step, 0), DATA, created=float(step))
    view = [Holding("h0", ShardKey("job", s, 0), 2, True, float(s)) for s in (1, 2, 3)]  # rank 1: on the durable tier?
    jan = Janitor(catalog, Eviction(catalog), cfg, lambda job: (view, ["durable"]), no_tickets, stop, threading.Event(), Floors())
    jan.apply_retention()
    assert sorted(k.step for k, _, _ in catalog.held("job")) == [1, 2, 3]


def test_the_durable_tier_keeps_steps_due_for_spilling() -> None:
    class Durable:
        def protected_steps(self, job: str) -> set[int]:
            return {1}

    jan, catalog, _ = janitor([])
    jan.durable = Durable()  # type: ignore[assignment]
    for step in (1, 2, 3):
        settled(catalog, ShardKey("job", step, 0), DATA, created=float(step))
    jan.apply_retention()
    assert sorted(k.step for k, _, _ in catalog.held("job")) == [1, 2, 3]


def test_a_pass_frees_what_expired_leases_held(monkeypatch: pytest.MonkeyPatch) -> None:
    jan, catalog, _ = janitor([])
    entry = captured(catalog, ShardKey("job", 1, 0), DATA)
    catalog.lease_allocation(entry, ahead=False)  # a trainer that allocated and crashed
    jan.pass_once()
    assert catalog.pool.used == len(DATA)  # type: ignore[attr-defined]  # not expired yet
    later = time.monotonic() + 3600
    monkeypatch.setattr(janitor_module.time, "monotonic", lambda: later)
    jan.pass_once()
    assert catalog.pool.used == 0  # type: ignore[attr-defined]


def test_a_timeline_resaved_from_an_older_step_supersedes_the_abandoned_steps() -> None:
    cfg = config(keep="3")
    catalog, _, stop = make_catalog(cfg)
    keys = [ShardKey("job", 1, 0, "A.0"), ShardKey("job", 2, 0, "A.0"), ShardKey("job", 3, 0, "A.0"), ShardKey("job", 2, 0, "B.0")]
    for i, k in enumerate(keys):
        settled(catalog, k, DATA, created=float(i + 1))
    view = [Holding("h0", k, 1, True, float(i + 1)) for i, k in enumerate(keys)]
    Janitor(catalog, Eviction(catalog), cfg, lambda job: (view, []), no_tickets, stop, threading.Event(), Floors()).apply_retention()
    assert sorted(k.version for k, _, _ in catalog.held("job")) == [(1, "A.0"), (2, "B.0")]


def test_with_a_restorable_floor_retention_asks_nobody() -> None:
    floors = Floors()
    jan, catalog, asked = janitor([], floors)
    for step in (1, 2, 3, 4):
        settled(catalog, ShardKey("job", step, 0, "r.0"), DATA, created=float(step))
        floors.note("job", Floor(step, "r.0"))  # every rank saved it: the ranks' agreement came with the next commit
        jan.apply_retention()
    assert asked == [] and jan.listings == 0
    assert sorted(k.step for k, _, _ in catalog.held("job")) == [3, 4]


def test_a_floor_of_another_timeline_bounds_retention_of_saves_with_a_timeline_each() -> None:
    floors = Floors()
    jan, catalog, asked = janitor([], floors)
    for step in (1, 2, 3, 4):  # DCP: every save a timeline of its own, its floor the save before it
        settled(catalog, ShardKey("job", step, 0, f"dcp-{step}"), DATA, created=float(step))
        if step > 1:
            floors.note("job", Floor(step - 1, f"dcp-{step - 1}"))
        jan.apply_retention()
    assert asked == [] and jan.listings == 0
    assert sorted(k.version for k, _, _ in catalog.held("job")) == [(3, "dcp-3"), (4, "dcp-4")]


def test_a_floor_of_a_timeline_the_store_does_not_hold_is_no_bound_it_lists() -> None:
    floors = Floors()
    jan, catalog, asked = janitor([], floors)
    for step in (1, 2, 3):
        settled(catalog, ShardKey("job", step, 0, f"dcp-{step}"), DATA, created=float(step))
    floors.note("job", Floor(9, "dcp-elsewhere"))  # no copy of it here: where it ranks among 1..3 is unknown
    jan.apply_retention()
    assert asked == ["job"] and jan.listings == 1


def test_a_lagging_floor_keeps_every_step_at_or_above_it() -> None:
    floors = Floors()
    jan, catalog, asked = janitor([], floors)
    floors.note("job", Floor(2, "r.0"))  # the newest the ranks agreed on; steps 3..5 may not be restorable yet
    for step in (1, 2, 3, 4, 5):
        settled(catalog, ShardKey("job", step, 0, "r.0"), DATA, created=float(step))
    jan.apply_retention()
    assert asked == [] and sorted(k.step for k, _, _ in catalog.held("job")) == [2, 3, 4, 5]  # keep 2, yet 2 and 3 stay
    floors.note("job", Floor(4, "r.0"))
    jan.apply_retention()
    assert sorted(k.step for k, _, _ in catalog.held("job")) == [4, 5]
    floors.note("job", Floor(3, "r.0"))  # an older floor arriving late does not move it back
    assert floors.get("job") == Floor(4, "r.0")


def test_a_floor_of_a_new_timeline_ranks_above_every_step_of_the_old_one() -> None:
    floors = Floors()
    jan, catalog, asked = janitor([], floors)
    for step, timeline in ((8, "r.0"), (9, "r.0"), (5, "r.1"), (6, "r.1")):  # the job went back to step 4 and saved on
        settled(catalog, ShardKey("job", step, 0, timeline), DATA, created=float(step if timeline == "r.0" else 10 + step))
    floors.note("job", Floor(5, "r.1"))
    jan.apply_retention()  # crowded, no supersede (5 and 6 are below 8 but came later: may_supersede asks the cluster)
    assert asked == ["job"] and sorted(k.version for k, _, _ in catalog.held("job")) == [(5, "r.1"), (6, "r.1")]


def test_a_restore_below_the_floor_lowers_it_so_the_restored_copy_stays() -> None:
    # The floor said 5, then R hosts failed at once: the ranks agreed on step 2 and pull it back (from durable storage).
    floors = Floors()
    jan, catalog, asked = janitor([], floors)
    floors.note("job", Floor(5, "r.0"))
    for step in (2, 4, 5):
        settled(catalog, ShardKey("job", step, 0, "r.0"), DATA, created=float(step))
    floors.restoring("job", Floor(2, "r.0"))  # the Fetch of step 2
    jan.apply_retention()
    assert asked == [] and sorted(k.step for k, _, _ in catalog.held("job")) == [2, 4, 5]
    floors.note("job", Floor(5, "r.0"))  # the ranks saved on: the floor moves up again, and 2 may go
    jan.apply_retention()
    assert sorted(k.step for k, _, _ in catalog.held("job")) == [4, 5]


def test_a_pass_expires_the_data_channels_tickets_too() -> None:
    cfg = config()
    catalog, _, stop = make_catalog(cfg)
    asked: list[float] = []
    before = time.monotonic()
    Janitor(catalog, Eviction(catalog), cfg, lambda job: ([], []), asked.append, stop, threading.Event(), Floors()).pass_once()
    assert len(asked) == 1 and asked[0] >= before  # DataPath.expire_tickets, with the pass's clock


@pytest.mark.parametrize("redundancy", ["ec:4+1", "replicas:1"])
def test_a_recycling_job_without_a_floor_lists_until_its_newest_step_is_settled_everywhere(redundancy: str) -> None:
    """ec:K+M, keep 2: a rank's next save takes its oldest kept step's segment only below a step every rank's settled
    copy makes restorable, which the janitor learns by listing after the newest step here settles, again until the
    other ranks' saves of it settled (memstore.server.engine.recycling). Not with a floor, and never under replicas."""
    peers = ",".join(f"h{i}=127.0.0.1:{7070 + i}" for i in range(5))
    cli = {
        "host_id": "h0",
        "capacity": "64KiB",
        "chunk_bytes": "4KiB",
        "keep": "2",
        "shm_dir": "",
        "peers": peers,
        "redundancy": redundancy,
    }
    cfg = StoreConfig.load(cli, env={})
    catalog, _, stop = make_catalog(cfg)
    view: list[Holding] = []
    asked: list[str] = []

    def listing(job: str) -> tuple[list[Holding], list[str]]:
        asked.append(job)
        return list(view), []

    eviction = Eviction(catalog)
    floors = Floors()
    jan = Janitor(catalog, eviction, cfg, listing, no_tickets, stop, threading.Event(), floors)
    for step in (1, 2):
        settled(catalog, ShardKey("job", step, 0), DATA, created=float(step))
    view[:] = [Holding("h0", ShardKey("job", s, 0), 2, True, float(s)) for s in (1, 2)]
    view += [Holding("h1", ShardKey("job", 1, 1), 2, True, 1.0), Holding("h1", ShardKey("job", 2, 1), 2, True, 2.0, settled=False)]
    jan.apply_retention()
    if redundancy != "ec:4+1":
        assert asked == [] and eviction.restorable("job") is None  # two steps, keep 2: nothing to decide
        return
    assert asked == ["job"] and eviction.restorable("job") == (1, "")  # rank 1's step 2 is still being encoded
    assert jan._poll_seconds() == LEARN_POLL_SECONDS  # it looks again soon ...
    version, since = jan._learning["job"]
    jan._learning["job"] = (version, since - 2.0)
    assert jan._poll_seconds() == pytest.approx(0.5, abs=0.05)  # ... then less often the longer it waits
    jan._learning["job"] = (version, since - LEARN_SECONDS - 1)
    assert jan._poll_seconds() == 1.0  # and gives up (a rank that never saves the step)
    jan._learning["job"] = (version, since)
    jan.apply_retention()
    assert asked == ["job"] * 2  # again, until it settles
    view[-1] = Holding("h1", ShardKey("job", 2, 1), 2, True, 2.0)
    jan.apply_retention()
    assert eviction.restorable("job") == (2, "")
    jan.apply_retention()
    assert len(asked) == 3 and sorted(k.step for k, _, _ in catalog.held("job")) == [1, 2]  # learnt: no more listing
    settled(catalog, ShardKey("job", 3, 0), DATA, created=3.0)  # (the ring grew for it, or took step 1's segment)
    floors.note("job", Floor(2, ""))  # with a floor the janitor lists for nothing
    catalog.drop(catalog.get(ShardKey("job", 1, 0)), reason="test")  # type: ignore[arg-type]
    jan.apply_retention()
    assert len(asked) == 3
