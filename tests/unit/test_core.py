"""Pure core logic: latest restorable step, retention, sizes."""

from __future__ import annotations

import pytest

from memstore.core.floors import Floor, Floors, floor_problem, sent_floor
from memstore.core.model import Holding, ShardKey, ShardState
from memstore.core.restorable import (
    latest_restorable,
    latest_restorable_step,
    may_supersede,
    restorable_versions,
    sources_for,
    split_timelines,
    superseded_versions,
)
from memstore.core.retention import (
    newest_versions,
    pressure_victims,
    ranked_versions,
    repair_waves,
    retention_victims,
    superseded_in_flight,
)
from memstore.core.sizes import format_size, parse_size

pytestmark = pytest.mark.unit

C, Rp, CAP = ShardState.COMMITTED, ShardState.REPLICA, ShardState.CAPTURED


def h(host: str, step: int, rank: int, world: int = 2, verified: bool = True, job: str = "j", tl: str = "", t: float = 0.0) -> Holding:
    return Holding(host, ShardKey(job, step, rank, tl), world, verified, t or float(step))


class TestRestorable:
    def test_newest_step_with_every_rank(self) -> None:
        hs = [h("a", 1, 0), h("b", 1, 1), h("a", 2, 0), h("b", 2, 1), h("a", 3, 0)]
        assert latest_restorable_step(hs, "j") == (2, 2)
        assert [(v.step, v.world_size) for v in restorable_versions(hs, "j")] == [(1, 2), (2, 2)]

    def test_unverified_copies_do_not_count(self) -> None:
        hs = [h("a", 1, 0), h("b", 1, 1), h("a", 2, 0), h("b", 2, 1, verified=False)]
        assert latest_restorable_step(hs, "j") == (1, 2)

    def test_nothing_restorable_is_none(self) -> None:
        assert latest_restorable_step([h("a", 5, 0)], "j") is None
        assert latest_restorable_step([], "j") is None

    def test_other_jobs_ignored(self) -> None:
        assert latest_restorable_step([h("a", 1, 0, job="x"), h("a", 1, 1, job="x")], "j") is None

    def test_world_size_disagreement_is_not_restorable(self) -> None:
        hs = [h("a", 1, 0, world=2), h("b", 1, 1, world=2), h("a", 2, 0, world=1), h("b", 2, 1, world=2)]
        assert latest_restorable_step(hs, "j") == (1, 2)

    def test_duplicate_copies_and_answer_independent_of_order(self) -> None:
        hs = [h("a", 4, 0), h("b", 4, 0), h("c", 4, 1), h("b", 3, 1), h("a", 3, 0)]
        assert latest_restorable_step(hs, "j") == latest_restorable_step(list(reversed(hs)), "j") == (4, 2)

    def test_sources_prefer_given_order(self) -> None:
        key = ShardKey("j", 1, 0)
        hs = [h("c", 1, 0), h("a", 1, 0), h("b", 1, 0, verified=False)]
        assert sources_for(hs, key, prefer=["c"]) == ["c", "a"]
        assert sources_for(hs, key) == ["a", "c"]


def k(step: int, rank: int = 0, job: str = "j") -> ShardKey:
    return ShardKey(job, step, rank)


class TestRetention:
    def test_keeps_newest_k_settled_steps(self) -> None:
        held = [(k(s, r), C, 0.0) for s in (1, 2, 3, 4) for r in (0, 1)]
        assert retention_victims(held, keep=2) == [k(1, 0), k(1, 1), k(2, 0), k(2, 1)]

    def test_in_flight_steps_do_not_count_toward_k(self) -> None:
        held = [(k(1), C, 0.0), (k(2), C, 0.0), (k(3), CAP, 0.0)]
        assert retention_victims(held, keep=2) == []
        held = [(k(1), C, 0.0), (k(2), C, 0.0), (k(3), C, 0.0), (k(4), CAP, 0.0)]
        assert retention_victims(held, keep=2) == [k(1)]

    def test_step_with_any_unsettled_copy_is_not_settled(self) -> None:
        held = [(k(1), C, 0.0), (k(2), C, 0.0), (k(3, 0), C, 0.0), (k(3, 1), ShardState.REPLICATING, 0.0)]
        assert retention_victims(held, keep=2) == []

    def test_protected_step_survives(self) -> None:
        held = [(k(s), Rp, 0.0) for s in (1, 2, 3, 4)]
        assert retention_victims(held, keep=2, protected_steps=[1]) == [k(2)]

    def test_superseded_in_flight_same_rank_only(self) -> None:
        held = [(k(1), C, 0.0), (k(2), ShardState.REPLICATING, 0.0), (k(2, rank=1), CAP, 0.0), (k(3), CAP, 0.0)]
        assert superseded_in_flight(held, k(4)) == [k(2), k(3)]

    def test_pressure_never_offers_newest_settled_step(self) -> None:
        held = [(k(1), C, 0.0), (k(2), C, 0.0), (k(3), C, 0.0), (k(4), ShardState.REPLICATING, 0.0)]
        assert pressure_victims(held, k(5)) == [k(4), k(1), k(2)]
        assert pressure_victims([(k(1), C, 0.0)], k(2)) == []
        assert pressure_victims(held, k(5), protected_steps=[1]) == [k(4), k(2)]

    def test_nothing_at_or_above_the_floor_is_evicted(self) -> None:
        held = [(k(s), C, float(s)) for s in (1, 2, 3, 4, 5)]
        assert retention_victims(held, keep=2, floor=(5, "")) == [k(1), k(2), k(3)]  # the floor is the newest: keep-K
        assert retention_victims(held, keep=2, floor=(2, "")) == [k(1)]  # a floor that lags keeps all above it
        assert retention_victims(held, keep=2, floor=(9, "other")) == [k(1), k(2), k(3)]  # a timeline nobody holds yet

    def test_pressure_spares_the_floor_and_above(self) -> None:
        held = [(k(s), C, float(s)) for s in (1, 2, 3, 4)]
        assert pressure_victims(held, k(5)) == [k(1), k(2), k(3)]
        assert pressure_victims(held, k(5), floor=(2, "")) == [k(1)]

    def test_floors_only_move_up_within_a_timeline(self) -> None:
        floors = Floors()
        assert floors.note("j", Floor(3, "a")) and not floors.note("j", Floor(2, "a")) and floors.get("j") == Floor(3, "a")
        assert floors.note("j", Floor(1, "b")) and floors.get("j") == Floor(1, "b")  # a new timeline's floor replaces it
        floors.restoring("j", Floor(0, "b"))  # a restore lowers it
        floors.restoring("other", Floor(0, "b"))  # a job without a floor (no group=) gets none: it lists as before
        assert floors.get("j") == Floor(0, "b") and floors.get("other") is None
        assert floor_problem(4, 3) and floor_problem(-1, 3) and floor_problem(3, 3) is None
        # A floor naming another timeline (a DCP save's: the save before it) may be any step of it, a later one too.
        assert floor_problem(9, 3, "dcp-a") is None and floor_problem(-1, 3, "dcp-a")
        assert sent_floor(2, "", "r.0") == Floor(2, "r.0") and sent_floor(2, "dcp-a", "dcp-b") == Floor(2, "dcp-a")
        assert sent_floor(None, "dcp-a", "dcp-b") is None


class TestSizes:
    @pytest.mark.parametrize(
        ("text", "value"),
        [("0", 0), ("512", 512), ("512MiB", 512 << 20), ("8GiB", 8 << 30), ("2GB", 2 * 10**9), ("1.5KiB", 1536), (4096, 4096)],
    )
    def test_parse(self, text: str | int, value: int) -> None:
        assert parse_size(text) == value

    @pytest.mark.parametrize("text", ["", "MiB", "12XB", "-1", "1 2", "1e9"])
    def test_parse_rejects(self, text: str) -> None:
        with pytest.raises(ValueError, match="size"):
            parse_size(text)

    def test_format(self) -> None:
        assert format_size(512) == "512 B"
        assert format_size(3 << 30) == "3.00 GiB"


def test_retention_never_evicts_a_copy_in_flight() -> None:
    held = [(k(5), ShardState.REPLICATING, 0.0), (k(8), C, 0.0), (k(9), C, 0.0), (k(10), C, 0.0)]
    assert retention_victims(held, keep=2) == [k(8)]


class TestTimelines:
    """Two saves of one step never mix; re-saves are atomic; a newer timeline supersedes what it went back over."""

    def old(self, step: int, ranks: range = range(4), world: int = 4) -> list[Holding]:
        return [h(f"h{r}", step, r, world, tl="A.0", t=100.0 + step) for r in ranks]

    def new(self, step: int, ranks: range = range(4), world: int = 4) -> list[Holding]:
        return [h(f"h{r}", step, r, world, tl="B.0", t=200.0 + step) for r in ranks]

    def test_partial_resave_after_rollback_never_mixes(self) -> None:
        # steps 1-3 saved; the job goes back to 2; ranks 0-1 re-save step 3, ranks 2-3 die before it.
        hs = self.old(1) + self.old(2) + self.old(3) + self.new(3, range(2))
        v = latest_restorable(hs, "j")
        assert v is not None and (v.step, v.timeline) == (3, "A.0")  # the old version stays visible: atomic re-save
        assert all(x.timeline in ("A.0",) for x in restorable_versions(hs, "j"))
        assert superseded_versions(hs, "j") == set()

    def test_completed_resave_replaces_old_version_and_later_abandoned_steps(self) -> None:
        hs = self.old(1) + self.old(2) + self.old(3) + self.old(4) + self.new(3)
        v = latest_restorable(hs, "j")
        assert v is not None and (v.step, v.timeline) == (3, "B.0")  # not the abandoned step 4
        assert superseded_versions(hs, "j") == {(3, "A.0"), (4, "A.0")}
        assert latest_restorable(hs, "j", step=3) == v
        assert latest_restorable(hs, "j", step=4) is not None  # asked by number: the only save of step 4
        assert latest_restorable(hs, "j", step=2) is not None and latest_restorable(hs, "j", step=2).timeline == "A.0"  # type: ignore[union-attr]

    def test_mixed_copies_of_one_step_are_not_restorable(self) -> None:
        hs = self.old(5, range(2)) + self.new(5, range(2, 4))
        assert latest_restorable(hs, "j") is None
        assert split_timelines(hs, "j") == (5, ["A.0", "B.0"])

    def test_in_flight_newer_step_of_same_timeline_is_not_superseded(self) -> None:
        hs = self.old(5) + self.old(6, range(1))
        assert superseded_versions(hs, "j") == set()
        assert latest_restorable_step(hs, "j") == (5, 4)

    def test_older_timeline_captured_later_does_not_supersede(self) -> None:
        # supersession needs a *later* capture: an old, slow timeline finishing late changes nothing
        late_old = [h(f"h{r}", 3, r, 4, tl="A.0", t=300.0) for r in range(4)]
        hs = self.new(3) + self.new(4) + late_old
        assert superseded_versions(hs, "j") == {(3, "B.0"), (4, "B.0")}  # A.0@3 captured last: it is the newest timeline
        v = latest_restorable(hs, "j")
        assert v is not None and (v.step, v.timeline) == (3, "A.0")

    def test_local_precheck_spots_every_possible_supersession(self) -> None:
        forward = [(ShardKey("j", s, 0, f"dcp-{s}"), 100.0 + s) for s in range(1, 6)]  # a DCP save per step, going forward
        assert not may_supersede(forward)
        assert not may_supersede([(k, 100.0 + k.step) for k, _, _ in [(x.key, 0, 0) for x in self.old(3) + self.old(4)]])
        rolled_back = [*forward, (ShardKey("j", 3, 0, "dcp-again"), 200.0)]
        assert may_supersede(rolled_back)
        assert may_supersede([(x.key, x.created_unix) for x in self.old(3) + self.new(3, range(1))])

    def test_a_copy_without_capture_time_does_not_make_its_version_the_oldest(self) -> None:
        unknown = Holding("h9", ShardKey("j", 4, 0, "B.0"), 4, True, 0.0)
        hs = [unknown, *self.old(4), *self.new(4)]  # B.0's other copies say 204.0: B.0@4 is the newer save of step 4
        assert superseded_versions(hs, "j") == {(4, "A.0")}
        v = latest_restorable(hs, "j")
        assert v is not None and v.timeline == "B.0" and v.created_unix == 204.0

    def test_answer_independent_of_order(self) -> None:
        hs = self.old(1) + self.old(2) + self.new(2) + self.new(3, range(3))
        assert latest_restorable(hs, "j") == latest_restorable(list(reversed(hs)), "j")


class TestRetentionAcrossTimelines:
    """After the job went back to an older step, the new run's saves outrank the abandoned run's higher steps."""

    def test_new_timeline_outranks_higher_steps_of_the_abandoned_one(self) -> None:
        old = [(ShardKey("j", s, 0, "A.0"), C, 100.0 + s) for s in (8, 11, 12)]  # rank 0 has not re-saved yet
        new = [(ShardKey("j", s, 1, "B.0"), C, 200.0 + s) for s in (9, 10)]  # rank 1 already re-saved 9 and 10
        victims = retention_victims(old + new, keep=2, protected_steps=[8])
        assert victims == [ShardKey("j", 11, 0, "A.0"), ShardKey("j", 12, 0, "A.0")]  # never the new run's 9 and 10

    def test_pressure_offers_abandoned_steps_first(self) -> None:
        old = [(ShardKey("j", s, 0, "A.0"), C, 100.0 + s) for s in (11, 12)]
        new = [(ShardKey("j", 9, 0, "B.0"), C, 209.0)]
        assert pressure_victims(old + new, ShardKey("j", 10, 0, "B.0")) == [ShardKey("j", 11, 0, "A.0"), ShardKey("j", 12, 0, "A.0")]

    def test_repair_wants_the_newest_versions(self) -> None:
        copies = [(ShardKey("j", s, 0, "A.0"), 100.0 + s) for s in (11, 12)] + [(ShardKey("j", 9, 0, "B.0"), 209.0)]
        assert newest_versions(copies, 2) == {(9, "B.0"), (12, "A.0")}

    def test_repair_pulls_every_jobs_newest_version_first(self) -> None:
        copies = [(ShardKey("j", s, r, "A.0"), 100.0 + s) for s in (4, 5, 6) for r in (0, 1)]
        other = [(ShardKey("k", s, 0, "C.0"), 50.0 + s) for s in (1, 2)]
        ranked = {"j": ranked_versions(copies, 2), "k": ranked_versions(other, 2)}
        assert ranked["j"] == [(6, "A.0"), (5, "A.0")]
        todo = [ShardKey("j", 5, 0, "A.0"), ShardKey("k", 1, 0, "C.0"), ShardKey("j", 6, 1, "A.0"), ShardKey("k", 2, 0, "C.0")]
        waves = repair_waves(todo, ranked)
        assert waves == [[ShardKey("j", 6, 1, "A.0"), ShardKey("k", 2, 0, "C.0")], [ShardKey("j", 5, 0, "A.0"), ShardKey("k", 1, 0, "C.0")]]
