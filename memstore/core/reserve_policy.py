"""How much fresh, pre-faulted memory a store keeps ready, and in what pieces (``--prefault``).

The first touch of fresh shared memory costs ~10x a copy into memory that is already faulted in (the
kernel allocates, zeroes and maps every page), so a store that allocates a segment when a save arrives
makes that save stall for it. The *reserve* is memory faulted in ahead of need: segments that never
held any job's bytes, handed to whichever shard (a trainer's save, a peer's replica, a repair) needs one
next, and refilled in the background.

Pure policy; the engine (``memstore.server.memory.reserve.Reserve``, in ``SegmentPool``) holds the segments, does the
faulting and keeps every reserved byte inside ``--capacity``.

- ``prefault=None`` (``--prefault auto``, the default): nothing at start-up, unless the store replaces a host
  whose group holds shards for it (``expect``: the newest step of each, faulted in before it serves, up to two
  units). Then the reserve follows the *streams* placed here outside the capture rings (whose clients fill them
  themselves): a stream is one rank of one job whose replicas (or pulled copies) land on this store. Each active
  stream cycles through ``keep + 1`` segments (the kept steps and the one in flight), so the reserve faults in, off
  the save's path, what each active job still lacks of that: ``sum((keep + 1) x shard) - what the job holds``
  outside its rings (replicas and pooled segments). Once a job holds its cycle, the reserve is empty: recycled
  segments serve every later replica, and no memory is held twice. A stream
  with no shard for ``IDLE_CADENCES`` times its cadence (at least ``IDLE_MIN_SECONDS``) is *idle*: its job's
  pooled spares go back to the kernel (``idle_jobs``), so a job that stopped saving holds only its kept steps.
  A stream's owner announces it before its first replica comes when its client prepares (``announce``: the peer
  ``Expect`` call, sent for a reservation ahead made before the rank's first save), so a peer faults in the first
  replicas' memory too, not only the later ones'; an announced stream whose first shard has not come is idle only
  after ``ANNOUNCED_IDLE_SECONDS``.
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
import time
from collections.abc import Callable
from dataclasses import dataclass, field

AUTO_UNITS = 2  # units the automatic reserve keeps ready
RECENT = 32  # shard sizes remembered to choose the unit
HEADROOM = 128  # a reserve segment is 1/128 larger than its unit (room for the shard's header)
MIN_UNIT = 1 << 20  # smaller shards are not worth a reserve of their own (they fault in fast)
IDLE_MIN_SECONDS = 30.0  # a stream with no new shard for this long, and ...
IDLE_CADENCES = 3  # ... this many times the longest of its recent gaps between shards, is idle
GAPS = 4  # gaps between a stream's shards remembered (its cadence)
ANNOUNCED_IDLE_SECONDS = 1800.0  # a stream announced (``Expect``) whose first shard has not come for this long is idle

Stream = tuple[str, int]  # (job, rank): the shards of one rank of one job placed on this store (saves or replicas)


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


@dataclass
class _StreamSeen:
    """What the policy knows of one stream: its latest shard size, when it came, the gaps before it."""

    nbytes: int
    last: float
    gaps: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=GAPS))
    announced: bool = False  # announced by its owner (``Expect``), no shard of it placed yet

    def idle(self, now: float) -> bool:
        if self.announced:  # set-up (a prepare) may come long before the first save
            return now - self.last > ANNOUNCED_IDLE_SECONDS
        return now - self.last > max(IDLE_MIN_SECONDS, IDLE_CADENCES * max(self.gaps, default=0.0))


class ReservePolicy:
    """Learns shard sizes and says how much fresh memory to keep ready. Not thread-safe: the pool calls it
    under its lock."""

    def __init__(self, prefault: int | None, unit: int = 0, keep: int = 2, clock: Callable[[], float] = time.monotonic) -> None:
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
        self.keep = keep
        self._clock = clock
        self._recent: collections.deque[int] = collections.deque(maxlen=RECENT)
        self._streams: dict[Stream, _StreamSeen] = {}  # the automatic reserve's: each stream's shards lately
        self._expected = 0  # bytes of the shards a replacement's first repair pass will pull (``expect``)

    @property
    def auto(self) -> bool:
        return self.prefault is None

    def saw(self, nbytes: int, stream: Stream | None = None) -> None:
        """A shard of ``nbytes`` was placed on this store, of ``stream`` when the caller knows it."""
        if nbytes < MIN_UNIT:
            return
        self._recent.append(nbytes)
        if stream is None:
            return
        now = self._clock()
        seen = self._streams.get(stream)
        if seen is None or seen.announced:  # its first shard: the time since an announcement is no cadence
            self._streams[stream] = _StreamSeen(nbytes, now)
            return
        seen.gaps.append(now - seen.last)
        seen.nbytes, seen.last = nbytes, now

    def idle_jobs(self) -> set[str]:
        """Jobs seen here whose streams are all idle (no shard for a few of their cadences): their pooled spares may go."""
        now = self._clock()
        jobs: dict[str, bool] = {}
        for (job, _), seen in self._streams.items():
            jobs[job] = jobs.get(job, True) and seen.idle(now)
        return {job for job, idle in jobs.items() if idle}

    @property
    def streams_active(self) -> bool:
        """Whether any stream placed here is still active (not idle)."""
        now = self._clock()
        return any(not seen.idle(now) for seen in self._streams.values())

    def cycle_shortfall(self, job_bytes: Callable[[str], int]) -> int:
        """Bytes the active jobs lack of their cycle: per job, ``(keep + 1)`` shards of each active stream, less what
        ``job_bytes(job)`` says the job holds here (in use and pooled)."""
        now = self._clock()
        cycles: dict[str, int] = collections.defaultdict(int)
        for (job, _), seen in self._streams.items():
            if not seen.idle(now):
                cycles[job] += (self.keep + 1) * seen.nbytes
        return sum(max(0, cycle - job_bytes(job)) for job, cycle in cycles.items())

    def announce(self, nbytes: int, stream: Stream) -> None:
        """``stream``'s shards, ``nbytes`` each, will be placed here (its owner said so before the first one: ``Expect``):
        a stream not seen yet is learned as if its first shard had come now, so the automatic reserve faults in its
        cycle ahead of it. A stream seen already is left as it is (its cadence stays its own)."""
        if nbytes < MIN_UNIT or stream in self._streams:
            return
        self._recent.append(nbytes)
        self._streams[stream] = _StreamSeen(nbytes, self._clock(), announced=True)

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

    def goal(self, held: int = 0, job_bytes: Callable[[str], int] | None = None) -> ReserveGoal:
        """The reserve to keep while the store holds ``held`` bytes outside it (shards and pooled segments);
        ``job_bytes(job)``: what one job holds (the automatic reserve counts per job; without it, only ``expect``)."""
        seen = max(self._recent, default=0)
        if self.prefault is None:
            unit = self.unit or seen
            if self._streams and job_bytes is not None:
                return ReserveGoal(unit, self.cycle_shortfall(job_bytes))
            return ReserveGoal(unit, min(self._expected, AUTO_UNITS * unit) if self._expected else 0)
        if self.prefault == 0:
            return ReserveGoal(0, 0)
        unit = self.unit or seen or max(MIN_UNIT, self.prefault // self.cycle)
        unit = min(unit, self.prefault)
        # At least one segment stays ready even when the shards fill N: the next save needs memory before
        # retention has handed back the step it no longer keeps.
        return ReserveGoal(unit, max(ReserveGoal(unit, 0).segment_bytes, self.prefault - held))
