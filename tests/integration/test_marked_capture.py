"""A large save pushed while it is copied (CommitRequest.captured_bytes) against real in-process stores: the client
marks its progress, the owner pushes what is final, the replica is exact; a capture whose client stops is dropped
everywhere, and its last mark never makes a copy complete."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
import torch

from memstore.server.engine import progress
from memstore.testing import wait_for
from memstore.v1 import store_pb2 as pb
from memstore.v1.channel import store_stub
from tests.harness.inprocess import InProcessCluster
from tests.harness.shards import assert_same
from trainer_client import CheckpointClient, Connection, knobs
from trainer_client.errors import InvalidArgumentError
from trainer_client.serialization import encoder
from trainer_client.transport import shared_memory_path

pytestmark = pytest.mark.integration
MiB = 1 << 20


def state() -> dict[str, Any]:
    torch.manual_seed(3)
    return {"layers": [torch.randn(64 * 1024) for _ in range(24)], "half": [torch.randn(300, 7).to(torch.bfloat16) for _ in range(50)]}


def record_marks(cluster: InProcessCluster, host: str) -> list[int | None]:
    store = cluster.servers[host].store
    seen: list[int | None] = []
    commit = store.commit

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("captured_bytes"))
        return commit(*args, **kwargs)

    store.commit = recording  # type: ignore[method-assign]
    return seen


def test_a_marked_save_is_pushed_as_it_is_copied_and_the_replica_is_exact(make_inprocess_cluster, monkeypatch) -> None:
    monkeypatch.setenv("MEMSTORE_MARKED_CAPTURES", "on")  # whatever this machine's cores
    monkeypatch.setattr(shared_memory_path, "MARKED_FROM", 1 * MiB)  # a small state takes the large-state path
    monkeypatch.setattr(encoder, "MARK_BYTES", 1 * MiB)
    cluster: InProcessCluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="256MiB")
    marks = record_marks(cluster, "h0")
    saved = state()
    with CheckpointClient("marked", 0, 1, connection=Connection(cluster.address("h0"))) as c:
        assert c.save(1, saved).wait(timeout=30).copies == 2
    assert len(marks) >= 4 and marks[-1] is None, marks  # marks, then the Commit that ends the capture
    assert marks[:-1] == sorted(marks[:-1]) and marks[0] > 0  # type: ignore[type-var]
    with CheckpointClient("marked", 0, 1, connection=Connection(cluster.address("h1"))) as c:
        assert_same(c.load(1), saved)  # the replica the push made while the client copied
        assert c.stats().last_load_source == "h1"


def test_a_capture_whose_client_stops_is_dropped_and_no_peer_keeps_a_copy(make_inprocess_cluster, monkeypatch) -> None:
    monkeypatch.setattr(progress, "CAPTURE_STALL_SECONDS", 0.5)
    cluster: InProcessCluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="256MiB")
    key = pb.ShardKey(job_id="stopped", step=1, rank=0)
    channel, stub = store_stub(cluster.address("h0"))
    try:
        lease = stub.Allocate(pb.AllocateRequest(key=key, world_size=1, nbytes=8 * MiB), timeout=10)
        stub.Commit(pb.CommitRequest(lease_id=lease.lease_id, format_version=1, captured_bytes=2 * MiB), timeout=10)
        # The client dies here: no more marks, no final Commit. The owner gives the capture up and drops it.
        wait_for(lambda: not list(stub.List(pb.ListRequest(job_id="stopped"), timeout=10).shards), timeout=30, what="the capture dropped")
        with pytest.raises(grpc.RpcError) as err:
            stub.Commit(pb.CommitRequest(lease_id=lease.lease_id, format_version=1), timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        channel.close()
    # The owner drops the shard only once every push of it has ended; a peer registers a copy only with its last
    # bytes, which no push sent: nothing to wait for.
    peer_channel, peer = store_stub(cluster.address("h1"))
    try:
        assert not list(peer.List(pb.ListRequest(job_id="stopped"), timeout=10).shards)
    finally:
        peer_channel.close()


def test_marked_captures_follow_the_setting_and_refuse_a_bad_one(monkeypatch) -> None:
    monkeypatch.setattr(knobs.os, "cpu_count", lambda: 2)
    monkeypatch.delenv("MEMSTORE_MARKED_CAPTURES", raising=False)
    assert not knobs.marked_captures()  # auto on 2 cores: the push would take the copy's cores
    monkeypatch.setattr(knobs.os, "cpu_count", lambda: 16)
    assert knobs.marked_captures()
    monkeypatch.setenv("MEMSTORE_MARKED_CAPTURES", "off")
    assert not knobs.marked_captures()
    monkeypatch.setenv("MEMSTORE_MARKED_CAPTURES", "sometimes")
    with pytest.raises(InvalidArgumentError, match="MEMSTORE_MARKED_CAPTURES"):
        knobs.marked_captures()
