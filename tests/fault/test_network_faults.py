"""Network faults between group peers through a TCP fault proxy: partition, slow peer, bit flips on the wire."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from memstore.testing import LocalCluster, wait_for
from tests.fault.test_protocol_faults import _has
from tests.states import assert_same, rank_state
from tools.faultproxy import FaultProxy
from trainer_client import CheckpointClient
from trainer_client.errors import ReplicationError

pytestmark = pytest.mark.fault
JOB = "faults"


@pytest.fixture
def proxied(make_cluster) -> Iterator[tuple[LocalCluster, FaultProxy, FaultProxy]]:  # type: ignore[no-untyped-def]
    """h0 and h1 (one group, R=2) reach each other only through a proxy each way; bulk bytes over gRPC."""
    cluster: LocalCluster = make_cluster(hosts=2, replicas=2, capacity="256MiB", extra_args=["--data-plane", "grpc"])
    to_h1 = FaultProxy(tuple_of(cluster.address("h1"))).start()
    to_h0 = FaultProxy(tuple_of(cluster.address("h0"))).start()
    cluster.route("h0", "h1", to_h1.address)
    cluster.route("h1", "h0", to_h0.address)
    cluster.restart("h0")
    cluster.restart("h1")
    try:
        yield cluster, to_h1, to_h0
    finally:
        to_h1.close()
        to_h0.close()


def tuple_of(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def test_partition_between_group_peers(proxied) -> None:  # type: ignore[no-untyped-def]
    cluster, to_h1, to_h0 = proxied
    with CheckpointClient(JOB, 0, 1, store=cluster.address("h0")) as c:
        c.save(1, rank_state(0, 1)).wait(timeout=30)
        to_h1.set("cut")
        to_h0.set("cut")
        t0 = time.monotonic()
        handle = c.save(2, rank_state(0, 2))
        assert time.monotonic() - t0 < 5  # the trainer's save does not wait on the partitioned peer
        with pytest.raises(ReplicationError, match=r"1 of 2 copies.*h1"):
            handle.wait(timeout=60)  # replication reports the lag, naming the peer
        assert c.latest_step() == 2  # restorable from the owner's copy
        to_h1.set("pass")
        to_h0.set("pass")
    wait_for(lambda: _has(cluster, "h1", 2, rank=0), timeout=60, what="repair after the partition heals")
    cluster.kill("h0")
    with CheckpointClient(JOB, 0, 1, store=cluster.address("h1")) as c:
        assert_same(c.load(2), rank_state(0, 2))


def test_slow_peer_does_not_slow_saves(proxied) -> None:  # type: ignore[no-untyped-def]
    cluster, to_h1, _ = proxied
    to_h1.set("slow", rate=4 << 20)  # 4 MiB/s
    state = rank_state(0, 1, scale=512)  # ~8 MiB: ~2 s on the slow link
    with CheckpointClient(JOB, 0, 1, store=cluster.address("h0")) as c:
        t0 = time.monotonic()
        handle = c.save(1, state)
        stall = time.monotonic() - t0
        assert not handle.done()  # still replicating: the lag shows
        info = handle.wait(timeout=120)
        committed = time.monotonic() - t0
    assert info.copies == 2
    assert stall < committed / 3  # the save returned long before the slow peer had its copy


def test_bit_flips_on_the_wire_are_caught_and_the_good_copy_used(proxied) -> None:  # type: ignore[no-untyped-def]
    cluster, to_h1, _ = proxied
    to_h1.set("corrupt", every=300_000)
    with CheckpointClient(JOB, 0, 1, store=cluster.address("h0")) as c:
        handle = c.save(1, rank_state(0, 1, scale=512))
        with pytest.raises(ReplicationError):
            handle.wait(timeout=60)  # the receiver's checksums refused every corrupted push
        assert to_h1.corrupted > 0
        assert not _has(cluster, "h1", 1, rank=0)  # nothing corrupt was stored
        assert_same(c.load(1), rank_state(0, 1, scale=512))  # the owner's verified copy is used
    to_h1.set("pass")
    wait_for(lambda: _has(cluster, "h1", 1, rank=0), timeout=60, what="repair over the healed link")
