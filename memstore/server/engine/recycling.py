"""Under ec:K+M with ``--keep`` 2 or more, a rank's save into its full capture ring takes its oldest kept step's segment.

Under erasure coding a step commits once its parity is complete, so the rank's newest committed step stays restorable
while its next save is in flight. A rank's capture ring then holds ``keep`` segments, not ``keep + 1``
(``memstore.server.memory.rings.saves_recycle``): when a save finds the ring full and none of its segments free,
``Recycler.take_oldest`` retires the rank's oldest kept step early, the drop retention would make once the save
commits (the catalog's entry; the parity hosts keep their fragments of that step until their own retention drops
them), and hands its segment to the save, one its client has mapped and registered already. While the save is in
flight the rank holds ``keep - 1`` committed steps and the one being written; the trade is documented in
docs/erasure.md ("RAM").

It does so only when ``memstore.core.retention.recycled_copy`` allows it: a newer step is known restorable by every
rank and held ``COMMITTED`` here (the job's restorable floor from ``Floors``, which a save's ``Allocate`` carries when
its client has a process group, or the newest step every rank's settled copy makes restorable, which the ``Janitor``
learns by listing the cluster for a job without one: ``Eviction.restorable``), and the oldest is not due for spilling.
This rank's newest step committing is not enough: another rank's save of it may still be encoding, and a store lost
before it commits would leave the older step as the only one every rank can restore. Nor when anything reads the
segment: no pin (a restore's lease, a spill, a rebuild's ``ReadRange``, a pull, a scrub, a contribution being sent)
and no reader's own mapping (``Segment.exported``). Otherwise nothing is retired and the save gets a segment as it
would without recycling (its ring grows: ``Room.acquire``): it never waits on a reader and never overwrites bytes
anybody reads.

Lock: the catalog's; under it the pool's (the engine's order). The segment goes back to the ring's pool when its entry
is dropped, and ``Room`` asks the pool for it (by path) outside the lock, within ``SegmentPool.saving_into``.
"""

from __future__ import annotations

import logging

from memstore.core.floors import Floors
from memstore.core.model import ShardKey
from memstore.core.retention import recycled_copy
from memstore.server.engine.catalog import Catalog
from memstore.server.engine.eviction import Eviction
from memstore.server.memory.pool import SegmentPool
from memstore.spill.port import DurableTier

log = logging.getLogger(__name__)


class Recycler:
    """Retires a rank's oldest kept step early for its next save's segment (ec:K+M, keep >= 2)."""

    def __init__(self, catalog: Catalog, eviction: Eviction, pool: SegmentPool, floors: Floors) -> None:
        self.catalog = catalog
        self.eviction = eviction  # the newest version every rank's settled copy makes restorable, as the Janitor learnt it
        self.pool = pool
        self.floors = floors  # the restorable floors the job's clients sent (a save's Allocate carries its own)
        self.durable: DurableTier | None = None  # set by the store with --spill: steps due for spilling stay
        self.recycled = 0  # steps retired early for a save
        self.refused = 0  # full rings whose oldest kept step, allowed to go, was read or did not fit, when a save came

    def take_oldest(self, key: ShardKey, nbytes: int) -> str | None:
        """Retire the oldest kept step of ``key``'s rank for its save of ``nbytes`` (its capture ring is full); the path
        of its segment, pooled in the ring now, or None when it may not go (see the module)."""
        job, rank = key.job_id, key.rank
        spilling = sorted(self.durable.protected_steps(job)) if self.durable is not None else []
        floor = self.floors.get(job)
        with self.catalog.cond:
            mine = [
                e for e in self.catalog.entries_locked()
                if e.key.job_id == job and e.key.rank == rank and e.owner_host == self.catalog.host_id and not e.cached
            ]  # fmt: skip
            known = [floor.version if floor is not None else None, self.eviction.restorable(job)]
            victim = recycled_copy([(e.key, e.state, e.created_unix) for e in mine], known, spilling)
            entry = next((e for e in mine if e.key == victim), None)
            if entry is None:
                return None
            seg = entry.segment
            if entry.pins or seg.owner != job or seg.ring != rank or not self.pool.recyclable(seg, nbytes):
                self.refused += 1
                log.info("%s stays for now (read, or its segment does not fit): step %d of rank %d gets another segment",
                         entry.key, key.step, rank)  # fmt: skip
                return None
            log.debug("retiring %s early: step %d of rank %d takes its segment", entry.key, key.step, rank)
            self.catalog.drop_locked(entry, reason=f"retired early: step {key.step} of its rank took its segment (ec:K+M)")
            self.recycled += 1
            return seg.path
