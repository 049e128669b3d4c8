"""Store RPCs the bench makes, each on a fresh channel (a replaced store comes back on the same address)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from memstore.bench.scenario_results import HeldBytes
from memstore.bench.units import round_page


def _rpc(address: str, call: Callable[[Any, float], Any], timeout: float = 5.0) -> Any:
    import grpc

    from memstore.v1.channel import store_stub

    ch, stub = store_stub(address)  # the environment's credentials (MEMSTORE_AUTH_TOKEN, MEMSTORE_TLS_*), as the bench's clients
    with ch:
        try:
            return call(stub, timeout)
        except grpc.RpcError:
            return None


def hello(address: str, timeout: float = 10.0) -> Any:
    from memstore.v1 import store_pb2 as pb

    return _rpc(address, lambda s, t: s.Hello(pb.HelloRequest(), timeout=t), timeout)


def health(address: str, timeout: float = 5.0) -> Any:
    from memstore.v1 import store_pb2 as pb

    return _rpc(address, lambda s, t: s.Health(pb.HealthRequest(), timeout=t), timeout)


def listing(address: str, job: str = "", timeout: float = 5.0) -> Any:
    from memstore.v1 import store_pb2 as pb

    return _rpc(address, lambda s, t: s.List(pb.ListRequest(job_id=job), timeout=t), timeout)


def delete(address: str, job: str, step: int = -1) -> int:
    from memstore.v1 import store_pb2 as pb

    resp = _rpc(address, lambda s, t: s.Delete(pb.DeleteRequest(job_id=job, step=step, rank=-1 if step == -1 else 0), timeout=t), 30.0)
    return int(resp.deleted) if resp is not None else 0


def fetch(address: str, job: str, step: int, timeout: float) -> tuple[float, str]:
    """Time the store's Fetch RPC alone (it returns once the store holds a verified copy): its pull from a peer."""
    import grpc

    from memstore.v1 import store_pb2 as pb
    from memstore.v1.channel import store_stub

    ch, stub = store_stub(address)
    with ch:
        grpc.channel_ready_future(ch).result(timeout=30)
        timeline = stub.LatestStep(pb.LatestStepRequest(job_id=job, step=step), timeout=timeout).timeline
        t0 = time.perf_counter()
        resp = stub.Fetch(pb.FetchRequest(key=pb.ShardKey(job_id=job, step=step, rank=0, timeline=timeline)), timeout=timeout)
        return time.perf_counter() - t0, resp.source_host


def job_steps(address: str, job: str) -> set[int] | None:
    resp = listing(address, job)
    return None if resp is None else {int(s.manifest.key.step) for s in resp.shards}


def settled(addresses: list[str], job: str, keep: int) -> bool:
    """Retention has dropped the oldest steps of ``job`` everywhere (so the next save reuses a pooled segment)."""
    for a in addresses:
        steps = job_steps(a, job)
        if steps is None or len(steps) > keep:
            return False
    return True


def held(address: str) -> HeldBytes | None:
    """Shard bytes a store holds (sum of nbytes over its List, every job) and its accounted bytes (Health)."""
    shards = listing(address)
    status = health(address)
    if shards is None or status is None:
        return None
    held_bytes = sum(int(s.manifest.nbytes) for s in shards.shards)
    held_pages = sum(round_page(max(1, int(s.manifest.nbytes))) for s in shards.shards)
    used = int(status.used_bytes)
    return HeldBytes(
        shards=len(shards.shards),
        shard_bytes_held=held_bytes,
        used_bytes=used,
        pooled_bytes_estimate=max(0, used - held_pages),
        capacity_bytes=int(status.capacity_bytes),
    )
