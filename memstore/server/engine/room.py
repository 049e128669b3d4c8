"""Room for a shard: a segment from the pool within the store's capacity and the job's quota, made under pressure.

Over either limit, the copies pulled ahead of a restore go first (``Eviction.drop_cached``), then the fewest of the
job's own older copies that make room (``Eviction.make_room``: never its newest settled version nor its protected
steps), and the pool is asked again; when even all of those would not do, the request is refused at once and
nothing is dropped (``memstore.core.limits.room_by_dropping``). The ``Saver`` (saves, streams in) and ``Recovery``
(pulls) ask it; ``Store`` builds the one ``Room``.

No lock of its own: the pool takes its own lock for each request, and ``Eviction`` chooses and drops what goes in
one step under the catalog's lock (the catalog's lock, then the pool's: the order the engine keeps), so a segment is
never asked for while the catalog's lock is held.

A save into its rank's full capture ring first asks the ``Recycler`` (ec:K+M with keep >= 2, else none) for the
segment of the rank's oldest kept step (``memstore.server.engine.recycling``); when it has none to give, the ring grows.
"""

from __future__ import annotations

from memstore.config import StoreConfig
from memstore.core.model import ShardKey
from memstore.errors import CapacityExceeded, QuotaExceeded
from memstore.server.engine.eviction import Eviction
from memstore.server.engine.recycling import Recycler
from memstore.server.memory.pool import NO_RING, Segment, SegmentPool
from memstore.server.memory.rings import AHEAD_POLL_SECONDS


class Room:
    """Segments for shards, making room by dropping what pressure allows."""

    def __init__(self, eviction: Eviction, pool: SegmentPool, config: StoreConfig, recycler: Recycler | None = None) -> None:
        """``recycler``: where a save into its rank's full capture ring gets its oldest kept step's segment (None: the
        ring grows instead)."""
        self.eviction = eviction
        self.pool = pool
        self.config = config
        self.recycler = recycler

    def acquire(
        self, key: ShardKey, nbytes: int, preferred: str = "", ring: int = NO_RING, evict: bool = True, grow: bool = False,
        sparse: bool = False, stream: bool = True,
    ) -> Segment:  # fmt: skip
        """A segment for ``key``, within the store's capacity and the job's quota (``--job-quota``), making room under
        pressure as the module says. ``evict=False`` (memory reserved ahead of a save, which may never come, or a pull
        ahead of a restore): refuse rather than drop anything. ``sparse``: a segment made for it leaves its pages to
        the client that writes it (``SegmentMaker.create``). ``stream=False``: the bytes are no shard of ``key``'s rank
        cycling through this store (a parity fragment, which whichever data host contributes first allocates), so the
        automatic reserve does not size itself by them (``memstore.core.reserve_policy``).
        """
        if ring != NO_RING and evict:  # a save into its rank's full capture ring recycles, or grows it (counted past the slack)
            with self.pool.saving_into(key.job_id, ring):
                full = self.pool.ring_full(key.job_id, ring)
                recycled = self.recycler.take_oldest(key, nbytes) if full and self.recycler is not None else None
                if recycled:
                    preferred, full = recycled, 0
                if full:
                    self.pool.count_growth(key.job_id, ring, full)
                return self._within_limits(key, nbytes, preferred, ring, evict, grow, sparse, stream)
        return self._within_limits(key, nbytes, preferred, ring, evict, grow, sparse, stream)

    def _within_limits(
        self, key: ShardKey, nbytes: int, preferred: str, ring: int, evict: bool, grow: bool, sparse: bool, stream: bool
    ) -> Segment:
        wait = AHEAD_POLL_SECONDS if ring != NO_RING and not evict and not grow else 0.0  # a reservation ahead: see rings.py
        while True:
            try:
                return self.pool.acquire(
                    nbytes, key.job_id, what=f"shard {key}", quota=self.config.job_quota, preferred=preferred, ring=ring, grow=grow,
                    stream=(key.job_id, key.rank) if stream else None, wait=wait, sparse=sparse,
                )  # fmt: skip
            except CapacityExceeded as exc:  # QuotaExceeded included: its numbers are the job's
                if not evict:
                    raise
                if self.eviction.drop_cached(key, quota=isinstance(exc, QuotaExceeded)):
                    continue  # copies pulled ahead of a restore go first
                if not self.eviction.make_room(key, exc):
                    raise

    def release(self, segment: Segment) -> None:
        """Give back a segment from ``acquire`` that never joined the catalog (a pull or a transfer that failed)."""
        self.pool.release(segment)
