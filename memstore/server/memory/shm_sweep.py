"""The segment directories dead stores left on this machine: adopted by their successor, reclaimed otherwise.

A store that dies without a clean exit (SIGKILL, OOM kill, a pod replaced after its grace period, a Ray node
that comes back) leaves its directory ``<shm_dir>/<host_id>-<port>`` in the tmpfs: RAM outside any store's
capacity and any pod's limit. Every store sweeps its ``--shm-dir``: at start, after it joined and before its
first repair pass; on every change of the slot table, before the new table is in force (``Membership`` calls
``on_change`` first), so repair never pulls what a takeover adopts; and every little while:

- a dead directory of a *predecessor* is adopted at once: its verified segments move into this store's
  directory and are served like copies repair pulled (``leftovers.Adoption``), so a replacement on the
  same machine pulls nothing over the network for them; the rest of the directory goes. A predecessor is a
  host that held this store's slot before it (``Slot.former``: the slot table says whose slot it took over)
  or this store's own host id under another port (a restart that bound a new port);
- any other dead directory is reclaimed once it has been seen dead for ``--shm-reclaim-after`` seconds
  (0: never), so a successor that learns its slot later still finds its predecessor's shards;
- a directory whose lock a running store holds is never touched (``shm_dirs.taken_over``);
- and when repair is about to pull shards over the network, a dead directory that holds one of them is adopted
  too (``adopt_holders``): a successor whose slot table does not name its predecessor (it joined before the dead
  store's slot was freed, or the table saying so has not reached it yet) still serves what this machine holds.

``plan`` is the decision, pure; ``ShmSweeper`` applies it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from memstore.core.model import ShardKey
from memstore.core.sizes import format_size
from memstore.core.status import Orphan
from memstore.server.convert import sidecar_info
from memstore.server.memory.shm_dirs import described_segments, orphaned_dirs, reclaim_dir, sidecar_path

log = logging.getLogger(__name__)

MAX_SWEEP_INTERVAL = 30.0  # seconds between sweeps at most (a change of the slot table sweeps at once)


@dataclass(frozen=True)
class SweepPlan:
    adopt: tuple[str, ...] = ()  # paths of dead directories of predecessors: adopt now
    reclaim: tuple[str, ...] = ()  # paths of dead directories seen dead for the grace period: delete now
    first_seen: Mapping[str, float] = field(default_factory=dict)  # path -> when first seen dead, of those still there


def plan(dead: Sequence[Orphan], predecessors: set[str], first_seen: Mapping[str, float], now: float, grace: float) -> SweepPlan:
    """What to do with the ``dead`` directories (nobody holds their lock): adopt those of ``predecessors`` (host
    ids), reclaim the others seen dead since ``grace`` seconds before ``now`` (never with ``grace`` 0)."""
    seen = {o.path: first_seen.get(o.path, now) for o in dead if o.host_id not in predecessors}
    adopt = tuple(o.path for o in dead if o.host_id in predecessors)
    reclaim = tuple(p for p, t in seen.items() if grace > 0 and now - t >= grace)
    return SweepPlan(adopt, reclaim, {p: t for p, t in seen.items() if p not in reclaim})


@dataclass
class SweepResult:
    adopted_shards: int = 0
    adopted_dirs: int = 0
    reclaimed_bytes: int = 0
    reclaimed_dirs: int = 0


class ShmSweeper:
    """Sweeps the ``--shm-dir`` that holds this store's segment directory (see the module's docstring)."""

    def __init__(
        self,
        own_dir: Path,
        predecessors: Callable[[], set[str]],
        adopt: Callable[[Path], int],
        grace: float,
        stop: threading.Event,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``predecessors``: the host ids whose dead directories this store adopts now; ``adopt``: adopt one
        (``leftovers.Adoption``), the shards kept; ``grace``: ``--shm-reclaim-after`` seconds."""
        self.shm_dir = own_dir.parent
        self.own_dir = own_dir
        self._predecessors = predecessors
        self._adopt = adopt
        self.grace = grace
        self._stop = stop
        self._clock = clock
        self._first_seen: Mapping[str, float] = {}
        self._sweeping = threading.Lock()
        self.due = threading.Event()  # set: sweep now (the store is closing)
        self.total = SweepResult()

    @property
    def interval(self) -> float:
        return min(max(self.grace / 4, 0.5), MAX_SWEEP_INTERVAL) if self.grace > 0 else MAX_SWEEP_INTERVAL

    def sweep(self, predecessors: set[str] | None = None) -> SweepResult:
        """Adopt the predecessors' dead directories (default: ``predecessors()`` of the constructor) and reclaim the
        others due; what it did."""
        with self._sweeping:
            dead = self._dead()
            who = self._predecessors() if predecessors is None else predecessors
            todo = plan(dead, who, self._first_seen, self._clock(), self.grace)
            self._first_seen = todo.first_seen
            done = SweepResult()
            for path in todo.adopt:
                done.adopted_shards += self._adopt(Path(path))
                done.adopted_dirs += not Path(path).exists()
            for path in todo.reclaim:
                gone = reclaim_dir(Path(path))
                if gone is not None:
                    done.reclaimed_dirs += 1
                    done.reclaimed_bytes += gone.bytes
            if done.reclaimed_dirs:
                log.info(
                    "reclaimed %d dead segment dirs (%s) under %s after %.0fs: no store took them over",
                    done.reclaimed_dirs, format_size(done.reclaimed_bytes), self.shm_dir, self.grace,
                )  # fmt: skip
            for name in ("adopted_shards", "adopted_dirs", "reclaimed_bytes", "reclaimed_dirs"):
                setattr(self.total, name, getattr(self.total, name) + getattr(done, name))
            return done

    def adopt_holders(self, keys: set[ShardKey]) -> int:
        """Adopt every dead directory here that holds a copy of one of ``keys`` (shards repair would otherwise pull
        over the network); the shards adopted."""
        with self._sweeping:
            holders = [Path(o.path) for o in self._dead() if described_keys(Path(o.path)) & keys]
            adopted = 0
            for path in holders:
                adopted += self._adopt(path)
                self.total.adopted_dirs += not path.exists()
            self.total.adopted_shards += adopted
            return adopted

    def _dead(self) -> list[Orphan]:
        """The segment dirs under --shm-dir that no running store holds, but this store's own."""
        return [o for o in orphaned_dirs(str(self.shm_dir)) if Path(o.path) != self.own_dir]

    def loop(self) -> None:
        """Sweep every ``interval`` seconds, or at once when ``due`` is set, until ``stop``."""
        while not self._stop.is_set():
            self.due.wait(self.interval)
            self.due.clear()
            if self._stop.is_set():
                return
            try:
                self.sweep()
            except Exception:
                log.exception("sweeping %s failed; trying again later", self.shm_dir)


def described_keys(directory: Path) -> set[ShardKey]:
    """The shards the sidecars in ``directory`` describe (unreadable or malformed ones skipped: adoption checks again)."""
    keys: set[ShardKey] = set()
    for _, path, _ in described_segments(directory) or []:
        try:
            with open(sidecar_path(path), "rb") as fh:
                keys.add(sidecar_info(fh.read()).manifest.key)
        except Exception:  # a torn or foreign sidecar is not ours to judge here: adoption checks again
            continue
    return keys
