"""Capture rings: the segments one rank's saves land in, kept for that rank so its client registers them once.

A trainer's client maps the segments its saves land in and registers them for DMA (``cudaHostRegister``), which
costs about as much as faulting the memory in. So ``SegmentPool`` gives a segment a rank's save used back to
that rank only (``Segment.ring``): replicas, pulls and other ranks never take it, and it is never resized. A
ring grows over its first saves (or at ``prepare()``) to :func:`ring_limit` segments, then only recycles; the
client learns the ring's members with every allocation (``AllocateResponse.ring_paths``) and drops the mappings
of the rest.

A ring is as small as the guarantee allows: the kept steps and the save in flight. Under ``--redundancy ec:K+M``
(:func:`reserves_at_save`) it holds the kept steps only and its client reserves nothing ahead
(``AllocateResponse.reserve_at_save``): with ``--keep`` 2 or more (:func:`saves_recycle`) a save that finds its ring full
takes the segment of its rank's oldest kept step, which the store retires then (``memstore.server.engine.recycling``);
at ``--keep`` 1 it takes a fresh segment beside the only kept step's, which goes back to the kernel once retention
drops that step (not before: it stays restorable while the save is in flight). Otherwise (replicas) the next save's segment,
reserved ahead right after a commit, is the one retention frees once that save settles: the reservation waits for
it (``SegmentPool.acquire(wait=...)``) instead of growing the ring: for ``AHEAD_POLL_SECONDS`` per call, then the store
answers ``AllocateResponse.ring_busy`` and the client asks again, until its own deadline or until it closes (a
client closing never waits on a reservation the store holds). When saves outrun retention (a save comes while
every segment of its ring still holds a kept step or a save in flight), the ring grows for it (no kept step is
dropped early: retention alone knows which step is the newest restorable across the cluster), by ``RING_SLACK``
segments before it counts an overflow (``SegmentPool.ring_overflows``, in ``memstore status``), and it shrinks back
to its limit as segments come back: what it grew by stays pooled for the job, or, in a ring that recycles, goes back
to the kernel (``SegmentPool(pool_past_limit=False)``).
"""

from __future__ import annotations

from collections.abc import Iterable

from memstore.server.memory.segment import Segment

RING_SLACK = 1  # segments a ring may grow beyond its limit when saves outrun retention before it counts an overflow
AHEAD_POLL_SECONDS = 0.25  # how long one reservation ahead waits in the store for retention to free a segment of its full ring


def reserves_at_save(erasure_coded: bool) -> bool:
    """Whether a rank's capture ring holds its kept steps only, with no spare segment: its client reserves nothing ahead
    (``AllocateResponse.reserve_at_save``), a save takes its segment when it comes, and a segment released while the ring
    is at its limit goes back to the kernel (``SegmentPool(pool_past_limit=False)``). Under erasure coding, at every
    ``--keep``: a step's parity is about ``M/K`` of a shard, so a spare shard would cost more than its parity (at keep 1,
    ``ec:4+1`` settled at 2.25x a rank's state with it, 1.25x without). Replicas keep the spare."""
    return erasure_coded


def saves_recycle(keep: int, erasure_coded: bool) -> bool:
    """Whether a save into its rank's full capture ring takes the segment of the rank's oldest kept step
    (``memstore.server.engine.recycling``): under erasure coding, where a step commits once its parity is complete, so
    the newest committed step stays restorable while the save is in flight, and with ``keep`` 2 or more (with one kept
    step, recycling it would leave nothing restorable during the save)."""
    return erasure_coded and keep >= 2


def ring_limit(keep: int, at_save: bool = False) -> int:
    """How many segments a client fills its rank's capture ring to (``prepare()``, or over its first saves): the
    ``keep`` steps retention keeps and the one save in flight. The one reserved ahead for the next save is the
    oldest kept step's, once the newest save settles and retention lets it go. With ``at_save``
    (:func:`reserves_at_save`) the kept steps only: the save in flight takes the oldest kept step's segment
    (:func:`saves_recycle`), or at keep 1 a fresh one beside the kept step (the ring is one over its limit until the
    save settles and retention drops that step, whose segment then goes back to the kernel)."""
    return keep if at_save else keep + 1


def ring_order(seg: Segment, ring: int) -> tuple[bool, int]:
    """Sort key among a job's pooled segments for a save of rank ``ring``: that ring's first (its client has them
    mapped and registered), then the smallest."""
    return seg.ring != ring, seg.size


def ring_members(segments: Iterable[Segment], owner: str, ring: int) -> list[Segment]:
    """The segments of job ``owner``'s rank ``ring``'s capture ring among ``segments``."""
    return [s for s in segments if s.owner == owner and s.ring == ring]
