"""``trainer_client.agreement.agree`` over a real gloo group (ranks as threads): the fallback's answer never loses a
version that every rank's own store vouched for."""

from __future__ import annotations

from typing import Any

import pytest

from memstore.core.agreement import Seen
from memstore.devtools.ranks import on_every_rank
from trainer_client.agreement import AgreementStats, agree

pytestmark = pytest.mark.unit


def _agree(views: list[list[Seen]], cluster: Seen | None) -> list[Any]:
    def run(rank: int, group: Any) -> tuple[int, str] | None:
        found = agree(group, rank, len(views), None, lambda: views[rank], lambda: cluster, AgreementStats())
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
