"""The scoped restore agreement's pure rules (memstore.core.agreement), with the ranks' reduction done by hand."""

from __future__ import annotations

import pytest

from memstore.core.agreement import PER_CANDIDATE, Seen, decide, decode_candidates, encode_candidates, rank_vector, seen_versions
from memstore.core.model import Holding, ShardKey

pytestmark = pytest.mark.unit
JOB = "job"


def held(host: str, step: int, rank: int, timeline: str = "t.0", world: int = 4, created: float = 100.0, verified: bool = True) -> Holding:
    return Holding(host, ShardKey(JOB, step, rank, timeline), world, verified, created)


def agree_by_hand(views: list[list[Seen]], world: int, step: int | None = None):  # type: ignore[no-untyped-def]
    """What the collectives compute: rank 0's candidates, then the element-wise MIN of every rank's vector."""
    candidates = decode_candidates(encode_candidates(views[0]))
    vectors = [rank_vector(candidates, mine, rank) for rank, mine in enumerate(views)]
    reduced = [min(column) for column in zip(*vectors, strict=True)]
    return decide(candidates, reduced, world, step)


def view_of(rank: int, holdings: list[Holding], durable: list[Holding] = ()) -> list[Seen]:  # type: ignore[assignment]
    return seen_versions(holdings, JOB, [rank], durable)


def test_seen_versions_reports_only_the_asked_ranks_verified_copies() -> None:
    holdings = [held("h0", 1, 0), held("h1", 1, 0, created=90.0), held("h0", 1, 1), held("h0", 2, 0, verified=False), held("h0", 3, 2)]
    (v,) = seen_versions(holdings, JOB, [0])
    assert (v.step, v.timeline, v.world_size, v.created_unix, v.ranks, v.durable) == (1, "t.0", 4, 90.0, (0,), False)
    conflicting = [held("h0", 1, 0, world=4), held("h1", 1, 0, world=8)]
    assert seen_versions(conflicting, JOB, [0])[0].world_size == 0


def test_every_rank_holding_its_shard_agrees_on_the_newest_step() -> None:
    cluster = [held(f"h{r // 2}", s, r) for s in (1, 2, 3) for r in range(4)]
    views = [view_of(r, cluster) for r in range(4)]
    d = agree_by_hand(views, 4)
    assert d.version is not None and (d.version.step, d.version.timeline) == (3, "t.0")
    assert not d.fallback and d.newest_seen == 3


def test_a_rank_missing_the_newest_step_gets_the_older_one_and_asks_for_the_fallback() -> None:
    cluster = [held("h0", s, r) for s in (1, 2) for r in range(4)] + [held("h0", 3, r) for r in (0, 1, 2)]
    d = agree_by_hand([view_of(r, cluster) for r in range(4)], 4)
    assert d.version is not None and d.version.step == 2
    assert d.fallback  # rank 0 saw step 3, which the scoped view cannot vouch for


def test_a_step_rank_0_lacks_is_not_a_candidate_and_the_fallback_decides() -> None:
    cluster = [held("h0", 1, r) for r in range(4)] + [held("h1", 2, r) for r in (1, 2, 3)]
    d = agree_by_hand([view_of(r, cluster) for r in range(4)], 4)
    assert d.version is not None and d.version.step == 1 and d.fallback and d.newest_seen == 2


def test_versions_complete_on_durable_storage_count_for_every_rank() -> None:
    durable = [held("durable", 5, r) for r in range(4)]
    views = [view_of(0, [], durable)] + [view_of(r, []) for r in (1, 2, 3)]  # only rank 0's store listed it
    d = agree_by_hand(views, 4)
    assert d.version is not None and d.version.step == 5 and not d.fallback


def test_a_world_size_other_than_the_clients_is_never_agreed() -> None:
    cluster = [held("h0", 1, r, world=8) for r in range(8)]
    d = agree_by_hand([view_of(r, cluster) for r in range(4)], 4)
    assert d.version is None and d.fallback  # ranks 4..7 were never asked: only the cluster-wide answer may say


def test_a_newer_timeline_supersedes_an_abandoned_one_as_the_cluster_wide_rule_does() -> None:
    old = [held("h0", s, r, "old.0", world=2, created=10.0 + s) for s in (5, 6) for r in range(2)]
    new = [held("h0", 5, r, "new.0", world=2, created=50.0) for r in range(2)]
    d = agree_by_hand([view_of(r, old + new) for r in range(2)], 2)
    assert d.version is not None and (d.version.step, d.version.timeline) == (5, "new.0")
    assert d.fallback  # the abandoned step 6 is newer than the answer: rank 0 confirms with the cluster


def test_nothing_held_is_none_without_a_fallback() -> None:
    d = agree_by_hand([[], [], []], 3)
    assert d.version is None and not d.fallback and d.newest_seen == -1


def test_an_explicit_step_is_agreed_or_left_to_the_fallback() -> None:
    cluster = [held("h0", s, r, world=2) for s in (1, 2) for r in range(2)]
    views = [view_of(r, cluster) for r in range(2)]
    d = agree_by_hand(views, 2, step=1)
    assert d.version is not None and d.version.step == 1 and not d.fallback
    assert agree_by_hand(views, 2, step=7).fallback


def test_candidates_survive_the_wire_and_bad_bytes_are_refused() -> None:
    seen = [Seen(3, "t.0", 4, 123.456789, (0,), False), Seen(4, "t.1", 4, 0.0, (), True)]
    back = decode_candidates(encode_candidates(seen))
    assert [(s.step, s.timeline, s.world_size, s.durable) for s in back] == [(3, "t.0", 4, False), (4, "t.1", 4, True)]
    assert abs(back[0].created_unix - 123.456789) < 1e-6
    for bad in (b'{"a": 1}', b'[[1, "t", 4, 0]]', b'[[1, "t", 4, 0.5, false]]', b'[["1", "t", 4, 0, false]]'):
        with pytest.raises(ValueError):
            decode_candidates(bad)
    with pytest.raises(ValueError, match="reduced vector"):
        decide(back, [0] * (PER_CANDIDATE * 2), 4)
