"""Background upkeep: retention (keep-K, superseded timelines) and expiry of leases and tickets."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from memstore.config import StoreConfig
from memstore.core.floors import Floors
from memstore.core.model import Holding
from memstore.core.restorable import latest_replicated, latest_restorable, latest_settled, may_supersede, superseded_versions
from memstore.core.retention import Held, newest_versions, retention_victims, steps_from
from memstore.server.engine.catalog import Catalog
from memstore.server.engine.eviction import Eviction
from memstore.server.engine.parity import ParityKeeper
from memstore.server.memory.rings import saves_recycle
from memstore.spill.port import DURABLE_HOST, DurableTier

log = logging.getLogger(__name__)

# A job whose capture rings recycle (ec:K+M, keep >= 2) and that has no restorable floor: after its newest version here
# settles, the janitor lists the cluster again (besides the passes a settle wakes) until that version shows restorable
# from every rank's settled copy, for at most LEARN_SECONDS (a rank that never saves it: it stops). It looks again after
# LEARN_POLL_SECONDS at first, then after a quarter of the time it has been waiting (at most a second): ranks whose saves
# settle together cost a listing or two, one that lags or never saves about 20 in all, not one per 50 ms.
LEARN_POLL_SECONDS = 0.05
LEARN_SECONDS = 10.0


class Janitor:
    """Evicts what retention no longer keeps and frees what crashed clients left allocated.

    Runs on the store's ``janitor`` thread (``loop``), woken by ``retention_due`` (a shard settled or arrived, a step
    was spilled, the slot table moved) or once a second. ``cluster_holdings``: what the cluster holds of a job
    (``Recovery.cluster_holdings``), asked only when something would go and the job has no restorable floor
    (``memstore.core.floors``: its clients were given no process group), or a re-save may have superseded a timeline.
    ``expire_tickets``: releases the data channel's tickets nobody used in time (``DataPath.expire_tickets``).
    With a floor, retention evicts only below it and asks nobody: no message per saved step grows with the cluster.
    Without one, when the durable tier does not answer the listing, retention keeps every version from the newest one
    RAM shows committed (or restorable) on: what is not known durable stays in RAM.

    A job without a floor whose capture rings recycle (ec:K+M, keep >= 2) is listed besides after its newest version here
    settles, until that version shows restorable from every rank's settled copy (``_to_learn``): the recycler
    (``memstore.server.engine.recycling``) retires a rank's oldest kept step only below such a version, so the next save
    can take its segment. That costs such a job a listing (a call to every store) per store per save, a few when the
    ranks' saves settle apart (see LEARN_POLL_SECONDS).
    """

    def __init__(
        self,
        catalog: Catalog,
        eviction: Eviction,
        config: StoreConfig,
        cluster_holdings: Callable[[str], tuple[list[Holding], list[str]]],
        expire_tickets: Callable[[float], None],
        stop: threading.Event,
        retention_due: threading.Event,
        floors: Floors,
    ) -> None:
        self.catalog = catalog
        self.eviction = eviction  # drops what retention lets go
        self.config = config
        self.cluster_holdings = cluster_holdings
        self.expire_tickets = expire_tickets  # the data channel's (DataPath.expire_tickets)
        self._stop = stop
        self.retention_due = retention_due
        self.floors = floors
        self.listings = 0  # retention passes that had to list the cluster (no floor, or a possible supersede)
        self.durable: DurableTier | None = None  # set by the store when --spill is on: steps due for spilling are kept
        self.parity: ParityKeeper | None = None  # set by the store under ec:K+M: its fragments go with their steps
        self.recycles = saves_recycle(config.keep, config.redundancy.erasure_coded)  # rings recycle: learn what is restorable
        self._learning: dict[str, tuple[tuple[int, str], float]] = {}  # job -> (its newest settled version here, listed since)

    def loop(self) -> None:
        while not self._stop.is_set():
            self.retention_due.wait(timeout=self._poll_seconds())
            if self._stop.is_set():
                return
            self.retention_due.clear()
            try:
                self.pass_once()
            except Exception:
                log.exception("janitor pass failed")
            self._stop.wait(0.05)  # debounce bursts of settles into one pass

    def pass_once(self) -> None:
        """One pass: expire leases and tickets, then apply retention."""
        now = time.monotonic()
        for lease_id in self.catalog.stale_leases(now):
            log.warning("lease %s expired; releasing it", lease_id)
            self.catalog.release_lease(lease_id)
        self.expire_tickets(now)
        self.apply_retention()

    def apply_retention(self) -> None:
        jobs = sorted(self.catalog.jobs())
        for job in jobs:
            self._retain(job)
        for gone in set(self._learning) - set(jobs):
            del self._learning[gone]
        if self.parity is not None:  # parity fragments: the newest --keep versions, and those whose copies are still here
            for job in sorted(self.parity.jobs()):
                self.parity.retire(job, self.config.keep, {k.version for k, _, _ in self.catalog.held(job)})

    def _retain(self, job: str) -> None:
        """Keep-K retention of ``job``'s copies here (superseded timelines dropped, protected steps kept)."""
        held = self.catalog.held(job)
        crowded = len({k.version for k, _, _ in held}) > self.config.keep and retention_victims(held, self.config.keep)
        supersede = may_supersede((k, created) for k, _, created in held)
        learn = self._to_learn(job, held)
        if not crowded and not supersede and not learn:
            return
        spilling = sorted(self.durable.protected_steps(job)) if self.durable is not None else []  # kept until spilled
        floor = self.floors.get(job)
        if floor is not None and floor.timeline not in {k.timeline for k, _, _ in held}:
            floor = None  # a version this store cannot place among its own (it holds nothing of its timeline): list
        if floor is not None and not supersede:
            self.eviction.retire(job, held, set(), None, spilling, floor.version)  # nothing at or above the floor goes
            return
        # Something would go and no floor bounds it, or a re-save may have superseded another timeline: ask the cluster.
        self.listings += 1
        holdings, unreachable = self.cluster_holdings(job)
        if self.recycles:
            self._learnt(job, holdings)
        dead = superseded_versions(holdings, job)
        latest = latest_restorable(holdings, job)
        # ... and the newest committed version (every rank on R hosts; under ec:K+M every rank's copy settled, its parity
        # done): the latest restorable one may rest on a single copy whose replication failed, or on a shard whose parity
        # is still being computed, and the loss of that one host must not leave nothing to restore.
        if self.config.redundancy.erasure_coded:
            committed = latest_settled(holdings, job)
        else:
            committed = latest_replicated(holdings, job, self.config.replicas)
        protected = [v.step for v in (latest, committed) if v is not None] + spilling
        if floor is None and DURABLE_HOST in unreachable:
            # The durable tier did not answer: with its copies, a version newer than these may be restorable or
            # committed, which a whole view would protect. Keep every version from the newest committed one RAM shows
            # on (else from the newest restorable one; with neither, every version). Superseded ones still go: a
            # version of a newer timeline restorable from RAM is restorable whatever the durable tier holds.
            bound = committed or latest
            protected += sorted(steps_from(held, None if bound is None else (bound.step, bound.timeline)))
        # Only what ``held`` saw may go: saves that settled while the cluster was listed are newer than ``protected`` knows.
        self.eviction.retire(job, held, dead, latest.step if latest else None, protected, floor.version if floor else None)

    def _to_learn(self, job: str, held: list[Held]) -> bool:
        """Whether to list the cluster for ``job`` to learn its newest version restorable from every rank's settled copy
        (see the class doc): its rings recycle, it has no floor, and its newest version settled here is newer than the
        one learnt, for at most LEARN_SECONDS since the janitor first listed for it."""
        settled = {k.version for k, _, _ in held} - {k.version for k, state, _ in held if not state.settled}
        newest = newest_versions(((k, c) for k, _, c in held if k.version in settled), 1)
        learnt = self.eviction.restorable(job)
        if not self.recycles or self.floors.get(job) is not None or not newest:
            self._learning.pop(job, None)
            return False
        (version,) = newest
        if learnt is not None and learnt[1] == version[1] and learnt[0] >= version[0]:
            self._learning.pop(job, None)
            return False
        now = time.monotonic()
        if job not in self._learning or self._learning[job][0] != version:
            self._learning[job] = (version, now)
        return now - self._learning[job][1] <= LEARN_SECONDS  # else a rank missed the save: a later one lists again

    def _poll_seconds(self) -> float:
        """How long the janitor waits for a wake-up before its next pass: a second, shorter while a job is being learnt
        (``_to_learn``; see LEARN_POLL_SECONDS)."""
        now = time.monotonic()
        waiting = [now - since for _, since in self._learning.values() if now - since <= LEARN_SECONDS]
        return min(1.0, max(LEARN_POLL_SECONDS, min(waiting) / 4)) if waiting else 1.0

    def _learnt(self, job: str, holdings: list[Holding]) -> None:
        """Record ``job``'s newest version restorable from settled copies in ``holdings`` (the recycler's bound)."""
        version = latest_settled(holdings, job)
        if version is not None:
            self.eviction.learnt_restorable(job, (version.step, version.timeline))
