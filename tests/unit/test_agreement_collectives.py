"""``trainer_client.agreement.agree`` over a real gloo group (ranks as threads): the fallback's answer never loses a
version that every rank's own store vouched for."""

from __future__ import annotations

from typing import Any

import pytest

from memstore.core.agreement import Seen
from tools.thread_ranks import on_every_rank
from trainer_client.agreement import AgreementStats, agree

pytestmark = pytest.mark.unit


def _agree(views: list[list[Seen]], cluster: Seen | None) -> list[Any]:
    def run(rank: int, group: Any) -> tuple[int, str] | None:
        found = agree(group, rank, len(views), None, lambda: (views[rank], True), lambda: (cluster, True), AgreementStats())
        return None if found is None else (found.step, found.timeline)

    results, _ = on_every_rank(len(views), run, timeout=60)
    return results


def seen(step: int, rank: int) -> Seen:
    return Seen(step, "t.0", 2, 100.0 + step, (rank,))


def test_an_empty_cluster_wide_answer_does_not_discard_the_version_every_rank_holds() -> None:
    # Rank 0 also holds step 6, which rank 1 lacks: the scoped views agree on 5 but ask the cluster about 6. A cluster-wide
    # listing that misses a store (its slot left vacant by a partial discovery answer) finds nothing restorable: every
    # rank still restores 5, not "no checkpoint" (a restart from scratch).
    views = [[seen(5, 0), seen(6, 0)], [seen(5, 1)]]
    assert _agree(views, None) == [(5, "t.0"), (5, "t.0")]


def test_the_cluster_wide_answer_decides_when_it_has_one() -> None:
    views = [[seen(5, 0), seen(6, 0)], [seen(5, 1)]]
    assert _agree(views, Seen(6, "t.0", 2, 106.0)) == [(6, "t.0"), (6, "t.0")]  # rank 1's copy of 6 is elsewhere
    assert _agree([[seen(6, 0)], []], None) == [None, None]  # nothing every rank holds: nothing to restore


def test_an_older_answer_from_an_incomplete_view_is_asked_again_until_the_peer_answers() -> None:
    # Rank 0's store could not list its peer (restarting, slow) the first two times: it sees only the durable tier's
    # step 4, while rank 1 holds step 9. Settling for 4 would lose five committed steps; the ranks ask again together
    # and restore 9 once the peer answers.
    durable4 = Seen(4, "t.0", 2, 104.0, (), durable=True)
    asked = [0, 0]

    def run(rank: int, group: Any) -> tuple[tuple[int, str] | None, int]:
        def local() -> tuple[list[Seen], bool]:
            asked[rank] += 1
            if rank == 1:
                return [seen(9, 1)], True
            return ([durable4], False) if asked[0] <= 2 else ([durable4, seen(9, 0)], True)

        def cluster() -> tuple[Seen | None, bool]:
            return (Seen(4, "t.0", 2, 104.0), False) if asked[0] <= 2 else (Seen(9, "t.0", 2, 109.0), True)

        stats = AgreementStats()
        found = agree(group, rank, 2, None, local, cluster, stats, retry_seconds=30)
        return (None if found is None else (found.step, found.timeline)), stats.retries

    results, _ = on_every_rank(2, run, timeout=60)
    assert results == [((9, "t.0"), 2), ((9, "t.0"), 2)]


def test_an_incomplete_view_stops_asking_at_its_deadline_and_restores_what_it_can() -> None:
    # The peer is really gone: after the deadline the older (durable) step stands on every rank.
    durable4 = Seen(4, "t.0", 2, 104.0, (), durable=True)

    def run(rank: int, group: Any) -> tuple[tuple[int, str] | None, int]:
        local = ([durable4], False) if rank == 0 else ([seen(9, 1)], True)
        stats = AgreementStats()
        found = agree(group, rank, 2, None, lambda: local, lambda: (Seen(4, "t.0", 2, 104.0), False), stats, retry_seconds=0.6)
        return (None if found is None else (found.step, found.timeline)), stats.retries

    results, _ = on_every_rank(2, run, timeout=60)
    assert [r[0] for r in results] == [(4, "t.0"), (4, "t.0")]
    assert results[0][1] == results[1][1] >= 1
