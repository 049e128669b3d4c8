"""Which steps can be restored, computed from what every reachable store reports it holds.

Shards are addressed by (job, step, rank, timeline): the timeline names the save that produced a
shard (a run of the job, or one DCP save), so two saves of the same step are two *versions* of it.

- A version (step, timeline) is **restorable** when every rank 0..world_size-1 has at least one
  verified copy of that version somewhere, all agreeing on world_size. Copies of different timelines
  never combine: a restore never mixes two saves.
- A version is **superseded** when a restorable version of *another* timeline, captured later, has a
  step at or below it. That is the job going back (a restart from an older checkpoint, a deliberate
  rollback) and completing a save on its new timeline: everything the abandoned timeline saved from
  that step on is dead. Until the new timeline completes a step, the old versions stay visible, so
  re-saving a step is atomic: the old version is the answer until the new one is complete.
- The **latest** restorable version is the newest step among restorable versions that are not
  superseded. The latest **replicated** one also has every rank on R hosts: the newest committed version.

Every answer is a pure function of the holdings, so callers that see the same holdings agree.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from memstore.core.model import Holding, ShardKey
from memstore.core.rebuildable import with_rebuilt


@dataclass(frozen=True)
class Version:
    """One saved version of one step: the shards of one timeline at that step."""

    step: int
    timeline: str
    world_size: int
    created_unix: float  # earliest capture among its copies


@dataclass(frozen=True)
class RestoreAnswer:
    """A store's answer to "which version to restore" (LatestStep), from the cluster's holdings.

    ``version`` is None when nothing is restorable; ``note`` then says why when a reason is known (e.g.
    ranks saved under different timelines). ``unreachable_hosts`` did not answer, so the view may be partial.
    """

    version: Version | None
    unreachable_hosts: tuple[str, ...] = ()
    note: str = ""


_VersionId = tuple[int, str]


def _versions(
    holdings: Iterable[Holding], job_id: str
) -> tuple[dict[_VersionId, set[int]], dict[_VersionId, set[int]], dict[_VersionId, float]]:
    """Per version of ``job_id`` (verified copies only, and shards parity rebuilds): ranks covered, world sizes
    claimed, earliest capture."""
    ranks: dict[_VersionId, set[int]] = defaultdict(set)
    sizes: dict[_VersionId, set[int]] = defaultdict(set)
    created: dict[_VersionId, float] = {}
    for h in with_rebuilt(holdings, job_id):
        if not h.verified:
            continue
        v = h.key.version
        ranks[v].add(h.key.rank)
        sizes[v].add(h.world_size)
        if h.created_unix and (not created.get(v) or h.created_unix < created[v]):
            created[v] = h.created_unix  # the earliest known capture; a copy without one (0) says nothing
        created.setdefault(v, 0.0)
    return ranks, sizes, created


def restorable_versions(holdings: Iterable[Holding], job_id: str) -> list[Version]:
    """Every restorable version of ``job_id``, superseded ones included, oldest step first.

    Versions whose copies disagree about world_size are never restorable: they cannot be assembled
    without mixing two different layouts.
    """
    ranks, sizes, created = _versions(holdings, job_id)
    out: list[Version] = []
    for v, covered in ranks.items():
        if len(sizes[v]) != 1:
            continue
        (world_size,) = sizes[v]
        if len(covered) == world_size and min(covered) >= 0 and max(covered) < world_size:  # every rank, without building range(world_size)
            out.append(Version(v[0], v[1], world_size, created[v]))
    return sorted(out, key=lambda x: (x.step, x.created_unix, x.timeline))


def supersedes(newer: Version, step: int, timeline: str, created_unix: float) -> bool:
    """True when restorable ``newer`` makes the version (step, timeline) captured at ``created_unix`` dead."""
    return newer.timeline != timeline and newer.step <= step and newer.created_unix > created_unix


def may_supersede(copies: Iterable[tuple[ShardKey, float]]) -> bool:
    """Whether any of these copies could supersede another (a later capture of another timeline at or below its step).

    A cheap local test: when it is False (one run saving forward, or a DCP save per step), no version can
    be superseded and nobody needs to ask the cluster.
    """
    earliest: dict[tuple[int, str], float] = {}
    for key, created in copies:
        v = key.version
        earliest[v] = min(created, earliest.get(v, created))
    versions = sorted(earliest.items(), key=lambda kv: kv[1])  # by capture time
    lowest_later: float = float("inf")
    timelines_later: set[str] = set()
    for (step, timeline), _ in reversed(versions):  # newest capture first
        if lowest_later <= step and timelines_later - {timeline}:
            return True
        lowest_later = min(lowest_later, step)
        timelines_later.add(timeline)
    return False


def superseded_versions(holdings: Iterable[Holding], job_id: str) -> set[tuple[int, str]]:
    """(step, timeline) of every held version of ``job_id`` (complete or not) that a newer timeline superseded."""
    holdings = list(holdings)
    _, _, created = _versions(holdings, job_id)
    complete = restorable_versions(holdings, job_id)
    return {v for v, t in created.items() if any(supersedes(w, v[0], v[1], t) for w in complete)}


def latest_restorable(holdings: Iterable[Holding], job_id: str, step: int | None = None) -> Version | None:
    """The version to restore: of the newest step (``step`` None) or of exactly ``step``; None if there is none.

    For an explicit step, a superseded version is still returned when it is the only restorable one
    of that step (the caller asked for that step by number); a live one is preferred.
    """
    return latest_among(restorable_versions(holdings, job_id), step)


def latest_settled(holdings: Iterable[Holding], job_id: str) -> Version | None:
    """The newest live version restorable from settled copies alone (no parity rebuild counted): every rank's save of it
    went through, its protection done (ec:K+M: its parity complete, or failed for good). What a restorable floor means
    (``memstore.core.floors``), learnt by listing; None if there is none."""
    return latest_restorable([h for h in holdings if h.settled and h.parity is None], job_id)


def latest_replicated(holdings: Iterable[Holding], job_id: str, copies: int) -> Version | None:
    """The newest live restorable version every rank of which has verified copies on at least ``copies`` hosts: with
    ``copies`` = R, the newest committed version, the one that survives the loss of any R-1 hosts.

    It may be older than :func:`latest_restorable`: a newer version can be restorable from a single copy (its
    replication failed), which the loss of one host takes away. None if there is none."""
    holdings = [h for h in with_rebuilt(holdings, job_id) if h.verified]
    hosts: dict[tuple[int, str, int], set[str]] = defaultdict(set)
    for h in holdings:
        hosts[(h.key.step, h.key.timeline, h.key.rank)].add(h.host)
    live = _live(restorable_versions(holdings, job_id))
    replicated = [v for v in live if all(len(hosts[(v.step, v.timeline, r)]) >= copies for r in range(v.world_size))]
    return max(replicated, key=lambda v: (v.step, v.created_unix), default=None)


def latest_among(complete: list[Version], step: int | None = None) -> Version | None:
    """:func:`latest_restorable` over restorable versions already known (the rule, without the holdings)."""
    live = _live(complete)
    if step is None:
        return max(live, key=lambda v: (v.step, v.created_unix), default=None)
    at_step = [v for v in live if v.step == step] or [v for v in complete if v.step == step]
    return max(at_step, key=lambda v: v.created_unix, default=None)


def _live(complete: list[Version]) -> list[Version]:
    """The restorable versions no other one supersedes."""
    return [v for v in complete if not any(supersedes(w, v.step, v.timeline, v.created_unix) for w in complete)]


def latest_restorable_step(holdings: Iterable[Holding], job_id: str) -> tuple[int, int] | None:
    """(step, world_size) of the newest restorable version, or None if there is none."""
    v = latest_restorable(holdings, job_id)
    return None if v is None else (v.step, v.world_size)


def split_timelines(holdings: Iterable[Holding], job_id: str) -> tuple[int, list[str]] | None:
    """A step whose every rank has a copy, but only under different timelines (none complete): why nothing restores.

    That is what ranks that never agreed on a timeline leave behind (separate processes without a
    process group or a shared run id). Returns (step, timelines) of the newest such step, or None.
    """
    holdings = [h for h in holdings if h.key.job_id == job_id and h.verified]
    complete = {(v.step, v.timeline) for v in restorable_versions(holdings, job_id)}
    by_step: dict[int, list[Holding]] = defaultdict(list)
    for h in holdings:
        by_step[h.key.step].append(h)
    for step in sorted(by_step, reverse=True):
        copies = by_step[step]
        timelines = sorted({h.key.timeline for h in copies})
        sizes = {h.world_size for h in copies}
        if len(timelines) < 2 or len(sizes) != 1 or any((step, t) in complete for t in timelines):
            continue
        if {h.key.rank for h in copies} == set(range(sizes.pop())):
            return step, timelines
    return None


def sources_for(holdings: Iterable[Holding], key: ShardKey, prefer: Iterable[str] = ()) -> list[str]:
    """Hosts holding a verified copy of ``key``: preferred hosts first (in the given order), then by id."""
    hosts = sorted({h.host for h in holdings if h.key == key and h.verified})
    preferred = [p for p in prefer if p in hosts]
    return preferred + [h for h in hosts if h not in preferred]
