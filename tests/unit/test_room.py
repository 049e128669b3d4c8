"""Room alone, over the catalog's Eviction and a fake pool: a segment within the capacity and the job's quota, made under pressure."""

from __future__ import annotations

import pytest

from memstore.core.model import ShardKey
from memstore.errors import CapacityExceeded, QuotaExceeded
from memstore.server.engine.eviction import Eviction
from memstore.server.engine.room import Room
from tests.unit.engine_fakes import KiB, config, make_catalog, room_of, settled

pytestmark = pytest.mark.unit
DATA = bytes(range(256)) * 32  # 8 KiB: two chunks


def key(step: int, rank: int = 0, job: str = "job") -> ShardKey:
    return ShardKey(job, step, rank)


def test_pressure_drops_older_copies_of_the_job_but_never_its_newest_settled_step() -> None:
    catalog, pool, _ = make_catalog(config(capacity="32KiB"))
    room = room_of(catalog)
    old = settled(catalog, key(1), DATA, created=1.0)
    settled(catalog, key(2), DATA, created=2.0)
    settled(catalog, key(3), DATA, created=3.0)
    seg = room.acquire(key(4), 10 * KiB)  # needs two of the older steps gone
    assert old.dropped and catalog.get(key(3)) is not None and seg.size == 10 * KiB
    with pytest.raises(CapacityExceeded):
        room.acquire(key(5), 30 * KiB)  # only by dropping step 3, the newest settled: refused, nothing dropped
    assert catalog.get(key(3)) is not None
    with pytest.raises(CapacityExceeded):
        room.acquire(key(5), 20 * KiB, evict=False)  # memory reserved ahead never drops a step
    assert pool.used <= pool.capacity


def test_a_failed_pulls_segment_goes_back() -> None:
    catalog, pool, _ = make_catalog()
    room = room_of(catalog)
    seg = room.acquire(key(1), len(DATA), evict=False)
    assert pool.used == len(DATA)
    room.release(seg)
    assert pool.used == 0 and seg in pool.released


class QuotaPool:
    """A pool whose job quota is full until one of the job's segments goes back."""

    def __init__(self, inner, quota: int) -> None:  # type: ignore[no-untyped-def]
        self.inner, self.quota = inner, quota

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.inner, name)

    def acquire(self, nbytes: int, owner: str, what: str = "", **kw):  # type: ignore[no-untyped-def]
        if self.inner.used + nbytes > self.quota:
            raise QuotaExceeded(f"{what} over the quota", needed=nbytes, used=self.inner.used, quota=self.quota, job_id=owner)
        return self.inner.acquire(nbytes, owner, what, **kw)


def test_over_the_job_quota_the_jobs_older_copies_go() -> None:
    catalog, pool, _ = make_catalog(config(capacity="64KiB"))
    old = settled(catalog, key(1), DATA, created=1.0)
    settled(catalog, key(2), DATA, created=2.0)
    room = Room(Eviction(catalog), QuotaPool(pool, 16 * KiB), catalog.config)  # type: ignore[arg-type]
    seg = room.acquire(key(3), len(DATA))
    assert old.dropped and catalog.get(key(2)) is not None and seg.size == len(DATA)  # the newest settled step stays
