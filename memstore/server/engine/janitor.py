"""Background upkeep: retention (keep-K, superseded timelines) and expiry of leases and tickets."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from memstore.config import StoreConfig
from memstore.core.floors import Floors
from memstore.core.model import Holding
from memstore.core.restorable import latest_replicated, latest_restorable, may_supersede, superseded_versions
from memstore.core.retention import retention_victims, steps_from
from memstore.server.engine.catalog import Catalog
from memstore.server.engine.eviction import Eviction
from memstore.server.engine.parity import ParityKeeper
from memstore.spill.port import DURABLE_HOST, DurableTier

log = logging.getLogger(__name__)


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

    def loop(self) -> None:
        while not self._stop.is_set():
            self.retention_due.wait(timeout=1.0)
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
        for job in sorted(self.catalog.jobs()):
            self._retain(job)
        if self.parity is not None:  # parity fragments: the newest --keep versions, and those whose copies are still here
            for job in sorted(self.parity.jobs()):
                self.parity.retire(job, self.config.keep, {k.version for k, _, _ in self.catalog.held(job)})

    def _retain(self, job: str) -> None:
        """Keep-K retention of ``job``'s copies here (superseded timelines dropped, protected steps kept)."""
        held = self.catalog.held(job)
        crowded = len({k.version for k, _, _ in held}) > self.config.keep and retention_victims(held, self.config.keep)
        supersede = may_supersede((k, created) for k, _, created in held)
        if not crowded and not supersede:
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
        dead = superseded_versions(holdings, job)
        latest = latest_restorable(holdings, job)
        # ... and the newest committed version (every rank on R hosts): the latest restorable one may rest on a
        # single copy whose replication failed, and the loss of that one host must not leave nothing to restore.
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
