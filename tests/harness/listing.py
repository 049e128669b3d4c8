"""What a store holds, read over its gRPC API (``List``), for tests that wait on retention."""

from __future__ import annotations

from memstore.testing import LocalCluster
from memstore.v1 import store_pb2 as pb
from memstore.v1.channel import store_stub


def own_steps(cluster: LocalCluster, host: str, job: str, rank: int) -> int:
    """Steps of ``rank`` of ``job`` the store ``host`` holds as their owner (its retention keeps ``--keep`` of them)."""
    channel, stub = store_stub(cluster.address(host))
    try:
        listing = stub.List(pb.ListRequest(job_id=job), timeout=10)
    finally:
        channel.close()
    return sum(1 for s in listing.shards if s.manifest.key.rank == rank and s.manifest.owner_host == host)
