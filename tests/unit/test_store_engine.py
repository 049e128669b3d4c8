"""The store engine in-process (one host, R=1): life cycle, capacity, retention, leases."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from memstore.config import StoreConfig
from memstore.core.model import ShardKey, ShardState
from memstore.errors import AlreadySaved, CapacityExceeded, InvalidArgument, LeaseError, ShardNotFound, UnknownJob
from memstore.server.store import Store
from memstore.testing import wait_for

pytestmark = pytest.mark.unit
MiB = 1 << 20


def solo_store(tmp_path, keep: int) -> Store:  # type: ignore[no-untyped-def]
    config = StoreConfig.load(
        {
            "host_id": "solo",
            "replicas": "1",
            "capacity": "10MiB",
            "keep": str(keep),
            "shm_dir": str(tmp_path / "shm"),
            "chunk_bytes": "1MiB",
        },
        env={},
    )
    s = Store(config)
    s.start()
    return s


@pytest.fixture
def store(tmp_path) -> Iterator[Store]:  # type: ignore[no-untyped-def]
    s = solo_store(tmp_path, keep=2)
    yield s
    s.close()


@pytest.fixture
def store_keep3(tmp_path) -> Iterator[Store]:  # type: ignore[no-untyped-def]
    s = solo_store(tmp_path, keep=3)
    yield s
    s.close()


def save(store: Store, step: int, nbytes: int = 3 * MiB, rank: int = 0, world: int = 1, fill: int = 7, timeline: str = "") -> ShardKey:
    key = ShardKey("job", step, rank, timeline)
    lease, seg = store.allocate(key, world, nbytes)
    seg.view(nbytes)[:] = bytes([fill]) * nbytes
    store.commit(lease, {"loss": 1.0}, 1)
    info, done = store.wait_committed(key, 5)
    assert done and info.state is ShardState.COMMITTED
    return key


def steps_held(store: Store) -> list[int]:
    return sorted({s.manifest.key.step for s in store.list_shards("job")})


def test_commit_computes_checksums_and_commits_with_r1(store: Store) -> None:
    key = save(store, 1)
    (info,) = store.list_shards("job")
    assert info.verified and len(info.manifest.checksums) == 3 and info.copies == 1
    for manifest, view in store.read(key):
        assert manifest.nbytes == 3 * MiB and bytes(view[:4]) == b"\x07" * 4


def test_retention_keeps_newest_k(store: Store) -> None:
    for step in range(1, 6):
        save(store, step, nbytes=1 * MiB)
    wait_for(lambda: steps_held(store) == [4, 5], timeout=5, what="retention to evict old steps")


def test_capacity_error_carries_numbers_and_keeps_newest_committed(store: Store) -> None:
    save(store, 1)
    with pytest.raises(CapacityExceeded) as err:
        store.allocate(ShardKey("job", 2, 0), 1, 11 * MiB)
    assert err.value.needed == 11 * MiB and err.value.capacity == 10 * MiB
    assert "raise --capacity" in str(err.value)
    assert steps_held(store) == [1]  # nothing lost, store still serves
    assert store.health().serving


def test_pressure_drops_older_steps_but_never_the_newest_committed(store: Store) -> None:
    save(store, 1)
    save(store, 2)
    save(store, 3)  # 9 MiB of 10: the 4th save only fits by dropping step 1 or 2 early
    save(store, 4)
    held = steps_held(store)
    assert 3 in held and 4 in held
    with pytest.raises(CapacityExceeded):
        store.allocate(ShardKey("job", 5, 0), 1, 8 * MiB)  # would need dropping step 4, the newest committed
    assert 4 in steps_held(store)


def test_invalid_keys_are_rejected(store: Store) -> None:
    for key, world in [(ShardKey("job", -1, 0), 1), (ShardKey("job", 1, 2), 2), (ShardKey("../etc", 1, 0), 1), (ShardKey("", 1, 0), 1)]:
        with pytest.raises(InvalidArgument):
            store.allocate(key, world, 10)
    with pytest.raises(InvalidArgument):
        store.allocate(ShardKey("job", 1, 0), 1, 0)


def test_unknown_job_and_missing_shard(store: Store) -> None:
    with pytest.raises(UnknownJob):
        store.open(ShardKey("nojob", 1, 0))
    save(store, 1)
    with pytest.raises(ShardNotFound):
        store.open(ShardKey("job", 9, 0))
    with pytest.raises(UnknownJob):
        store.delete("nojob", -1, -1)


def test_leases(store: Store) -> None:
    with pytest.raises(LeaseError):
        store.commit("nope", {}, 1)
    lease, _ = store.allocate(ShardKey("job", 1, 0), 1, MiB)
    store.release(lease)  # abandoned allocation gives the memory back
    assert store.pool.in_use_bytes == 0
    key = save(store, 2)
    read_lease, entry = store.open(key)
    assert entry.pins == 1
    store.delete("job", -1, -1)
    assert entry.dropped and store.pool.in_use_bytes == entry.segment.size  # still pinned by the reader
    store.release(read_lease)
    assert store.pool.in_use_bytes == 0


def test_segments_are_recycled(store: Store) -> None:
    for step in range(1, 8):
        save(store, step, nbytes=2 * MiB)
    paths = {e.segment.path for e in map(store.catalog.get, {i.manifest.key for i in store.list_shards("job")}) if e}
    files = {p.name for p in store.pool.directory.iterdir() if p.name.startswith("seg-")}  # type: ignore[union-attr]
    assert len(files) <= 5, files  # bounded by capacity / size (10 MiB / 2 MiB), not one file per save
    assert {p.rsplit("/", 1)[1] for p in paths if p} <= files


def test_resave_of_the_same_shard_on_the_same_timeline_is_refused(store: Store) -> None:
    key = save(store, 1, fill=1, timeline="A.0")
    with pytest.raises(AlreadySaved, match="new timeline"):
        store.allocate(key, 1, MiB)
    lease, _ = store.allocate(ShardKey("job", 2, 0, "A.0"), 1, MiB)
    other, _ = store.allocate(ShardKey("job", 2, 0, "A.0"), 1, MiB)  # two captures racing: the second commit loses
    store.commit(lease, {}, 1)
    with pytest.raises(AlreadySaved):
        store.commit(other, {}, 1)
    new = save(store, 1, fill=2, timeline="A.1")  # a re-save on a new timeline is fine; both versions are held
    for _, view in store.read(new):
        assert view[0] == 2
    for _, view in store.read(key):
        assert view[0] == 1
    entry = store.catalog.get(new)
    assert entry is not None and entry.state is ShardState.COMMITTED


def versions_held(store: Store) -> list[tuple[int, str]]:
    return sorted({(s.manifest.key.step, s.manifest.key.timeline) for s in store.list_shards("job")})


def test_going_back_to_an_older_step_drops_the_abandoned_later_steps(store_keep3: Store) -> None:
    # keep 3, so that retention holds A.0@1 whenever it runs: what goes is only what the rollback superseded
    store = store_keep3
    for step in (1, 2, 3):
        save(store, step, nbytes=MiB, timeline="A.0")
    new = save(store, 2, nbytes=MiB, fill=9, timeline="B.0")  # the job restarted from step 1 and saved step 2 again
    # B.0@2 is complete (one rank): A.0's steps 2 and 3 are superseded and go; A.0@1 stays (history before the rollback)
    wait_for(lambda: versions_held(store) == [(1, "A.0"), (2, "B.0")], timeout=5, what="superseded versions to go")
    latest = store.latest_step("job").version
    assert latest is not None and latest.timeline == "B.0"
    for _, view in store.read(new):
        assert view[0] == 9


def test_resave_of_a_step_keeps_the_old_version_until_the_new_one_is_complete(store: Store) -> None:
    for step in (1, 2):
        save(store, step, nbytes=MiB, world=2, timeline="A.0")
        save(store, step, nbytes=MiB, world=2, rank=1, timeline="A.0")
    save(store, 2, nbytes=MiB, world=2, fill=9, timeline="B.0")  # rank 0 re-saves step 2; rank 1 never does
    latest = store.latest_step("job").version
    assert latest is not None and (latest.step, latest.timeline) == (2, "A.0")  # not rank 0 new + rank 1 old
    assert (2, "A.0") in versions_held(store) and (2, "B.0") in versions_held(store)
    save(store, 2, nbytes=MiB, world=2, rank=1, fill=9, timeline="B.0")
    wait_for(lambda: (2, "A.0") not in versions_held(store), timeout=5, what="the old version to go once the new one is complete")
    latest = store.latest_step("job").version
    assert latest is not None and (latest.step, latest.timeline) == (2, "B.0")


def test_readiness_reasons(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Ready = a slot, at least R holders in the table, a repair pass under the current layout; draining is not."""
    config = StoreConfig.load(
        {"host_id": "a", "replicas": "2", "capacity": "4MiB", "shm_dir": str(tmp_path / "shm"), "discovery": "fed"}, env={}
    )
    s = Store(config)
    try:
        assert s.readiness().startswith("holds no slot yet")
        s.membership.apply({"a": ("127.0.0.1:1", "")})
        assert "fewer than R=2" in s.readiness()  # alone: saves cannot reach two copies
        s.membership.apply({"a": ("127.0.0.1:1", ""), "b": ("127.0.0.1:2", "")})
        assert s.readiness().startswith("repairing")  # no repair pass has run under this layout
        s.recovery.repaired_table = s.membership.view.table
        assert s.readiness() == "" and s.alive(1.0)
        s.draining.set()
        assert s.readiness() == "draining"
    finally:
        s.close()


def test_an_erasure_coded_store_protects_with_parity(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Under ec:K+M the saver's protection is the encoder (parity to the group), repair rebuilds, and nothing replicates."""
    peers = ",".join(f"h{i}=127.0.0.1:{7070 + i}" for i in range(5))
    config = StoreConfig.load({"host_id": "h0", "peers": peers, "redundancy": "ec:4+1", "shm_dir": str(tmp_path / "shm")}, env={})
    s = Store(config)
    try:
        assert s.encoder is not None and s.saver.replicator is s.encoder
        assert s.rebuilder is not None and s.recovery.rebuilder is s.rebuilder and s.janitor.parity is s.parity
        placement = s.membership.view.placement
        assert placement is not None and placement.group_of("slot0") == tuple(f"slot{i}" for i in range(5))
        s.membership.apply({f"h{i}": (f"127.0.0.1:{7070 + i}", "") for i in range(4)})  # h4 gone: no group of five
        assert "fewer than K+M=5 (ec:4+1)" in s.readiness()
    finally:
        s.close()
