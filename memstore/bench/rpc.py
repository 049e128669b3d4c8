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
    pooled = _field(status, "pooled_bytes")  # stores that report their pool (free segments and the --prefault reserve)
    return HeldBytes(
        shards=len(shards.shards),
        shard_bytes_held=held_bytes,
        used_bytes=used,
        pooled_bytes_estimate=pooled if pooled is not None else max(0, used - held_pages),
        capacity_bytes=int(status.capacity_bytes),
        pooled_bytes=pooled,
        reserve_bytes=_field(status, "reserve_bytes"),
    )


def _field(message: Any, name: str) -> int | None:
    """An integer field of a response, None where this checkout's protocol has no such field."""
    return int(getattr(message, name)) if name in type(message).DESCRIPTOR.fields_by_name else None


def reserve_filling(address: str) -> bool:
    """Whether the store is still faulting in its --prefault reserve (False where it does not say)."""
    status = health(address)
    return bool(status is not None and "reserve_filling" in type(status).DESCRIPTOR.fields_by_name and status.reserve_filling)


def latest_step(address: str, job: str, timeout: float = 10.0) -> int | None:
    """The newest restorable step of ``job`` as the store at ``address`` sees it (RAM copies and durable storage)."""
    from memstore.v1 import store_pb2 as pb

    resp = _rpc(address, lambda s, t: s.LatestStep(pb.LatestStepRequest(job_id=job), timeout=t), timeout)
    return int(resp.step) if resp is not None and resp.found else None


def spilled_step(address: str, job: str) -> int | None:
    """The newest step of ``job`` the store at ``address`` has spilled to durable storage (its status), or None."""
    status = health(address)
    if status is None:
        return None
    steps = [int(j.last_spilled_step) for j in status.spill if j.job_id == job and int(j.last_spilled_step) >= 0]
    return max(steps, default=None)
