"""Crash adoption alone (``leftovers.Adoption`` and ``Sidecars``), over the catalog and a fake pool: a settled copy's
sidecar is written for it, and after a restart the leftovers that verify are registered, the rest go back."""

from __future__ import annotations

from dataclasses import replace

import pytest

from memstore.core.model import ShardKey, ShardState
from memstore.server.convert import sidecar_bytes, sidecar_info
from tests.unit.engine_fakes import FakePool, adoption_of, make_catalog, settled

pytestmark = pytest.mark.unit
DATA = bytes(range(256)) * 32  # 8 KiB: two chunks
KEY = ShardKey("job", 1, 0)


def leftover(pool: FakePool, data: bytes):  # type: ignore[no-untyped-def]
    """A segment holding ``data`` as the previous incarnation left it (not accounted until adopted)."""
    seg = pool.acquire(len(data), "")
    pool.used -= len(data)
    seg.view(len(data))[:] = data
    return seg


def described() -> bytes:
    """The sidecar a settled copy of KEY holding DATA got in a store before the restart."""
    catalog, pool, _ = make_catalog()
    good = settled(catalog, KEY, DATA)
    return pool.described[id(good.segment)]


def test_adoption_keeps_settled_copies_that_verify_and_deletes_the_rest() -> None:
    meta = described()
    assert sidecar_info(meta).state is ShardState.COMMITTED
    fresh, pool, _ = make_catalog()
    corrupt, intact = leftover(pool, DATA[::-1]), leftover(pool, DATA)
    pool.adoptable = [(corrupt, meta), (intact, meta)]
    assert adoption_of(fresh).adopt() == 1
    adopted = fresh.get(KEY)
    assert adopted is not None and adopted.segment is intact and adopted.state is ShardState.COMMITTED and adopted.verified
    assert intact.owner == "job" and pool.used == len(DATA)  # never pooled for another job


def test_a_copy_that_had_not_settled_is_not_adopted() -> None:
    """Only settled copies are described; a sidecar that says otherwise (another version's) is not trusted."""
    unsettled = sidecar_bytes(replace(sidecar_info(described()), state=ShardState.REPLICATING, verified=False))
    fresh, pool, _ = make_catalog()
    pool.adoptable = [(leftover(pool, DATA), unsettled)]
    assert adoption_of(fresh).adopt() == 0 and fresh.get(KEY) is None


def test_a_shard_held_already_is_not_adopted_twice() -> None:
    meta = described()
    fresh, pool, _ = make_catalog()
    held = settled(fresh, KEY, DATA)  # pulled or saved before the leftovers were looked at
    pool.adoptable = [(leftover(pool, DATA), meta)]
    assert adoption_of(fresh).adopt() == 0 and fresh.get(KEY) is held


def test_a_shard_registered_between_the_check_and_the_registration_goes_back() -> None:
    """The check asks the catalog without holding its lock through the registration: the registration asks again."""
    meta = described()
    fresh, pool, _ = make_catalog()
    first, twin = leftover(pool, DATA), leftover(pool, DATA)
    pool.adoptable = [(first, meta), (twin, meta)]  # two leftovers of one shard: both pass the check
    assert adoption_of(fresh).adopt() == 1
    assert fresh.get(KEY).segment is first and twin in pool.released  # type: ignore[union-attr]
