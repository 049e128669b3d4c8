"""Limits through real stores: the per-job quota (--job-quota) and transfers per sender (--max-streams-per-peer)."""

from __future__ import annotations

import grpc
import pytest

from memstore.testing import wait_for
from memstore.v1 import store_pb2 as pb
from memstore.v1.channel import store_stub
from trainer_client import CheckpointClient
from trainer_client.errors import CapacityExceededError

pytestmark = pytest.mark.integration
MiB = 1 << 20
QUOTA = 8 * MiB


def state(step: int, mib: int = 3) -> dict[str, object]:
    import torch

    return {"w": torch.full((mib * MiB // 4,), float(step)), "step": step}


def steps_on(stub, job: str) -> list[int]:  # type: ignore[no-untyped-def]
    return sorted({s.manifest.key.step for s in stub.List(pb.ListRequest(job_id=job), timeout=5).shards})


def test_job_quota_drops_older_steps_then_refuses_with_the_numbers(make_inprocess_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="64MiB", keep=4, extra_args=["--job-quota", "8MiB"])
    client = CheckpointClient("quota", 0, 1, store=cluster.address("h0"))
    skipper = CheckpointClient("quota", 0, 1, store=cluster.address("h0"), on_capacity="skip")
    ch0, stub0 = store_stub(cluster.address("h0"))
    ch1, stub1 = store_stub(cluster.address("h1"))
    try:
        for step in (1, 2, 3):  # 3 MiB each: the third fits only once step 1 goes, on the owner and on its peer
            client.save(step, state(step)).wait(timeout=30)
        assert client.latest_step() == 3
        assert steps_on(stub0, "quota") == [2, 3]
        wait_for(lambda: steps_on(stub1, "quota") == [2, 3], timeout=10, what="the replica store to keep the quota too")
        other = CheckpointClient("other", 0, 1, store=cluster.address("h0"))  # the quota is per job
        other.save(1, state(1, mib=6)).wait(timeout=30)
        other.close()
        with pytest.raises(CapacityExceededError) as err:
            client.save(4, state(4, mib=9))
        assert err.value.capacity == QUOTA and err.value.needed > 9 * MiB and 6 * MiB < err.value.used <= QUOTA
        assert "--job-quota" in str(err.value) and "'quota'" in str(err.value)
        handle = skipper.save(4, state(4, mib=9))
        assert handle.skipped and "--job-quota" in handle.skipped_reason
        with pytest.raises(grpc.RpcError) as rpc:
            stub0.Allocate(pb.AllocateRequest(key=pb.ShardKey(job_id="quota", step=5, rank=0), world_size=1, nbytes=9 * MiB), timeout=5)
        assert rpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        meta = dict(rpc.value.trailing_metadata())
        assert meta["memstore-limit"] == "job-quota" and meta["memstore-job-id"] == "quota"
        assert int(meta["memstore-capacity-bytes"]) == QUOTA and int(meta["memstore-needed-bytes"]) >= 9 * MiB
        assert steps_on(stub0, "quota") == [2, 3] and client.latest_step() == 3  # the refusals cost nothing
    finally:
        client.close()
        skipper.close()
        ch0.close()
        ch1.close()


def test_transfers_per_sender_are_limited(make_inprocess_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_inprocess_cluster(hosts=1, replicas=1, capacity="64MiB", extra_args=["--max-streams-per-peer", "2"])
    channel, stub = store_stub(cluster.address("h0"))

    def prepare(rank: int, sender: str, origin: int = pb.PUT_ORIGIN_REPLICA) -> pb.DataTicket:
        m = pb.Manifest(
            key=pb.ShardKey(job_id="streams", step=1, rank=rank), world_size=8, nbytes=1, chunk_size=1, chunk_checksums=[0],
            owner_host=sender if origin != pb.PUT_ORIGIN_CLIENT else "",
        )  # fmt: skip
        return stub.PrepareReceive(pb.PutHeader(manifest=m, origin=origin, sender_host=sender), timeout=5)

    try:
        prepare(0, "p1")
        prepare(1, "p1")
        with pytest.raises(grpc.RpcError) as err:
            prepare(2, "p1")
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-streams-per-peer 2" in (err.value.details() or "") and "'p1'" in (err.value.details() or "")
        meta = dict(err.value.trailing_metadata())
        assert (meta["memstore-limit"], meta["memstore-active-streams"], meta["memstore-max-streams"]) == ("max-streams-per-peer", "2", "2")
        prepare(2, "p2")  # another sender has its own
        prepare(3, "client-rank-3", pb.PUT_ORIGIN_CLIENT)
        prepare(4, "client-rank-4", pb.PUT_ORIGIN_CLIENT)
        with pytest.raises(grpc.RpcError) as err:
            prepare(5, "client-rank-5", pb.PUT_ORIGIN_CLIENT)  # a job's clients count together
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "job 'streams'" in (err.value.details() or "")
        assert cluster.health("h0").serving  # type: ignore[union-attr]
    finally:
        channel.close()
