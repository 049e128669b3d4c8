"""Agreeing on the version to restore through the job's process group, from each rank's local view.

The unscoped question (``LatestStep`` without ranks) has one store list every store of the cluster:
asked by every rank, that is O(ranks x hosts) calls per restart. The *scoped* protocol
(``latest_step(group=...)``) costs O(replicas) calls per rank instead:

1. Each rank asks only its local store which versions of the job hold a verified copy of *its own*
   shard. The store looks in its own memory and in its placement group's (the hosts that hold copies
   of the shards it holds); rank 0's store also lists the durable tier, once for the whole job, and
   reports the versions complete there (:func:`seen_versions`).
2. Rank 0's versions are the *candidates*: a version restorable for every rank has a copy of rank 0's
   shard, so it is among them (or complete on durable storage, which rank 0 listed). They reach every
   rank as bytes (:func:`encode_candidates`).
3. Every rank fills one int64 vector over the candidates (:func:`rank_vector`): whether its shard is
   there, the world size its copy claims (as ``ws`` and ``-ws``), its capture time, and minus the
   newest step it has seen at all. One element-wise MIN over all ranks combines them.
4. :func:`decide` turns the combined vector into the answer. It is a pure function of values every
   rank holds identically after the reduction, so every rank gets the same answer.

The scoped view cannot tell a shard that is missing from one held outside the rank's group (a rank
that moved to another host, a different world size). So when the newest step any rank has seen is
not the answer, :func:`decide` asks for the *fallback*: rank 0 asks the cluster-wide question once
and shares that answer the same way. A restart after a save that did not complete on every rank pays
that one cluster-wide listing; it never gets a step that is not restorable.

Plain Python: the collectives themselves are the client's (``trainer_client.agreement``).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from memstore.core.model import Holding
from memstore.core.rebuildable import with_rebuilt
from memstore.core.restorable import Version, latest_among, restorable_versions

_NS = 1_000_000_000
#: Values per candidate in a rank's vector: present, world size, minus world size, capture time (ns).
PER_CANDIDATE = 4
#: Most candidates one agreement carries (rank 0 sees at most keep x timelines versions, plus durable ones).
MAX_CANDIDATES = 4096


@dataclass(frozen=True)
class Seen:
    """A version of the job as one store sees it for the ranks it was asked about.

    ``ranks`` are the asked ranks with a verified copy in the store's scope; ``durable`` marks a version
    complete (every rank) on durable storage, where ``ranks`` is empty. ``world_size`` is 0 when copies
    disagree about it (such a version is never restorable).
    """

    step: int
    timeline: str
    world_size: int
    created_unix: float
    ranks: tuple[int, ...] = ()
    durable: bool = False


def seen_versions(holdings: Iterable[Holding], job_id: str, ranks: Sequence[int], durable: Iterable[Holding] = ()) -> list[Seen]:
    """What a store reports to a scoped LatestStep: per version, which of ``ranks`` it found verified copies of
    in ``holdings`` (or that their parity rebuilds: ``memstore.core.rebuildable``), and every version complete in
    ``durable`` (the durable tier's holdings, when listed)."""
    wanted = set(ranks)
    covered: dict[tuple[int, str], set[int]] = defaultdict(set)
    sizes: dict[tuple[int, str], set[int]] = defaultdict(set)
    created: dict[tuple[int, str], float] = {}
    for h in with_rebuilt(holdings, job_id):
        if not h.verified or h.key.rank not in wanted:
            continue
        v = h.key.version
        covered[v].add(h.key.rank)
        sizes[v].add(h.world_size)
        if h.created_unix and (not created.get(v) or h.created_unix < created[v]):
            created[v] = h.created_unix
        created.setdefault(v, 0.0)
    out = [Seen(v[0], v[1], next(iter(sizes[v])) if len(sizes[v]) == 1 else 0, created[v], tuple(sorted(covered[v]))) for v in covered]
    out += [Seen(v.step, v.timeline, v.world_size, v.created_unix, (), True) for v in restorable_versions(durable, job_id)]
    return sorted(out, key=lambda s: (s.step, s.timeline, s.durable))


def encode_candidates(versions: Sequence[Seen]) -> bytes:
    """Rank 0's candidates as bytes for the other ranks (JSON: no code runs when they are read)."""
    rows = [[s.step, s.timeline, s.world_size, round(s.created_unix * _NS), s.durable] for s in versions[-MAX_CANDIDATES:]]
    return json.dumps(rows, separators=(",", ":")).encode()


def decode_candidates(data: bytes) -> list[Seen]:
    """The inverse of :func:`encode_candidates`; raises ValueError on bytes it did not produce."""
    rows = json.loads(data.decode())
    if not isinstance(rows, list):
        raise ValueError("candidates must be a list")
    out = []
    for row in rows:
        if not (isinstance(row, list) and len(row) == 5 and isinstance(row[1], str)):
            raise ValueError(f"bad candidate row {row!r:.80}")
        step, timeline, world_size, created_ns, durable = row
        if not all(type(x) is int for x in (step, world_size, created_ns)) or type(durable) is not bool:
            raise ValueError(f"bad candidate row {row!r:.80}")
        out.append(Seen(step, timeline, world_size, created_ns / _NS, (), durable))
    return out


def rank_vector(candidates: Sequence[Seen], mine: Sequence[Seen], rank: int) -> list[int]:
    """This rank's contribution to the MIN reduction: per candidate (present, ws, -ws, capture ns), then -newest step seen.

    A candidate complete on durable storage counts as present for every rank. A rank that has no copy
    of a candidate contributes values that make it incomplete (present 0) and leave the others alone.
    """
    have = {(s.step, s.timeline): s for s in mine if rank in s.ranks}
    out: list[int] = []
    for c in candidates:
        s = have.get((c.step, c.timeline))
        if c.durable:
            out += [1, c.world_size, -c.world_size, round(c.created_unix * _NS)]
        elif s is None:
            out += [0, 2**62, 2**62, 2**62]
        else:
            out += [1, s.world_size, -s.world_size, round(s.created_unix * _NS)]
    newest = max((s.step for s in mine if rank in s.ranks or s.durable), default=-1)
    return [*out, -newest]


@dataclass(frozen=True)
class Decision:
    """The agreed answer: ``version`` (None: nothing restorable in the scoped view), and whether rank 0 must
    ask the cluster-wide question instead (``fallback``: the scoped view saw a newer step it cannot vouch for)."""

    version: Version | None
    fallback: bool
    newest_seen: int


def decide(candidates: Sequence[Seen], reduced: Sequence[int], world_size: int, step: int | None = None) -> Decision:
    """The version to restore from the MIN-reduced vectors of all ``world_size`` ranks (see the module doc)."""
    if len(reduced) != PER_CANDIDATE * len(candidates) + 1:
        raise ValueError(f"reduced vector has {len(reduced)} values for {len(candidates)} candidates")
    complete: list[Version] = []
    for i, c in enumerate(candidates):
        present, ws_min, neg_ws_max, created_ns = reduced[PER_CANDIDATE * i : PER_CANDIDATE * (i + 1)]
        if present == 1 and ws_min == -neg_ws_max == world_size:
            complete.append(Version(c.step, c.timeline, world_size, created_ns / _NS))
    complete.sort(key=lambda v: (v.step, v.created_unix, v.timeline))
    version = latest_among(complete, step)
    newest_seen = -reduced[-1]
    if step is None:
        fallback = newest_seen >= 0 and (version is None or version.step < newest_seen)
    else:
        fallback = version is None and newest_seen >= 0
    return Decision(version, fallback, newest_seen)
