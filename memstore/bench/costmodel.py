"""Diagnosis: an in-process cost model of the save path and of the replication pipeline's per-chunk steps."""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from memstore.bench.results import CostModel, FreshSegment, SavePathModel, Summary
from memstore.bench.state import byte_views, chunks, prefaulted, shared_mapping
from memstore.bench.units import CHUNK

if TYPE_CHECKING:
    import torch

COST_NOTES = (
    "pb_serialize includes bytes_copy_per_chunk and pb_putrequest_build; the owner checksums the whole shard "
    "before it pushes the first chunk, so that part is serial; receiver work overlaps the sender's "
    "on another core when one is free; gRPC framing and the kernel copies are in the gRPC/TCP floors."
)


def _per_chunk_costs(views: list[memoryview]) -> tuple[dict[str, float], int]:
    from memstore.v1 import store_pb2 as pb
    from memstore.v1.integrity import checksum

    out: dict[str, float] = {}

    def timed(name: str, fn: Callable[[memoryview], object]) -> None:
        t0 = time.perf_counter()
        for c in chunks(views):
            fn(c)
        out[name] = time.perf_counter() - t0

    timed("xxh3_checksum", checksum)
    timed("bytes_copy_per_chunk", bytes)
    timed("pb_putrequest_build", lambda c: pb.PutRequest(chunk=bytes(c)))
    timed("pb_serialize", lambda c: pb.PutRequest(chunk=bytes(c)).SerializeToString())
    wire = pb.PutRequest(chunk=bytes(CHUNK)).SerializeToString()
    n_chunks = sum(1 for _ in chunks(views))
    t0 = time.perf_counter()
    for _ in range(n_chunks):
        pb.PutRequest.FromString(wire).chunk  # noqa: B018 - parse + field access is the measured work
    out["pb_parse_and_chunk_access"] = time.perf_counter() - t0
    dest = prefaulted(CHUNK)
    dview = memoryview(dest)
    blob = bytes(CHUNK)
    t0 = time.perf_counter()
    for c in chunks(views):
        dview[: len(c)] = blob[: len(c)]
    out["copy_into_segment"] = time.perf_counter() - t0
    dview.release()
    return out, n_chunks


def replication_cost_model(tensors: list[torch.Tensor], nbytes: int) -> CostModel:
    """Time each CPU step the replication pipeline applies to every byte, on the same bytes, in this process,
    one thread. Sender (owner store): xxh3 over the whole shard before any byte is sent, ``bytes(view[chunk])``
    per chunk (memstore.v1.streams.iter_chunks), ``PutRequest(chunk=...)`` and its serialisation by gRPC.
    Receiver (peer store): protobuf parse and ``msg.chunk``, xxh3 verify, copy into the segment."""
    views = byte_views(tensors)
    out, n_chunks = _per_chunk_costs(views)
    for v in views:
        v.release()
    sender = out["xxh3_checksum"] + out["pb_serialize"]
    receiver = out["pb_parse_and_chunk_access"] + out["xxh3_checksum"] + out["copy_into_segment"]
    return CostModel(
        bytes=nbytes,
        chunk_bytes=CHUNK,
        chunks=n_chunks,
        seconds=out,
        bytes_per_second={k: nbytes / v for k, v in out.items() if v > 0},
        sender_cpu_seconds_estimate=sender,
        receiver_cpu_seconds_estimate=receiver,
        notes=COST_NOTES,
    )


def save_path_model(state: Any, reps: int = 3) -> SavePathModel:
    """The client side of save() without the store: serialization.plan() and ShardLayout.write_into() a
    pre-faulted /dev/shm mapping. save() minus these two is the Allocate/Commit RPCs and the mapping lookup."""
    from trainer_client import serialization

    plan_times = []
    layout = serialization.plan(state)
    for _ in range(reps):
        t0 = time.perf_counter()
        layout = serialization.plan(state)
        plan_times.append(time.perf_counter() - t0)
    nbytes = layout.nbytes
    shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
    mm = shared_mapping(nbytes, shm_dir)
    write_times = []
    try:
        layout.write_into(mm)  # first touch
        for _ in range(reps):
            t0 = time.perf_counter()
            layout.write_into(mm)
            write_times.append(time.perf_counter() - t0)
    finally:
        with contextlib.suppress(BufferError):
            mm.close()
    return SavePathModel(
        bytes=nbytes,
        dir=shm_dir,
        plan_seconds=Summary.of(plan_times),
        write_into_shm_seconds=Summary.of(write_times),
        fresh_segment_seconds=fresh_segment_model(nbytes, shm_dir),
    )


def fresh_segment_model(nbytes: int, directory: str | None, reps: int = 2) -> FreshSegment | None:
    """What a store pays for a segment it cannot take from its pool (memstore.server.segments.SegmentPool._create):
    ftruncate + posix_fallocate (tmpfs zero-fills every page) + mmap(MAP_SHARED | MAP_POPULATE), on the same tmpfs. Cold
    saves pay it, and so does every pull into a store whose pool is empty (a replacement host) or holds no reusable
    segment (segments a zero-copy reader mapped are never recycled)."""
    if directory is None:
        return None
    falloc: list[float] = []
    total: list[float] = []
    for _ in range(reps):
        fd, path = tempfile.mkstemp(prefix="memstore-bench-seg-", dir=directory)
        try:
            t0 = time.perf_counter()
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)
            t1 = time.perf_counter()
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            t2 = time.perf_counter()
            mm.close()
        finally:
            os.close(fd)
            os.unlink(path)
        falloc.append(t1 - t0)
        total.append(t2 - t0)
    return FreshSegment(fallocate_seconds=Summary.of(falloc), seconds=Summary.of(total))
