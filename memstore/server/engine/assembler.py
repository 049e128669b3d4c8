"""Assembly ahead of a restore: the other stripes of a replica group whose member saves to this store, pulled into
spare room, so that the member's restore (or a restart in place) reads every stripe from local memory.

A data-parallel replica group (``CheckpointClient(replica_group=...)``) stores its state once: each of its D members
saves a stripe of about 1/D of it, and a restore needs all D. Without this, a member restoring after a restart pulls
the D-1 stripes it lacks from peers while every other member does the same. Here, once a member's save has settled,
its store pulls the stripes it lacks of that save (the newest of the rank) as *cached* copies:

* only into spare room: a pull leaves at least :data:`ROOM_KEPT` of the capacity out of use (segments the pool keeps
  for reuse give way, as they do for any copy), and evicts no copy;
* a cached copy is not one of the shard's R copies (repair and ``memstore status`` do not count it), and it is the first
  thing dropped when a save needs room (``Room.acquire``, ``Eviction.drop_cached``); retention drops it with its step;
* a stripe not yet committed by its own member is tried again, with backoff, for :data:`GIVE_UP_SECONDS`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from memstore.core.model import ShardKey
from memstore.errors import StoreError
from memstore.server.engine.arrivals import Arrivals
from memstore.server.engine.catalog import Catalog
from memstore.server.memory.pool import SegmentPool

log = logging.getLogger(__name__)

ROOM_KEPT = 0.25  # the share of the capacity a pull ahead of a restore never takes
PASS_SECONDS = 0.5  # between passes over what is wanted
RETRY_SECONDS = (0.5, 1.0, 2.0, 4.0, 8.0)  # backoff after a failed pull (the stripe is not committed yet, a peer is busy)
GIVE_UP_SECONDS = 300.0  # a stripe still missing after this long is left to the restore


class Assembler:
    """Pulls the stripes a member saving here lacks, while there is room (one pass every :data:`PASS_SECONDS`)."""

    def __init__(
        self, catalog: Catalog, arrivals: Arrivals, pool: SegmentPool, pull: Callable[[ShardKey], str], stop: threading.Event,
        draining: threading.Event,
    ) -> None:  # fmt: skip
        self.catalog = catalog  # stripes_settled: whether to scan again
        self.arrivals = arrivals  # stripes_wanted: what the catalog lacks and nobody is bringing in
        self.pool = pool
        self.pull = pull  # Recovery.pull_ahead: one cached copy from a peer
        self._stop = stop
        self.draining = draining
        self._tries: dict[ShardKey, tuple[float, int, float]] = {}  # key -> (next try, failures, first try), monotonic
        self._seen = -1  # Catalog.stripes_settled at the last scan (-1: none yet, e.g. after adopting a crashed store's)
        self.pulled = 0  # cached copies pulled since the start
        self.skipped_for_room = 0  # stripes not pulled because the room was short

    def loop(self) -> None:
        while not self._stop.wait(PASS_SECONDS):
            try:
                self.pass_once()
            except Exception:  # the loop must survive anything one pass meets
                log.exception("assembling stripes ahead of restores failed; trying again")

    def pass_once(self, now: float | None = None) -> int:
        """One pass: pull what is wanted, has room and is due; returns how many copies were pulled. The catalog is
        scanned only when a stripe settled since the last pass or a pull is still to be retried."""
        now = time.monotonic() if now is None else now
        if self.draining.is_set():
            return 0
        settled = self.catalog.stripes_settled
        if settled == self._seen and all(now - first > GIVE_UP_SECONDS for _, _, first in self._tries.values()):
            return 0  # nothing new (and no group here at all, the usual case): no scan under the catalog's lock
        self._seen = settled
        wanted = self.arrivals.stripes_wanted()
        keys = {k for k, _ in wanted}
        self._tries = {k: t for k, t in self._tries.items() if k in keys}
        pulled = 0
        for key, nbytes in wanted:
            if self._stop.is_set() or self.draining.is_set():
                break
            due, failures, first = self._tries.get(key, (0.0, 0, now))
            if now < due or now - first > GIVE_UP_SECONDS:
                continue
            if self.pool.capacity - self.pool.in_use_bytes - nbytes < ROOM_KEPT * self.pool.capacity:  # pooled segments give way
                self.skipped_for_room += 1
                self._tries[key] = (now + RETRY_SECONDS[-1], failures, first)
                continue
            try:
                source = self.pull(key)
            except StoreError as exc:  # not committed by its member yet, a peer gone, no room after all
                self._tries[key] = (now + RETRY_SECONDS[min(failures, len(RETRY_SECONDS) - 1)], failures + 1, first)
                log.debug("stripe %s not pulled ahead yet: %s", key, exc)
                continue
            self._tries.pop(key, None)
            self.pulled += 1
            pulled += 1
            log.info("pulled %s from %s ahead of a restore (a stripe of a replica group saving here)", key, source)
        return pulled
