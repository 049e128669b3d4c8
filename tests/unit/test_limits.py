"""Limits on what arrives from the network: the per-job byte quota, transfers per sender, manifests beyond the
wire's bounds. Pure decisions (memstore.core.limits) and the engine in-process (one host, R=1)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from memstore.config import StoreConfig
from memstore.core.limits import admits, over_limit, room_by_dropping, transfer_sender
from memstore.core.model import Holding, Manifest, PutOrigin, ShardKey, ShardState, TransferHeader
from memstore.core.restorable import restorable_versions
from memstore.errors import CapacityExceeded, ConfigError, InvalidArgument, ManifestTooLarge, QuotaExceeded, StreamError, TooManyStreams
from memstore.server.store import Store
from memstore.v1 import store_pb2 as pb
from memstore.v1.integrity import MAX_CHUNKS_PER_SHARD, compute_checksums
from memstore.v1.keys import MAX_METRICS, MAX_WORLD_SIZE
from memstore.v1.manifests import manifest_from_pb

pytestmark = pytest.mark.unit
MiB = 1 << 20


# -- pure decisions ------------------------------------------------------------------------------------
def k(step: int) -> ShardKey:
    return ShardKey("j", step, 0)


def test_room_by_dropping_takes_the_fewest_in_order_or_nothing() -> None:
    candidates = [(k(1), 3), (k(2), 3), (k(3), 3)]
    assert room_by_dropping(candidates, used=6, needed=4, limit=10) == []  # fits already
    assert room_by_dropping(candidates, used=9, needed=3, limit=10) == [k(1)]
    assert room_by_dropping(candidates, used=9, needed=6, limit=10) == [k(1), k(2)]
    assert room_by_dropping(candidates, used=9, needed=11, limit=10) == []  # never fits: drop nothing
    assert room_by_dropping(candidates[:1], used=9, needed=5, limit=10) == []  # all of them are not enough: drop nothing
    assert not over_limit(10**15, 10**15, 0)  # 0 = unlimited
    assert over_limit(1, 10, 10) and not over_limit(0, 10, 10)


def test_transfers_count_against_the_peer_or_the_job() -> None:
    assert transfer_sender(PutOrigin.REPLICA, "j", "h1", "h0") == "peer:h1"
    assert transfer_sender(PutOrigin.REPAIR, "j", "", "h0") == "peer:h0"  # no sender named: its owner
    assert transfer_sender(PutOrigin.CLIENT, "j", "client-rank-3", "") == "job:j"
    assert admits(0, 1) and not admits(1, 1) and admits(10**6, 0)


def test_restorable_versions_never_builds_the_claimed_world() -> None:
    started = time.monotonic()
    assert restorable_versions([Holding("h", ShardKey("j", 1, 0), 2**31 - 1, True)], "j") == []
    assert time.monotonic() - started < 1.0
    assert [v.step for v in restorable_versions([Holding("h", ShardKey("j", 1, r), 2, True) for r in (0, 1)], "j")] == [1]


def test_flags_parse() -> None:
    config = StoreConfig.load({"host_id": "h0", "replicas": "1", "job_quota": "1GiB", "max_streams_per_peer": "4"}, env={})
    assert config.job_quota == 1 << 30 and config.max_streams_per_peer == 4
    defaults = StoreConfig.load({"host_id": "h0", "replicas": "1"}, env={})
    assert defaults.job_quota == 0 and defaults.max_streams_per_peer == 16
    for cli, flag in (({"job_quota": "lots"}, "--job-quota"), ({"max_streams_per_peer": "-1"}, "--max-streams-per-peer")):
        with pytest.raises(ConfigError, match=flag):
            StoreConfig.load({"host_id": "h0", "replicas": "1", **cli}, env={})


# -- the engine -------------------------------------------------------------------------------------------
def make_store(tmp_path, **flags: str) -> Store:  # type: ignore[no-untyped-def]
    cli = {"host_id": "solo", "replicas": "1", "capacity": "20MiB", "keep": "5", "shm_dir": str(tmp_path / "shm"), "chunk_bytes": "1MiB"}
    s = Store(StoreConfig.load({**cli, **flags}, env={}))
    s.start()
    return s


@pytest.fixture
def store(tmp_path) -> Iterator[Store]:  # type: ignore[no-untyped-def]
    s = make_store(tmp_path, job_quota="7MiB", max_streams_per_peer="2")
    yield s
    s.close()


def save(store: Store, step: int, nbytes: int = 3 * MiB, job: str = "job") -> ShardKey:
    key = ShardKey(job, step, 0)
    lease, seg = store.allocate(key, 1, nbytes)
    seg.view(nbytes)[:] = b"\x05" * nbytes
    store.commit(lease, {}, 1)
    info, done = store.wait_committed(key, 5)
    assert done and info.state is ShardState.COMMITTED
    return key


def steps_held(store: Store, job: str = "job") -> list[int]:
    return sorted({s.manifest.key.step for s in store.list_shards(job)})


def replica_header(
    key: ShardKey, data: bytes, sender: str = "peer1", owner: str = "peer1", origin: PutOrigin = PutOrigin.REPLICA
) -> TransferHeader:
    m = Manifest(key, 64, len(data), MiB, tuple(compute_checksums(memoryview(data), len(data), MiB)), owner)
    return TransferHeader(m, origin, sender)


def chunks_of(data: bytes) -> list[bytes]:
    return [data[i : i + MiB] for i in range(0, len(data), MiB)]


def test_quota_drops_the_jobs_older_steps_to_fit(store: Store) -> None:
    save(store, 1)
    save(store, 2)  # 6 MiB of the job's 7 MiB
    save(store, 3)  # fits only without step 1
    assert steps_held(store) == [2, 3]
    assert store.pool.owner_bytes("job") == 6 * MiB


def test_quota_refuses_without_dropping_when_dropping_is_not_enough(store: Store) -> None:
    save(store, 1)
    save(store, 2)
    with pytest.raises(QuotaExceeded) as err:
        store.allocate(ShardKey("job", 3, 0), 1, 5 * MiB)  # would need steps 1 and 2 gone; step 2 is the newest
    e = err.value
    assert (e.job_id, e.quota, e.used, e.needed) == ("job", 7 * MiB, 6 * MiB, 5 * MiB)
    assert e.status == "RESOURCE_EXHAUSTED" and isinstance(e, CapacityExceeded)
    for text in ("'job'", "--job-quota", str(7 * MiB), str(6 * MiB), str(5 * MiB)):
        assert text in str(e)
    meta = dict(e.trailing_metadata())
    assert meta["memstore-limit"] == "job-quota" and meta["memstore-job-id"] == "job"
    assert int(meta["memstore-capacity-bytes"]) == 7 * MiB and int(meta["memstore-used-bytes"]) == 6 * MiB
    assert steps_held(store) == [1, 2]  # nothing was dropped for a write that could not fit anyway
    with pytest.raises(QuotaExceeded):
        store.allocate(ShardKey("job", 3, 0), 1, 8 * MiB)  # beyond the quota itself
    assert steps_held(store) == [1, 2]


def test_quota_is_per_job_and_counts_replicas(store: Store) -> None:
    save(store, 1)
    save(store, 2)
    save(store, 1, job="other")  # another job has its own 7 MiB
    save(store, 2, job="other")
    data = bytes(range(256)) * (6 * 4096)  # 6 MiB replica of a third job, then its owner's next step
    store.receive(replica_header(ShardKey("third", 1, 0), data), chunks_of(data))
    assert store.pool.owner_bytes("third") == 6 * MiB
    with pytest.raises(QuotaExceeded, match="'third'"):
        store.allocate(ShardKey("third", 2, 0), 1, 2 * MiB)  # the replica is the job's newest version: it stays
    assert steps_held(store, "third") == [1]


def test_capacity_pressure_drops_nothing_for_a_write_that_cannot_fit(tmp_path) -> None:  # type: ignore[no-untyped-def]
    s = make_store(tmp_path, capacity="10MiB")
    try:
        save(s, 1)
        save(s, 2)
        save(s, 3)
        with pytest.raises(CapacityExceeded) as err:
            s.allocate(ShardKey("job", 4, 0), 1, 8 * MiB)  # needs 1 and 2 gone and more: refused, nothing dropped
        assert not isinstance(err.value, QuotaExceeded) and "--capacity" in str(err.value)
        assert dict(err.value.trailing_metadata())["memstore-limit"] == "capacity"
        assert steps_held(s) == [1, 2, 3]
        save(s, 4, nbytes=4 * MiB)  # needs exactly step 1 gone
        assert steps_held(s) == [2, 3, 4]
    finally:
        s.close()


def test_streams_per_peer_and_per_job(store: Store) -> None:
    data = b"\x01" * MiB
    for rank in (0, 1):
        store.prepare_receive(replica_header(ShardKey("job", 9, rank), data))
    with pytest.raises(TooManyStreams) as err:
        store.prepare_receive(replica_header(ShardKey("job", 9, 2), data))
    e = err.value
    assert (e.sender, e.active, e.max_streams, e.status) == ("peer:peer1", 2, 2, "RESOURCE_EXHAUSTED")
    assert "--max-streams-per-peer 2" in str(e) and "peer 'peer1'" in str(e)
    assert dict(e.trailing_metadata()) == {
        "memstore-active-streams": "2",
        "memstore-max-streams": "2",
        "memstore-limit": "max-streams-per-peer",
    }
    assert store.pool.in_use_bytes == 2 * MiB  # the refused one reserved nothing
    store.prepare_receive(replica_header(ShardKey("job", 9, 2), data, sender="peer2"))  # another peer has its own
    # Clients count per job, whatever rank or sender name they give.
    for rank in (0, 1):
        store.prepare_receive(
            replica_header(ShardKey("cj", 1, rank), data, sender=f"client-rank-{rank}", owner="", origin=PutOrigin.CLIENT)
        )
    with pytest.raises(TooManyStreams, match="clients of job 'cj'"):
        store.prepare_receive(replica_header(ShardKey("cj", 1, 2), data, sender="client-rank-2", owner="", origin=PutOrigin.CLIENT))
    # Expired tickets give their slots back.
    store.datapath.expire_tickets(time.monotonic() + 3600)
    assert store.admission.open_streams() == {} and store.pool.in_use_bytes == 0
    store.prepare_receive(replica_header(ShardKey("job", 9, 0), data))


def test_put_streams_give_their_slot_back_stored_or_not(store: Store) -> None:
    data = bytes(range(256)) * 8192  # 2 MiB
    header = replica_header(ShardKey("job", 4, 0), data)
    with pytest.raises(StreamError):
        store.receive(header, chunks_of(data)[:1])  # short stream
    with pytest.raises(StreamError):
        store.receive(header, [data])  # oversized chunk
    assert store.admission.open_streams() == {}
    store.receive(header, chunks_of(data))
    assert store.admission.open_streams() == {} and steps_held(store) == [4]


def test_data_channel_receive_gives_its_slot_back(store: Store) -> None:
    data = bytes(range(256)) * 4096
    ticket = store.prepare_receive(replica_header(ShardKey("job", 5, 0), data))
    assert store.admission.open_streams() == {"peer:peer1": 1}
    ours, theirs = socket.socketpair()
    with ours, theirs:
        server = threading.Thread(target=store.serve_ticket, args=(ticket, ours))
        server.start()
        theirs.sendall(data)
        assert theirs.recv(1) == b"\x00"  # stored
        server.join(5)
    assert store.admission.open_streams() == {} and steps_held(store) == [5]


def test_a_stream_blocked_by_a_quota_gives_its_slot_back(store: Store) -> None:
    data = b"\x02" * (8 * MiB)
    with pytest.raises(QuotaExceeded):
        store.prepare_receive(replica_header(ShardKey("job", 6, 0), data))
    assert store.admission.open_streams() == {} and store.pool.in_use_bytes == 0


def test_unlimited_when_flags_are_zero(tmp_path) -> None:  # type: ignore[no-untyped-def]
    s = make_store(tmp_path, job_quota="0", max_streams_per_peer="0")
    try:
        data = b"\x01" * MiB
        for rank in range(20):
            s.prepare_receive(replica_header(ShardKey("job", 1, rank), data))
        assert s.admission.open_streams() == {"peer:peer1": 20}
    finally:
        s.close()


# -- manifests beyond the wire's bounds -----------------------------------------------------------------
def test_oversized_manifests_are_refused_before_they_are_converted() -> None:
    m = pb.Manifest(key=pb.ShardKey(job_id="j", step=1, rank=0), world_size=1, nbytes=MAX_CHUNKS_PER_SHARD + 1, chunk_size=1)
    m.chunk_checksums.extend([0] * (MAX_CHUNKS_PER_SHARD + 1))
    with pytest.raises(ManifestTooLarge, match="MAX_CHUNKS_PER_SHARD"):
        manifest_from_pb(m)
    m2 = pb.Manifest(key=pb.ShardKey(job_id="j", step=1, rank=0), world_size=1, metrics={f"m{i}": 1.0 for i in range(MAX_METRICS + 1)})
    with pytest.raises(ManifestTooLarge, match="MAX_METRICS"):
        manifest_from_pb(m2)


def test_engine_refuses_manifests_beyond_the_bounds(store: Store) -> None:
    key = ShardKey("job", 1, 0)
    too_many_chunks = Manifest(key, 1, MAX_CHUNKS_PER_SHARD + 1, 1, (0,) * (MAX_CHUNKS_PER_SHARD + 1), "peer1")
    huge_world = Manifest(key, MAX_WORLD_SIZE + 1, 1, 1, (0,), "peer1")
    metrics = Manifest(key, 1, 1, 1, (0,), "peer1", metrics={"x" * 300: 1.0})
    for m, text in ((too_many_chunks, "MAX_CHUNKS_PER_SHARD"), (huge_world, "MAX_WORLD_SIZE"), (metrics, "MAX_METRIC_NAME_CHARS")):
        with pytest.raises(InvalidArgument, match=text):
            store.prepare_receive(TransferHeader(m, PutOrigin.REPLICA, "peer1"))
    with pytest.raises(InvalidArgument, match="MAX_WORLD_SIZE"):
        store.allocate(key, 2**31 - 1, MiB)
    with pytest.raises(CapacityExceeded):
        store.allocate(key, 1, 1 << 60)  # nbytes far beyond the capacity: refused before anything is allocated
    lease, _ = store.allocate(key, 1, MiB)
    with pytest.raises(InvalidArgument, match="MAX_METRICS"):
        store.commit(lease, {f"m{i}": 1.0 for i in range(MAX_METRICS + 1)}, 1)
    assert store.admission.open_streams() == {}


def test_segment_pool_accounts_each_job_against_its_quota(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from memstore.server.memory.pool import SegmentPool

    pool = SegmentPool(str(tmp_path / "segs"), 16 * MiB)
    try:
        a = pool.acquire(3 * MiB, "a", quota=4 * MiB)
        with pytest.raises(QuotaExceeded) as err:
            pool.acquire(2 * MiB, "a", quota=4 * MiB)
        assert (err.value.used, err.value.needed, err.value.quota, err.value.job_id) == (3 * MiB, 2 * MiB, 4 * MiB, "a")
        b = pool.acquire(4 * MiB, "b", quota=4 * MiB)  # another job's bytes do not count
        assert pool.owner_bytes("a") == 3 * MiB and pool.owner_bytes("b") == 4 * MiB
        pool.release(a)  # pooled: no longer the job's
        assert pool.owner_bytes("a") == 0
        again = pool.acquire(3 * MiB, "a", quota=4 * MiB)
        assert again is a  # the pooled segment came back within the quota
        pool.release(again)
        # 2.5 MiB would reuse the pooled 3 MiB segment, but the job's quota of 2.75 MiB does not hold it: a fresh one
        assert pool.acquire(5 * MiB // 2, "a", quota=11 * MiB // 4).size == 5 * MiB // 2
        pool.release(b)
    finally:
        pool.close()
