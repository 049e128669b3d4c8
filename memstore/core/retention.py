"""Which steps a store may drop from RAM.

Per job, keep the newest ``keep`` steps whose copies on this store are all settled (verified and no
longer in flight), plus every newer in-flight step, plus the newest step restorable across the
cluster (which may be older when some rank lags behind). Everything else is evicted.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from memstore.core.model import ShardKey, ShardState


def retention_victims(
    held: Iterable[tuple[ShardKey, ShardState]],
    keep: int,
    protected_steps: Iterable[int] = (),
) -> list[ShardKey]:
    """Keys of one job's copies that fall outside the retention window."""
    by_step: dict[int, list[tuple[ShardKey, ShardState]]] = defaultdict(list)
    for key, state in held:
        by_step[key.step].append((key, state))
    settled = sorted((s for s, copies in by_step.items() if all(st.settled for _, st in copies)), reverse=True)
    if len(settled) <= keep:
        return []
    oldest_kept = settled[keep - 1]
    protected = set(protected_steps)
    victims = [
        key
        for step, copies in by_step.items()
        if step < oldest_kept and step not in protected
        for key, state in copies
        if state.settled  # a copy still in flight is never evicted; it counts once settled
    ]
    return sorted(victims)


def superseded_in_flight(held: Iterable[tuple[ShardKey, ShardState]], newer: ShardKey) -> list[ShardKey]:
    """In-flight copies of the same (job, rank) older than ``newer``: droppable under memory pressure.

    A newer save never waits on an older step's replication; the newest settled step is never among these.
    """
    return sorted(
        key for key, state in held if key.job_id == newer.job_id and key.rank == newer.rank and key.step < newer.step and not state.settled
    )


def pressure_victims(
    held: Iterable[tuple[ShardKey, ShardState]],
    newer: ShardKey,
    protected_steps: Iterable[int] = (),
) -> list[ShardKey]:
    """What to drop, in order, when ``newer`` does not fit in RAM.

    First the in-flight older copies of the same rank (``superseded_in_flight``), then whole settled
    steps of the job older than its newest settled step, oldest first, sparing the protected ones.
    The newest settled step is never offered: a new save must not cost the last good checkpoint.
    """
    held = list(held)
    first = superseded_in_flight(held, newer)
    by_step: dict[int, list[tuple[ShardKey, ShardState]]] = defaultdict(list)
    for key, state in held:
        if key.job_id == newer.job_id and key.step < newer.step:
            by_step[key.step].append((key, state))
    settled = sorted(s for s, copies in by_step.items() if all(st.settled for _, st in copies))
    protected = set(protected_steps)
    older = [key for step in settled[:-1] if step not in protected for key, _ in sorted(by_step[step])]
    return first + [k for k in older if k not in first]
