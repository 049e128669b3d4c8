"""Capture rings: the segments one rank's saves land in, kept for that rank so its client registers them once.

A trainer's client maps the segments its saves land in and registers them for DMA (``cudaHostRegister``), which
costs about as much as faulting the memory in. So ``SegmentPool`` gives a segment a rank's save used back to
that rank only (``Segment.ring``): replicas, pulls and other ranks never take it, and it is never resized. A
ring grows over its first saves to :func:`ring_limit` segments, then only recycles; the client learns the
ring's members with every allocation (``AllocateResponse.ring_paths``) and drops the mappings of the rest.
"""

from __future__ import annotations

from collections.abc import Iterable

from memstore.server.segment import Segment


def ring_limit(keep: int) -> int:
    """How many segments a client fills its rank's capture ring to (``prepare()``, or over its first saves): the
    ``keep`` steps retention keeps, the save just committed (retention evicts the oldest once it settles), the one
    reserved ahead, and two for retention running late. A ring that needs no more takes only its own segments
    back, so its client registers nothing more; one that does (retention later still) grows, off the save's path,
    and keeps up to twice this many."""
    return keep + 4


def ring_order(seg: Segment, ring: int) -> tuple[bool, int]:
    """Sort key among a job's pooled segments for a save of rank ``ring``: that ring's first (its client has them
    mapped and registered), then the smallest."""
    return seg.ring != ring, seg.size


def ring_members(segments: Iterable[Segment], owner: str, ring: int) -> list[Segment]:
    """The segments of job ``owner``'s rank ``ring``'s capture ring among ``segments``."""
    return [s for s in segments if s.owner == owner and s.ring == ring]
