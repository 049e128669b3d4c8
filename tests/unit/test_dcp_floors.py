"""The restorable floor of DCP saves (``trainer_client.dcp.floors``): what a rank's local plan carries, what the
coordinator agrees on from them, and the plan info that hands it back."""

from __future__ import annotations

import pickle
import uuid

import pytest

from trainer_client.dcp.floors import SaveHistory, agree_floor, remember_committed, save_history
from trainer_client.dcp.plans import MemStoreSavePlanInfo
from trainer_client.floor import WINDOW, reduced

pytestmark = pytest.mark.unit

T1, T2, T3, T4 = (f"dcp-{i:016x}-00" for i in (1, 2, 3, 4))  # time-ordered names, as new_timeline makes them


def histories(*committed: list[tuple[int, str]], world: int | None = None) -> list[SaveHistory]:
    size = len(committed) if world is None else world
    return [SaveHistory(rank, tuple((step, timeline, size) for step, timeline in versions)) for rank, versions in enumerate(committed)]


def test_the_floor_is_the_newest_version_every_rank_committed() -> None:
    every = [(1, T1), (2, T2), (3, T3)]
    assert agree_floor(histories(every, every, every), 3) == (3, T3)
    # ranks saw them in another order (a slow settle): the same floor
    assert agree_floor(histories(every, every[::-1], [every[1], every[0], every[2]]), 3) == (3, T3)
    # rank 2's save of step 3 did not settle: trainer_client.floor's rule lags (its positions shift), it is never wrong...
    assert agree_floor(histories(every, every, every[:2]), 3) is None
    # ...and the next save every rank committed is the floor again
    assert agree_floor(histories([*every, (4, T4)], [*every, (4, T4)], [*every[:2], (4, T4)]), 3) == (4, T4)


def test_a_rank_without_a_history_or_a_plan_of_its_own_makes_no_floor() -> None:
    every = [(1, T1), (2, T2)]
    assert agree_floor(histories(every, [], every), 3) is None  # its first save in this process
    assert agree_floor([*histories(every, every), None], 3) is None  # a plan without one (another planner)
    assert agree_floor([SaveHistory(1, ()), *histories(every)[1:]], 1) is None  # rank 0 sent rank 1's history
    assert agree_floor(histories(every, every), 3) is None  # two plans for three ranks


def test_a_resaved_step_is_told_apart_by_its_timeline() -> None:
    # both ranks committed a save of step 2, but not the same one: no version of step 2 is every rank's, step 1's is
    assert agree_floor(histories([(1, T1), (2, T2)], [(1, T1), (2, T3)]), 2) == (1, T1)
    assert agree_floor(histories([(1, T1), (2, T3)], [(1, T1), (2, T3)]), 2) == (2, T3)


def test_versions_saved_by_another_world_size_are_left_out() -> None:
    # ranks 0 and 1 of an earlier save by 4 ranks committed step 5; a save by 2 ranks cannot count on ranks 2 and 3
    four = [SaveHistory(r, ((4, T1, 2), (5, T2, 4))) for r in range(2)]
    assert agree_floor(four, 2) == (4, T1)


def test_the_coordinator_reduces_as_the_all_reduce_does() -> None:
    assert reduced([[3, 1, -3, -1], [2, 1, -2, -1]]) == [2, 1, -3, -1]


def test_a_rank_history_keeps_its_newest_window_per_store_job_and_rank() -> None:
    job = f"job-{uuid.uuid4().hex[:8]}"
    for step in range(WINDOW + 3):
        remember_committed("127.0.0.1:1", job, 0, (step, f"dcp-{step:016x}-00", 2))
    remember_committed("127.0.0.1:1", job, 0, (WINDOW + 2, f"dcp-{WINDOW + 2:016x}-00", 2))  # told twice: kept once
    mine = save_history("127.0.0.1:1", job, 0)
    assert mine.rank == 0 and [v[0] for v in mine.committed] == list(range(3, WINDOW + 3))
    assert save_history("127.0.0.1:1", job, 1).committed == () and save_history("127.0.0.1:2", job, 0).committed == ()


def test_plan_infos_carry_the_floor_through_a_pickle() -> None:
    info = MemStoreSavePlanInfo("j", 3, 2, 1, T3, (2, T2))
    assert pickle.loads(pickle.dumps(info)) == info and MemStoreSavePlanInfo("j", 3, 2, 1, T3).floor is None
    history = SaveHistory(1, ((2, T2, 2),))
    assert pickle.loads(pickle.dumps(history)) == history
