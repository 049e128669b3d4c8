"""Eviction alone, under a catalog over a fake pool: retention's drops, what it protects from pressure, and deletes
(the pressure that ``Room`` applies through it: test_room.py, test_engine_assembler.py)."""

from __future__ import annotations

import pytest

from memstore.core.model import ShardKey
from memstore.errors import UnknownJob
from memstore.server.engine.eviction import Eviction
from tests.unit.engine_fakes import KiB, config, make_catalog, room_of, settled

pytestmark = pytest.mark.unit
DATA = bytes(range(256)) * 32  # 8 KiB: two chunks


def key(step: int, rank: int = 0, job: str = "job") -> ShardKey:
    return ShardKey(job, step, rank)


def test_retire_drops_superseded_versions_then_keeps_k_but_never_a_protected_step() -> None:
    catalog, _, _ = make_catalog()  # keep 2
    eviction = Eviction(catalog)
    for step in (1, 2, 3, 4):
        settled(catalog, key(step), DATA, created=float(step))
    eviction.retire("job", catalog.held("job"), dead={(4, "")}, latest=3, protected=[1])
    assert sorted(k.step for k, _, _ in catalog.held("job")) == [1, 2, 3]  # 4 superseded; the newest 2, and 1 protected
    eviction.retire("job", catalog.held("job"), dead=set(), latest=3, protected=[])
    assert sorted(k.step for k, _, _ in catalog.held("job")) == [2, 3]


def test_the_newest_restorable_step_retire_was_told_of_is_kept_under_pressure() -> None:
    catalog, _, _ = make_catalog(config(capacity="32KiB", keep="3"))
    eviction = Eviction(catalog)
    for step in (1, 2, 3):
        settled(catalog, key(step), DATA, created=float(step))
    eviction.retire("job", catalog.held("job"), dead=set(), latest=1, protected=[1])  # step 1 is the newest restorable one (its peers lag)
    room_of(catalog, eviction).acquire(key(4), 10 * KiB)  # one older copy has to go
    assert sorted(k.step for k, _, _ in catalog.held("job")) == [1, 3]  # step 2 went, not the protected step 1


def test_a_deleted_shard_is_not_pulled_back_by_repair_for_a_while() -> None:
    catalog, _, _ = make_catalog(config())
    eviction = Eviction(catalog)
    for step in (1, 2):
        settled(catalog, ShardKey("job", step, 0), bytes(4 * KiB))
    assert eviction.delete("job", 1, -1) == 1
    assert eviction.recently_deleted(ShardKey("job", 1, 0)) and eviction.recently_deleted(ShardKey("job", 1, 3))
    assert not eviction.recently_deleted(ShardKey("job", 2, 0)) and not eviction.recently_deleted(ShardKey("other", 1, 0))


def test_a_delete_names_a_job_held_here_and_counts_what_it_dropped() -> None:
    catalog, _, _ = make_catalog()
    eviction = Eviction(catalog)
    for step in (1, 2):
        for rank in (0, 1):
            settled(catalog, key(step, rank), DATA)
    assert eviction.delete("job", 7, -1) == 0  # a step not held: nothing, but the job is known
    assert eviction.delete("job", -1, 1) == 2 and sorted(k.rank for k, _, _ in catalog.held("job")) == [0, 0]
    assert eviction.delete("job", -1, -1) == 2 and catalog.held("job") == []
    with pytest.raises(UnknownJob, match="job 'job' is unknown to store h0"):
        eviction.delete("job", -1, -1)
