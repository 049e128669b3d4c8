"""What the store drops on purpose: retention's evictions, superseded timelines, room made under pressure, deletes.

The ``Janitor`` decides what retention keeps (``memstore.core.retention``, ``memstore.core.restorable``) and asks
``retire`` to drop the rest; ``Room`` asks ``drop_cached``, then ``make_room``, when a shard does not fit. Both
respect what retention protects: each job's newest restorable step and its restorable floor, which ``retire``
records here and pressure reads (``memstore.core.retention.pressure_victims``). ``delete`` (the Delete RPC, through
``Store.delete``) drops what it names and remembers it for a while, so that repair (``Recovery``, asking
``recently_deleted``) does not pull it back from a store the delete has not reached yet. ``Store`` builds the one
``Eviction``.

Lock: the catalog's condition (``Catalog.cond``), none of its own. Each method chooses its victims among the catalog's
entries (``retire``: among those the Janitor decided over, see its doc) and drops them in one step under it
(``Catalog.entries_locked``, ``drop_locked``), so what it chose is what it drops: nothing registers, pins or drops
meanwhile. The protected steps, floors and deletes are read and written
only under the same lock. Dropping frees segments to the pool under it: the catalog's lock, then the pool's, the
engine's order; ``Room`` asks the pool for a segment only outside it.
"""

from __future__ import annotations

import logging
import math
import time

from memstore.core.limits import room_by_dropping
from memstore.core.model import ShardKey
from memstore.core.retention import Held, pressure_victims, retention_victims
from memstore.errors import CapacityExceeded, QuotaExceeded, UnknownJob
from memstore.server.engine.catalog import Catalog

log = logging.getLogger(__name__)
DELETED_SECONDS = 60.0  # how long repair leaves a deleted shard alone (see Eviction.recently_deleted)


class Eviction:
    """Drops what retention or memory pressure lets go, never a job's protected steps."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._cond = catalog.cond
        self._protected: dict[str, int] = {}  # job -> newest restorable step, protected from eviction
        self._floor: dict[str, tuple[int, str]] = {}  # job -> its restorable floor: nothing at or above it is evicted
        self._restorable: dict[str, tuple[int, str]] = {}  # job -> newest version every rank's settled copy makes restorable
        self._deleted: dict[tuple[str, int, int], float] = {}  # (job, step, rank) deleted (-1: every) -> when

    # ---- memory pressure (memstore.server.engine.room asks)

    def drop_cached(self, key: ShardKey, quota: bool) -> bool:
        """Drop the oldest copy pulled ahead of a restore (of ``key``'s job only when its quota is the limit); False if none."""
        with self._cond:
            cached = [e for e in self.catalog.entries_locked() if e.cached and (not quota or e.key.job_id == key.job_id)]
            if not cached:
                return False
            victim = min(cached, key=lambda e: e.created_unix)
            log.info("dropping %s, pulled ahead of a restore, to fit %s", victim.key, key)
            self.catalog.drop_locked(victim, reason=f"cached copy dropped to fit step {key.step}")
            return True

    def make_room(self, key: ShardKey, short: CapacityExceeded) -> bool:
        """Drop the fewest of what ``pressure_victims`` offers (``key``'s job's own older copies, never its newest settled
        version nor its protected steps) that make the room ``short`` lacks; False, nothing dropped, when even all of
        them would not (``memstore.core.limits.room_by_dropping``). ``QuotaExceeded``: its numbers are the job's."""
        with self._cond:
            job = {e.key: e for e in self.catalog.entries_locked() if e.key.job_id == key.job_id}
            held = [(e.key, e.state, e.created_unix) for e in job.values()]
            protected = [self._protected[key.job_id]] if key.job_id in self._protected else []
            candidates = [(k, job[k].segment.size) for k in pressure_victims(held, key, protected, self._floor.get(key.job_id))]
            victims = room_by_dropping(candidates, short.used, short.needed, short.capacity)
            what = "the job's quota" if isinstance(short, QuotaExceeded) else "memory"
            for victim in (job[k] for k in victims):
                log.warning("pressure on %s: dropping %s (%s) to fit %s", what, victim.key, victim.state.value, key)
                self.catalog.drop_locked(victim, reason=f"dropped under pressure on {what} for step {key.step}")
            return bool(victims)

    def learnt_restorable(self, job_id: str, version: tuple[int, str]) -> None:
        """The Janitor listed the cluster: ``version`` (step, timeline) is the newest of ``job_id`` every rank's settled
        copy makes restorable (``memstore.core.restorable.latest_settled``), the recycler's bound without a floor."""
        with self._cond:
            self._restorable[job_id] = version

    def restorable(self, job_id: str) -> tuple[int, str] | None:
        """``job_id``'s newest version every rank's settled copy makes restorable, as the Janitor last learnt it (None:
        unknown): what lets ``memstore.server.engine.recycling`` retire an older one without a floor."""
        with self._cond:
            return self._restorable.get(job_id)

    # ---- retention (the Janitor)

    def retire(
        self,
        job_id: str,
        held: list[Held],
        dead: set[tuple[int, str]],
        latest: int | None,
        protected: list[int],
        floor: tuple[int, str] | None = None,
    ) -> None:
        """Drop the settled copies of ``job_id``'s superseded versions ``dead``, then what keep-K retention evicts of
        ``held`` (never ``protected`` steps, nothing at or above the restorable ``floor``); ``latest``, the newest
        restorable step, and the floor are protected from pressure too.

        ``held``: the job's copies here when the caller looked (``Catalog.held``), the look its ``latest`` and
        ``protected`` were worked out from. Only those may be evicted: a copy that arrived since (while the janitor
        listed the cluster, seconds when a peer or the durable tier does not answer) can be newer than every step they
        protect, the newest restorable one or one due for spilling; it waits for the next pass, which sees it."""
        keep = self.catalog.config.keep
        with self._cond:
            if latest is not None:
                self._protected[job_id] = latest
            if floor is not None:
                self._floor[job_id] = floor
            job = [e for e in self.catalog.entries_locked() if e.key.job_id == job_id]
            for dead_entry in [e for e in job if e.key.version in dead and e.state.settled]:
                log.info("dropping %s: a newer timeline re-saved step %d or earlier", dead_entry.key, dead_entry.key.step)
                self.catalog.drop_locked(dead_entry, reason="superseded: the job went back and saved this step again on a newer timeline")
            left = [(k, state, created) for k, state, created in held if not (k.version in dead and state.settled)]
            for key in retention_victims(left, keep, protected, floor):
                entry = self.catalog.get_locked(key)
                if entry is not None:
                    log.debug("retention: evicting %s", key)
                    self.catalog.drop_locked(entry, reason="evicted by retention")

    # ---- deletes (Store.delete; Recovery asks recently_deleted)

    def delete(self, job_id: str, step: int, rank: int) -> int:
        """Drop the copies of ``job_id`` at ``step`` and ``rank`` (-1: every step, every rank; checked by ``Store.delete``);
        returns how many."""
        with self._cond:
            job = [e for e in self.catalog.entries_locked() if e.key.job_id == job_id]
            victims = [e for e in job if step in (-1, e.key.step) and rank in (-1, e.key.rank)]
            if not job:
                raise UnknownJob(f"job {job_id!r} is unknown to store {self.catalog.host_id}")
            for e in victims:
                self.catalog.drop_locked(e, reason="deleted")
            self._deleted[(job_id, step, rank)] = time.monotonic()  # repair pulls none of these back for a while
        return len(victims)

    def recently_deleted(self, key: ShardKey) -> bool:
        """Whether ``key`` was deleted here (``delete``) within ``DELETED_SECONDS``: a delete runs store by store, and
        a repair pass in between must not pull back a copy another store has not deleted yet."""
        since = time.monotonic() - DELETED_SECONDS
        with self._cond:
            return any(self._deleted.get((key.job_id, s, r), -math.inf) > since for s in (key.step, -1) for r in (key.rank, -1))
