"""Which steps can be restored, computed from what every reachable store reports it holds.

A step is restorable when every rank 0..world_size-1 has at least one verified copy somewhere.
The answer is a pure function of the holdings, so callers that see the same holdings agree.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from memstore.core.model import Holding, ShardKey


def restorable_steps(holdings: Iterable[Holding], job_id: str) -> dict[int, int]:
    """Map step -> world_size of every restorable step of ``job_id``.

    Steps whose copies disagree about world_size are never restorable: they cannot be assembled
    without mixing two different runs' layouts.
    """
    ranks: dict[int, set[int]] = defaultdict(set)
    sizes: dict[int, set[int]] = defaultdict(set)
    for h in holdings:
        if h.key.job_id != job_id or not h.verified:
            continue
        ranks[h.key.step].add(h.key.rank)
        sizes[h.key.step].add(h.world_size)
    out: dict[int, int] = {}
    for step, covered in ranks.items():
        if len(sizes[step]) != 1:
            continue
        (world_size,) = sizes[step]
        if covered == set(range(world_size)):
            out[step] = world_size
    return out


def latest_restorable_step(holdings: Iterable[Holding], job_id: str) -> tuple[int, int] | None:
    """(step, world_size) of the newest restorable step, or None if there is none."""
    steps = restorable_steps(holdings, job_id)
    if not steps:
        return None
    step = max(steps)
    return step, steps[step]


def sources_for(holdings: Iterable[Holding], key: ShardKey, prefer: Iterable[str] = ()) -> list[str]:
    """Hosts holding a verified copy of ``key``: preferred hosts first (in the given order), then by id."""
    hosts = sorted({h.host for h in holdings if h.key == key and h.verified})
    preferred = [p for p in prefer if p in hosts]
    return preferred + [h for h in hosts if h not in preferred]
