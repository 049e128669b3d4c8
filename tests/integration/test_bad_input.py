"""Bad input from the network: typed errors, the store keeps serving, nothing stored is lost."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import grpc
import pytest

from memstore.testing import LocalCluster
from memstore.v1 import store_pb2 as pb
from memstore.v1 import store_pb2_grpc as pb_grpc
from memstore.v1.channel import insecure_channel
from memstore.v1.integrity import MAX_CHUNK_BYTES, compute_checksums
from tests.harness.inprocess import InProcessCluster
from tests.states import assert_same, rank_state
from trainer_client import CheckpointClient
from trainer_client.errors import CapacityExceededError, InvalidArgumentError, NoCheckpointError, NotFoundError

pytestmark = pytest.mark.integration
JOB = "bad-input"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[LocalCluster]:  # type: ignore[no-untyped-def]
    c = InProcessCluster(hosts=2, replicas=2, capacity="64MiB", workdir=tmp_path_factory.mktemp("bad-input")).start()
    client = CheckpointClient(JOB, 0, 1, store=c.address("h0"))
    client.save(1, rank_state(0, 1)).wait(timeout=30)
    client.close()
    yield c
    c.stop()


@pytest.fixture
def stub(cluster: LocalCluster) -> Iterator[pb_grpc.StoreStub]:
    with insecure_channel(cluster.address("h0")) as ch:
        yield pb_grpc.StoreStub(ch)


@pytest.fixture(autouse=True)
def nothing_lost(cluster: LocalCluster) -> Iterator[None]:
    yield
    client = CheckpointClient(JOB, 0, 1, store=cluster.address("h0"))
    try:
        assert client.latest_step() == 1
        assert_same(client.load(1), rank_state(0, 1))
    finally:
        client.close()
    assert cluster.health("h0").serving  # type: ignore[union-attr]


def code_of(fn) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code()


def key(job: str = JOB, step: int = 2, rank: int = 0) -> pb.ShardKey:
    return pb.ShardKey(job_id=job, step=step, rank=rank)


def test_unknown_job(cluster: LocalCluster, stub: pb_grpc.StoreStub) -> None:
    assert code_of(lambda: stub.Open(pb.OpenRequest(key=key(job="nope", step=1)), timeout=5)) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: list(stub.Get(pb.GetRequest(key=key(job="nope", step=1)), timeout=5))) == grpc.StatusCode.NOT_FOUND
    client = CheckpointClient("nope", 0, 1, store=cluster.address("h0"))
    try:
        assert client.latest_step() is None
        with pytest.raises(NoCheckpointError):
            client.load()
        with pytest.raises(NotFoundError, match="unknown"):
            client.load(1)
    finally:
        client.close()


def test_negative_step_and_rank_out_of_range(cluster: LocalCluster, stub: pb_grpc.StoreStub) -> None:
    bad = [
        pb.AllocateRequest(key=key(step=-1), world_size=1, nbytes=10),
        pb.AllocateRequest(key=key(rank=2), world_size=2, nbytes=10),
        pb.AllocateRequest(key=key(rank=-1), world_size=2, nbytes=10),
        pb.AllocateRequest(key=key(job="../../etc"), world_size=1, nbytes=10),
        pb.AllocateRequest(key=key(), world_size=0, nbytes=10),
    ]
    for request in bad:
        assert code_of(lambda r=request: stub.Allocate(r, timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
    client = CheckpointClient(JOB, 0, 1, store=cluster.address("h0"))
    try:
        with pytest.raises(InvalidArgumentError, match="step -1"):
            client.save(-1, {})
    finally:
        client.close()
    with pytest.raises(InvalidArgumentError, match="rank 4"):
        CheckpointClient(JOB, 4, 4, store=cluster.address("h0"))


def put_stream(manifest: pb.Manifest, chunks: list[bytes]) -> Iterator[pb.PutRequest]:
    yield pb.PutRequest(header=pb.PutHeader(manifest=manifest, origin=pb.PUT_ORIGIN_REPLICA, sender_host="test"))
    for c in chunks:
        yield pb.PutRequest(chunk=c)


def manifest_for(data: bytes, chunk: int) -> pb.Manifest:
    return pb.Manifest(
        key=key(step=7),
        world_size=1,
        nbytes=len(data),
        chunk_size=chunk,
        chunk_checksums=compute_checksums(memoryview(data), len(data), chunk),
        owner_host="h0",
    )


def test_oversized_chunk(stub: pb_grpc.StoreStub) -> None:
    data = bytes(range(256)) * 8192  # 2 MiB
    m = manifest_for(data, 1 << 20)
    # A chunk larger than the manifest's chunk size is refused by our check ...
    assert code_of(lambda: stub.Put(put_stream(m, [data]), timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
    # ... and a message larger than any chunk may be is refused by gRPC's own limit.
    huge = b"\0" * (MAX_CHUNK_BYTES + (2 << 20))
    assert (
        code_of(lambda: stub.Put(put_stream(manifest_for(huge, MAX_CHUNK_BYTES), [huge]), timeout=20)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    # A manifest whose chunk size exceeds the maximum is invalid.
    m2 = pb.Manifest(key=key(step=7), world_size=1, nbytes=10, chunk_size=MAX_CHUNK_BYTES + 1, chunk_checksums=[0], owner_host="h0")
    assert code_of(lambda: stub.Put(put_stream(m2, [b"x" * 10]), timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT


def test_checksum_mismatch_is_refused(stub: pb_grpc.StoreStub) -> None:
    data = b"a" * 3000
    m = manifest_for(data, 1024)
    assert code_of(lambda: stub.Put(put_stream(m, [data[:1024], b"b" * 1024, data[2048:]]), timeout=5)) == grpc.StatusCode.DATA_LOSS
    assert not any(s.manifest.key.step == 7 for s in stub.List(pb.ListRequest(job_id=JOB), timeout=5).shards)
    # short stream, and a stream with no header
    assert code_of(lambda: stub.Put(put_stream(m, [data[:1024]]), timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: stub.Put(iter([pb.PutRequest(chunk=b"x")]), timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT


def test_capacity_exhausted_is_clear(cluster: LocalCluster, stub: pb_grpc.StoreStub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.Allocate(pb.AllocateRequest(key=key(step=9), world_size=1, nbytes=100 << 20), timeout=5)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    meta = dict(err.value.trailing_metadata())
    assert int(meta["memstore-needed-bytes"]) == 100 << 20 and int(meta["memstore-capacity-bytes"]) == 64 << 20
    client = CheckpointClient(JOB, 0, 1, store=cluster.address("h0"))
    skipper = CheckpointClient(JOB, 0, 1, store=cluster.address("h0"), on_capacity="skip")
    try:
        import torch

        big = {"w": torch.zeros(100 << 18)}  # 100 MiB
        with pytest.raises(CapacityExceededError) as cerr:
            client.save(9, big)
        assert cerr.value.needed >= 100 << 20 and cerr.value.capacity == 64 << 20
        handle = skipper.save(9, big)
        assert handle.skipped and "capacity" in handle.skipped_reason
    finally:
        client.close()
        skipper.close()


def test_garbage_bytes_to_the_port(cluster: LocalCluster) -> None:
    host, port = cluster.address("h0").rsplit(":", 1)
    for payload in (
        b"\x00" * 64,
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        bytes(range(256)) * 64,
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\xff" * 100,
    ):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(payload)
            s.settimeout(2)
            try:
                s.recv(1024)
            except (TimeoutError, ConnectionResetError):
                pass


def closed_by_peer(s: socket.socket) -> bool:
    """The store hung up: EOF, or a reset because it closed with our bytes unread."""
    s.settimeout(5)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_data_channel_refuses_bad_tickets_and_corrupt_bytes(cluster: LocalCluster, stub: pb_grpc.StoreStub) -> None:
    from memstore.v1 import datachannel

    host = cluster.address("h0").rsplit(":", 1)[0]
    data = bytes(range(256)) * 4096  # 1 MiB
    m = manifest_for(data, 256 << 10)
    m.key.step = 11
    # An unknown ticket gets the connection closed and nothing else.
    port = stub.Hello(pb.HelloRequest(), timeout=5).data_port
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(b"\x00" * datachannel.TICKET_BYTES + data[:1000])
        assert closed_by_peer(s)
    # A valid ticket with corrupted payload is refused with DATA_LOSS and nothing is stored.
    ticket = stub.PrepareReceive(pb.PutHeader(manifest=m, origin=pb.PUT_ORIGIN_REPLICA, sender_host="test"), timeout=5)
    corrupt = bytearray(data)
    corrupt[300_000] ^= 0x01
    with socket.create_connection((host, ticket.data_port), timeout=5) as s:
        s.sendall(ticket.ticket + bytes(corrupt))
        import time

        error = datachannel.read_status(s, time.monotonic() + 10)
    assert error is not None and error.startswith("DATA_LOSS") and "chunk 1" in error
    assert not any(i.manifest.key.step == 11 for i in stub.List(pb.ListRequest(job_id=JOB), timeout=5).shards)
    # The same ticket cannot be used twice.
    with socket.create_connection((host, ticket.data_port), timeout=5) as s:
        try:
            s.sendall(ticket.ticket + data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert closed_by_peer(s)


def test_traversal_names_are_refused_at_every_rpc(stub: pb_grpc.StoreStub) -> None:
    """A job id, timeline or host id that would leave its directory is INVALID_ARGUMENT wherever it enters."""
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    for job, timeline in (("../../etc", ""), ("a/b", ""), ("..", ""), (JOB, "../t"), (JOB, "a/b")):
        k = pb.ShardKey(job_id=job, step=1, rank=0, timeline=timeline)
        m = pb.Manifest(key=k, world_size=1, nbytes=1, chunk_size=1, chunk_checksums=[0], owner_host="h1")
        put_header = pb.PutHeader(manifest=m, origin=pb.PUT_ORIGIN_REPLICA, sender_host="h1")
        calls = [
            lambda k=k: stub.Allocate(pb.AllocateRequest(key=k, world_size=1, nbytes=10), timeout=5),
            lambda h=put_header: stub.Put(iter([pb.PutRequest(header=h), pb.PutRequest(chunk=b"x")]), timeout=5),
            lambda h=put_header: stub.PrepareReceive(h, timeout=5),
            lambda k=k: stub.Fetch(pb.FetchRequest(key=k), timeout=5),
            lambda k=k: list(stub.Get(pb.GetRequest(key=k), timeout=5)),
            lambda k=k: stub.Open(pb.OpenRequest(key=k), timeout=5),
            lambda k=k: stub.PrepareSend(pb.GetRequest(key=k), timeout=5),
            lambda k=k: stub.WaitCommitted(pb.WaitCommittedRequest(key=k, timeout_seconds=0), timeout=5),
        ]
        if not timeline:
            calls += [
                lambda job=job: stub.List(pb.ListRequest(job_id=job), timeout=5),
                lambda job=job: stub.Delete(pb.DeleteRequest(job_id=job, step=-1, rank=-1), timeout=5),
                lambda job=job: stub.LatestStep(pb.LatestStepRequest(job_id=job), timeout=5),
                lambda job=job: stub.Expect(pb.ExpectRequest(job_id=job, rank=0, nbytes=1 << 20), timeout=5),
            ]
        for call in calls:
            assert code_of(call) == invalid
    for nbytes in (0, 1 << 50):  # a peer's Expect names a shard size the store could hold
        assert code_of(lambda n=nbytes: stub.Expect(pb.ExpectRequest(job_id=JOB, rank=0, nbytes=n), timeout=5)) == invalid
    # The owner and sender a copy between stores names are host ids.
    k = key(step=12)
    for owner, sender in (("../h1", "h1"), ("h1", "../h1"), ("", "h1")):
        m = pb.Manifest(key=k, world_size=1, nbytes=1, chunk_size=1, chunk_checksums=[0], owner_host=owner)
        header = pb.PutHeader(manifest=m, origin=pb.PUT_ORIGIN_REPAIR, sender_host=sender)
        assert code_of(lambda h=header: stub.PrepareReceive(h, timeout=5)) == invalid


def test_absurd_manifests_are_refused_before_they_cost_memory(stub: pb_grpc.StoreStub) -> None:
    from memstore.v1.integrity import MAX_CHUNKS_PER_SHARD

    k = key(step=13)
    # Two million checksums (16 MB, within gRPC's message limit): refused as a whole, with the limit named.
    m = pb.Manifest(key=k, world_size=1, nbytes=2_000_000, chunk_size=1, owner_host="h1")
    m.chunk_checksums.extend([0] * 2_000_000)
    with pytest.raises(grpc.RpcError) as err:
        stub.PrepareReceive(pb.PutHeader(manifest=m, origin=pb.PUT_ORIGIN_REPLICA, sender_host="h1"), timeout=20)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and str(MAX_CHUNKS_PER_SHARD) in (err.value.details() or "")
    # A world of 2**31 - 1 ranks, and a shard far beyond the store's capacity.
    with pytest.raises(grpc.RpcError) as err:
        stub.Allocate(pb.AllocateRequest(key=k, world_size=2**31 - 1, nbytes=10), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "MAX_WORLD_SIZE" in (err.value.details() or "")
    big = pb.Manifest(key=k, world_size=1, nbytes=1 << 40, chunk_size=MAX_CHUNK_BYTES, owner_host="h1")  # 1 TiB
    big.chunk_checksums.extend([0] * ((1 << 40) // MAX_CHUNK_BYTES))
    with pytest.raises(grpc.RpcError) as err:
        stub.PrepareReceive(pb.PutHeader(manifest=big, origin=pb.PUT_ORIGIN_REPLICA, sender_host="h1"), timeout=20)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--capacity" in (err.value.details() or "")


def test_capture_rings_wrong_calls_are_refused_and_counts_stay_in_range(cluster: LocalCluster, stub: pb_grpc.StoreStub) -> None:
    """Ahead leases, ring growth and the capture counts a Commit reports: each wrong value is refused naming it, and
    Health stays answerable (the fuzzer once made it fail by reporting registrations beyond uint32)."""
    other = "bad-input-ring"

    def allocate(**extra: object) -> pb.AllocateResponse:
        return stub.Allocate(pb.AllocateRequest(key=key(other, 1), world_size=2, nbytes=4096, **extra), timeout=10)  # type: ignore[arg-type]

    def refused(fn) -> str:  # type: ignore[no-untyped-def]
        with pytest.raises(grpc.RpcError) as err:
            fn()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        return str(err.value.details())

    assert "grow needs ahead" in refused(lambda: allocate(grow=True))
    ahead = allocate(ahead=True)
    assert "needs the shard's key" in refused(lambda: stub.Commit(pb.CommitRequest(lease_id=ahead.lease_id), timeout=10))
    elsewhere = pb.CommitRequest(lease_id=ahead.lease_id, key=key(other, 1, rank=1))
    assert "ahead lease is rank 0" in refused(lambda: stub.Commit(elsewhere, timeout=10))
    too_big = pb.CommitRequest(lease_id=ahead.lease_id, key=key(other, 1), nbytes=1 << 40)
    assert "segment holds" in refused(lambda: stub.Commit(too_big, timeout=10))
    absurd = pb.CommitRequest(lease_id=ahead.lease_id, key=key(other, 1), capture=pb.CaptureStats(registrations=7058651275))
    assert "capture.registrations 7058651275 is out of range" in refused(lambda: stub.Commit(absurd, timeout=10))
    chatty = pb.CommitRequest(lease_id=ahead.lease_id, key=key(other, 1), capture=pb.CaptureStats(fallbacks=1, fallback_cause="x" * 5000))
    assert "fallback_cause" in refused(lambda: stub.Commit(chatty, timeout=10))
    negative = pb.CommitRequest(lease_id=ahead.lease_id, key=key(other, 1), capture_seconds=-1.0)
    assert "capture_seconds" in refused(lambda: stub.Commit(negative, timeout=10))
    # The lease survived every refusal: a right commit takes it, and Health reports the (in-range) counts.
    good = pb.CommitRequest(lease_id=ahead.lease_id, key=key(other, 1), capture=pb.CaptureStats(registrations=3))
    assert stub.Commit(good, timeout=10).key.step == 1
    assert stub.Health(pb.HealthRequest(), timeout=10).capture.registrations >= 3
    stub.Delete(pb.DeleteRequest(job_id=other, step=-1, rank=-1), timeout=10)
