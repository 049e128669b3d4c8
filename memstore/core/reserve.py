"""How much fresh, pre-faulted memory a store keeps ready, and in what pieces (``--prefault``).

The first touch of fresh shared memory costs ~10x a copy into memory that is already faulted in (the
kernel allocates, zeroes and maps every page), so a store that allocates a segment when a save arrives
makes that save stall for it. The *reserve* is memory faulted in ahead of need: segments that never
held any job's bytes, handed to whichever shard (a trainer's save, a peer's replica, a repair) needs one
next, and refilled in the background.

Pure policy; the engine (``memstore.server.reserve.Reserve``, in ``SegmentPool``) holds the segments, does the
faulting and keeps every reserved byte inside ``--capacity``.

- ``prefault=None`` (``--prefault auto``, the default): nothing at start-up, unless the store replaces a host
  whose group holds shards for it (``expect``: the newest step of each, faulted in before it serves, up to two
  units); once shards have been seen, keep two *units* ready, a unit being the largest shard this store saw
  lately. The first shard of a fresh job pays for fresh memory; the saves, copies and repairs after it find the
  reserve.
- ``prefault=N`` bytes: keep at least N bytes faulted in from start-up: the shards the store holds, its
  pooled segments and the reserve together. N/(keep+3) of it is faulted in before the store serves at all
  (``before_serving``), the rest in the background. Shards take their memory from the reserve; it is refilled
  while the store holds less than N, and one segment is always kept ready. Size N for the segments the store cycles through (per rank
  saving here and per replica held here, ``keep + 3`` shards: the kept steps, the one being saved, the one
  reserved ahead for the next save, and the one kept ready): then no save, copy or repair ever waits for fresh
  memory, nothing is faulted in once the first saves have run, and the idle cost is N. Reserve segments are
  ``unit`` bytes (``--prefault-unit``), else the largest shard seen lately, else, before any shard, N/(keep+3); one larger
  than the shard that takes it is shrunk to fit (the rest goes back to the kernel).
- ``prefault=0``: no reserve.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

AUTO_UNITS = 2  # units the automatic reserve keeps ready
RECENT = 32  # shard sizes remembered to choose the unit
HEADROOM = 128  # a reserve segment is 1/128 larger than its unit (room for the shard's header)
MIN_UNIT = 1 << 20  # smaller shards are not worth a reserve of their own (they fault in fast)


@dataclass(frozen=True)
class ReserveGoal:
    """What to keep ready: ``target`` bytes in segments of ``unit`` bytes (nothing when either is 0)."""

    unit: int
    target: int

    @property
    def segment_bytes(self) -> int:
        """Bytes of each reserve segment: the unit plus headroom for the shard's header, so a shard of exactly
        the unit's tensor bytes fits without growing the segment."""
        return self.unit + self.unit // HEADROOM

    def wants_another(self, reserved: int) -> bool:
        """Whether one more segment fits the goal, with ``reserved`` bytes ready or being faulted in."""
        return self.unit > 0 and reserved + self.segment_bytes // 2 <= self.target  # whole segments, rounded to the nearest


class ReservePolicy:
    """Learns shard sizes and says how much fresh memory to keep ready. Not thread-safe: the pool calls it
    under its lock."""

    def __init__(self, prefault: int | None, unit: int = 0, keep: int = 2) -> None:
        if prefault is not None and prefault < 0:
            raise ValueError(f"prefault {prefault} is invalid: expected >= 0 bytes or None (auto)")
        if unit < 0:
            raise ValueError(f"prefault unit {unit} is invalid: expected >= 0 bytes")
        self.prefault = prefault
        self.unit = unit
        # Segments one rank's shard cycles through on its owner: keep committed, the one being saved, the one its client
        # reserved ahead for the next save (taken right after a commit, before retention frees the oldest), and the
        # one segment ``goal`` always keeps ready. Sized for fewer, the owner faults the last one in during its first
        # saves, beside their copies and pushes (measured: 0.3 s of a core per GiB, on saves 3-4 with keep 2).
        self.cycle = keep + 3
        self._recent: collections.deque[int] = collections.deque(maxlen=RECENT)
        self._expected = 0  # bytes of the shards a replacement's first repair pass will pull (``expect``)

    @property
    def auto(self) -> bool:
        return self.prefault is None

    def saw(self, nbytes: int) -> None:
        """A shard of ``nbytes`` was placed on this store."""
        if nbytes >= MIN_UNIT:
            self._recent.append(nbytes)

    def expect(self, sizes: list[int]) -> None:
        """Shards about to be pulled here (a replacement's first repair pass: the newest step of what its group holds for
        it): learned as seen (the reserve's unit), and with the automatic reserve faulted in before the store serves,
        up to its goal (``before_serving``), so the pull a restarted trainer waits for lands in memory ready for it."""
        for n in sizes:
            self.saw(n)
        self._expected = sum(n for n in sizes if n >= MIN_UNIT)

    def before_serving(self) -> int:
        """Bytes of the reserve to fault in before the store serves: with ``--prefault N``, N/(keep+3), one pass of
        the cycle N is sized for (the newest step of every rank saving or held here), so the first save of a job on
        a fresh store, and a replacement's first restore or repair, land in memory faulted in already; the rest is
        faulted in the background. With the automatic reserve, the shards ``expect`` announced, up to its goal (nothing
        when none were: it knows no shard size yet); none with ``prefault=0``."""
        if self.prefault is None:
            return min(self._expected, self.goal().target)
        return self.prefault // self.cycle if self.prefault else 0

    def goal(self, held: int = 0) -> ReserveGoal:
        """The reserve to keep while the store holds ``held`` bytes outside it (shards and pooled segments)."""
        seen = max(self._recent, default=0)
        if self.prefault is None:
            unit = self.unit or seen
            return ReserveGoal(unit, AUTO_UNITS * unit if seen else 0)
        if self.prefault == 0:
            return ReserveGoal(0, 0)
        unit = self.unit or seen or max(MIN_UNIT, self.prefault // self.cycle)
        unit = min(unit, self.prefault)
        # At least one segment stays ready even when the shards fill N: the next save needs memory before
        # retention has handed back the step it no longer keeps.
        return ReserveGoal(unit, max(ReserveGoal(unit, 0).segment_bytes, self.prefault - held))
