"""Which copies a store may drop from RAM.

Copies are grouped into *versions* (one step of one timeline, see ``memstore.core.restorable``) and
versions are ordered by recency: by the start of their timeline first (the earliest capture this
store holds of it), then by step. Within one run that is step order; after the job went back to an
older step (a restart from an older checkpoint, a rollback), the new timeline's steps rank above every
step of the abandoned one, whatever their numbers. Ordering by step number alone would keep the
abandoned run's higher steps and evict the new run's fresh saves.

Per job, keep the newest ``keep`` versions whose copies on this store are all settled (verified and
no longer in flight), plus every in-flight copy, plus the protected steps (the newest step restorable
across the cluster, steps due for spilling), plus every version at or above the job's restorable floor when
the store knows one (``memstore.core.floors``: none of those can be ruled out as the newest restorable).
Everything else is evicted.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

from memstore.core.model import ShardKey, ShardState

Held = tuple[ShardKey, ShardState, float]  # a copy on this store: key, state, capture time (unix seconds)
Order = tuple[float, int]


def timeline_starts(copies: Iterable[tuple[ShardKey, float]]) -> dict[str, float]:
    """timeline -> earliest capture time among ``copies`` (its start, as far as they show)."""
    starts: dict[str, float] = {}
    for key, created in copies:
        if key.timeline not in starts or created < starts[key.timeline]:
            starts[key.timeline] = created
    return starts


def recency(key: ShardKey, starts: dict[str, float]) -> Order:
    """Sort key of ``key``'s version: a timeline nobody holds yet is the newest (it is being started now)."""
    return starts.get(key.timeline, math.inf), key.step


def ranked_versions(copies: Iterable[tuple[ShardKey, float]], keep: int) -> list[tuple[int, str]]:
    """(step, timeline) of the ``keep`` most recent versions among ``copies``, the newest first (repair pulls only
    these, in this order)."""
    copies = list(copies)
    starts = timeline_starts(copies)
    versions = sorted({key.version: recency(key, starts) for key, _ in copies}.items(), key=lambda kv: kv[1], reverse=True)
    return [v for v, _ in versions[:keep]]


def newest_versions(copies: Iterable[tuple[ShardKey, float]], keep: int) -> set[tuple[int, str]]:
    """(step, timeline) of the ``keep`` most recent versions among ``copies``."""
    return set(ranked_versions(copies, keep))


def repair_waves(keys: Iterable[ShardKey], ranked: dict[str, list[tuple[int, str]]]) -> list[list[ShardKey]]:
    """``keys`` (shards to pull, each of a version in its job's ``ranked`` list) in waves: the newest version of every
    job first, then the next. A replacement host fills the step a restarted trainer restores before the older ones,
    instead of sharing its bandwidth (and its fresh memory's faulting) between them."""
    waves: dict[int, list[ShardKey]] = defaultdict(list)
    for key in keys:
        waves[ranked[key.job_id].index(key.version)].append(key)
    return [waves[i] for i in sorted(waves)]


def _versions(held: list[Held]) -> tuple[dict[tuple[int, str], list[Held]], dict[tuple[int, str], Order]]:
    starts = timeline_starts((k, c) for k, _, c in held)
    by_version: dict[tuple[int, str], list[Held]] = defaultdict(list)
    order: dict[tuple[int, str], Order] = {}
    for copy in held:
        by_version[copy[0].version].append(copy)
        order[copy[0].version] = recency(copy[0], starts)
    return by_version, order


def _floor_order(floor: tuple[int, str] | None, held: list[Held]) -> Order | None:
    """Where ``floor`` (a version: step, timeline) ranks among ``held``'s versions; None: no floor."""
    if floor is None:
        return None
    starts = timeline_starts((k, c) for k, _, c in held)
    return starts.get(floor[1], math.inf), floor[0]


def steps_from(held: Iterable[Held], bound: tuple[int, str] | None) -> set[int]:
    """Steps of ``held``'s versions that rank at or above the version ``bound`` (step, timeline): all of them when
    ``bound`` is None or of a timeline none of ``held`` is of (where it ranks among them is unknown)."""
    held = list(held)
    at = _floor_order(bound, held)
    if at is None or at[0] == math.inf:
        return {k.step for k, _, _ in held}
    starts = timeline_starts((k, c) for k, _, c in held)
    return {k.step for k, _, _ in held if recency(k, starts) >= at}


def retention_victims(
    held: Iterable[Held], keep: int, protected_steps: Iterable[int] = (), floor: tuple[int, str] | None = None
) -> list[ShardKey]:
    """Keys of one job's copies that fall outside the retention window; with a ``floor``, only versions below it."""
    held = list(held)
    by_version, order = _versions(held)
    settled = sorted((v for v, copies in by_version.items() if all(st.settled for _, st, _ in copies)), key=order.__getitem__, reverse=True)
    if len(settled) <= keep:
        return []
    oldest_kept = order[settled[keep - 1]]
    at_floor = _floor_order(floor, held)
    if at_floor is not None:
        oldest_kept = min(oldest_kept, at_floor)
    protected = set(protected_steps)
    victims = [
        key
        for v, copies in by_version.items()
        if order[v] < oldest_kept and v[0] not in protected
        for key, state, _ in copies
        if state.settled  # a copy still in flight is never evicted; it counts once settled
    ]
    return sorted(victims)


def recycled_copy(
    held: Iterable[Held], restorable: Iterable[tuple[int, str] | None] = (), protected_steps: Iterable[int] = ()
) -> ShardKey | None:
    """The copy whose segment one rank's next save takes when its capture ring is full (ec:K+M with keep >= 2,
    ``memstore.server.engine.recycling``); None when there is none.

    ``held``: that rank's own copies on this store, one per version. ``restorable``: versions (step, timeline) known
    restorable job-wide, every rank's save of them settled (the job's restorable floor, the newest such version retention
    learnt by listing the cluster; None: not known). It is the copy of the oldest version, settled, when a version of
    ``restorable`` is newer than it and held here ``COMMITTED`` (its parity complete): the job then keeps a version every
    rank can restore, this rank's copy of which survives a lost store, while the save is in flight. Not when the oldest's
    step is protected (due for spilling), nor when nothing newer is known restorable: a store that knows only that its
    own rank's newer step committed cannot tell whether another rank's save of it is still in flight, and the older step
    may be the newest every rank can restore after a loss (the ring grows instead)."""
    by_version, order = _versions(list(held))
    ranked = sorted(by_version, key=order.__getitem__)
    if len(ranked) < 2 or ranked[0][0] in set(protected_steps):
        return None
    oldest = by_version[ranked[0]]
    if len(oldest) != 1 or not oldest[0][1].settled:
        return None
    known = [by_version[v] for v in {v for v in restorable if v is not None} if v in by_version and order[v] > order[ranked[0]]]
    if not any(all(state is ShardState.COMMITTED for _, state, _ in copies) for copies in known):
        return None
    return oldest[0][0]


def superseded_in_flight(held: Iterable[Held], newer: ShardKey) -> list[ShardKey]:
    """In-flight copies of the same (job, rank) older than ``newer``: droppable under memory pressure.

    A newer save never waits on an older step's replication; the newest settled step is never among these.
    """
    held = list(held)
    starts = timeline_starts((k, c) for k, _, c in held)
    mine = recency(newer, starts)
    return sorted(
        key
        for key, state, _ in held
        if key.job_id == newer.job_id and key.rank == newer.rank and recency(key, starts) < mine and not state.settled
    )


def pressure_victims(
    held: Iterable[Held], newer: ShardKey, protected_steps: Iterable[int] = (), floor: tuple[int, str] | None = None
) -> list[ShardKey]:
    """What to drop, in order, when ``newer`` does not fit in RAM.

    First the in-flight older copies of the same rank (``superseded_in_flight``), then whole settled
    versions of the job older than ``newer`` except its newest settled one, oldest first, sparing the
    protected steps and every version at or above the ``floor``. The newest settled version is never offered: a
    new save must not cost the last good checkpoint.
    """
    held = [h for h in held if h[0].job_id == newer.job_id]
    first = superseded_in_flight(held, newer)
    starts = timeline_starts((k, c) for k, _, c in held)
    mine = recency(newer, starts)
    by_version, order = _versions(held)
    older = [v for v in by_version if order[v] < mine]
    settled = sorted((v for v in older if all(st.settled for _, st, _ in by_version[v])), key=order.__getitem__)
    protected = set(protected_steps)
    at_floor = _floor_order(floor, held)
    spared = [v for v in settled[:-1] if v[0] in protected or (at_floor is not None and order[v] >= at_floor)]
    rest = [key for v in settled[:-1] if v not in spared for key, _, _ in sorted(by_version[v])]
    return first + [k for k in rest if k not in first]
