"""Hardware baselines in the same run on the same bytes: memcpy (torch ``copy_``), raw TCP on loopback and
gRPC-Python streaming (the sender is a child process, :mod:`memstore.bench.senders`); and
:func:`measure_floors`, every baseline of one state size plus the diagnosis cost model."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from memstore.bench.costmodel import replication_cost_model, save_path_model
from memstore.bench.floors_dcp import floor_dcp
from memstore.bench.floors_disk import FLOOR_TIMEOUT, floor_disk
from memstore.bench.results import CostModel, Floors, GrpcFloor, MemcpyFloor, Summary, TcpFloor
from memstore.bench.senders import SINK_METHOD
from memstore.bench.state import copy_all, nbytes_of, prefaulted, shared_mapping
from memstore.bench.units import CHUNK, child_env

if TYPE_CHECKING:
    import torch

    from memstore.bench.options import BenchConfig
    from memstore.bench.sysinfo import Monitor

MEMCPY_REPS = 5
TCP_REPS = 3
GRPC_REPS = 3
FLOOR_STEPS = 8  # progress steps of measure_floors
SENDERS = [sys.executable, "-m", "memstore.bench.senders"]


def _timed_copies(dst: torch.Tensor, tensors: list[torch.Tensor], reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        copy_all(dst, tensors)
        times.append(time.perf_counter() - t0)
    return times


def _fresh_copies(tensors: list[torch.Tensor], nbytes: int) -> list[float]:
    import torch

    fresh_times = []
    for _ in range(2):
        t0 = time.perf_counter()
        dst = torch.empty(nbytes, dtype=torch.uint8)
        copy_all(dst, tensors)
        fresh_times.append(time.perf_counter() - t0)
        del dst
    return fresh_times


def _memmoves(base: int, tensors: list[torch.Tensor], reps: int) -> list[float]:
    mm_times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        off = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            ctypes.memmove(base + off, t.data_ptr(), n)
            off += n
        mm_times.append(time.perf_counter() - t0)
    return mm_times


def floor_memcpy(tensors: list[torch.Tensor], reps: int = MEMCPY_REPS) -> MemcpyFloor:
    """torch ``copy_`` (multi-threaded) of every state tensor into a pre-faulted buffer; memmove single-thread;
    the same copy into a /dev/shm mapping and into fresh (never touched) memory, for reference."""
    import torch

    nbytes = nbytes_of(tensors)
    fresh = _fresh_copies(tensors, nbytes)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.fill_(1)  # touch every page once: pre-faulted, like memstore's pooled segments
    times = _timed_copies(dst, tensors, reps)
    mm_times = _memmoves(dst.data_ptr(), tensors, max(1, reps // 2))
    del dst
    gc.collect()
    return MemcpyFloor(
        bytes=nbytes,
        torch_threads=torch.get_num_threads(),
        torch_copy_fresh_seconds=Summary.of(fresh),
        torch_copy_seconds=Summary.of(times),
        memmove_single_thread_seconds=Summary.of(mm_times),
        shm_torch_copy_seconds=_shm_copy(tensors, nbytes, reps),
    )


def _shm_copy(tensors: list[torch.Tensor], nbytes: int, reps: int) -> Summary | None:
    """The same copy into a pre-faulted MAP_SHARED file mapping on /dev/shm (what a save writes into)."""
    import torch

    if not os.path.isdir("/dev/shm"):
        return None
    mm = shared_mapping(nbytes, "/dev/shm")
    try:
        dst = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
        dst.fill_(1)
        times = _timed_copies(dst, tensors, reps)
        del dst
    finally:
        gc.collect()
        with contextlib.suppress(BufferError):
            mm.close()
    return Summary.of(times)


def _receive(conn: socket.socket, view: memoryview, nbytes: int, reps: int) -> tuple[list[float], int]:
    """recv_into ``view`` ``reps`` times ``nbytes``: each repetition's seconds, and how many bytes the first recv got."""
    times: list[float] = []
    first_bytes = 0
    t_prev = 0.0
    for rep in range(reps):
        got = 0
        while got < nbytes:
            n = conn.recv_into(view[got:], nbytes - got)
            if n == 0:
                raise RuntimeError(f"TCP sender closed after {got} of {nbytes} bytes (rep {rep})")
            if rep == 0 and got == 0:
                t_prev = time.perf_counter()  # first byte arrived
                first_bytes = n
            got += n
        now = time.perf_counter()
        times.append(now - t_prev)
        t_prev = now
    return times, first_bytes


def floor_tcp(nbytes: int, recv_buf: bytearray, reps: int = TCP_REPS, timeout: float = FLOOR_TIMEOUT) -> TcpFloor:
    """A child Python process sends ``nbytes`` ``reps`` times with sendall of 4 MiB memoryview slices; this
    process receives with recv_into a pre-faulted buffer. Each repetition is timed from its first byte (rep 0)
    or the previous repetition's last byte to its last byte."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(timeout)
    port = listener.getsockname()[1]
    view = memoryview(recv_buf)[:nbytes]
    child = subprocess.Popen(
        [*SENDERS, "tcp", str(port), str(nbytes), str(reps), str(CHUNK)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=child_env(),
    )
    try:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(timeout)
            rcvbuf = conn.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
            times, first_bytes = _receive(conn, view, nbytes, reps)
            conn.sendall(b"k")
        child.wait(timeout=timeout)
        err = child.stderr.read().decode(errors="replace") if child.stderr else ""
    finally:
        view.release()
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
        if child.stderr:
            child.stderr.close()
        listener.close()
    if child.returncode != 0:
        raise RuntimeError(f"TCP sender failed with {child.returncode}: {err[-2000:]}")
    # Rep 0 is timed from its first recv's return, so it misses those first bytes.
    throughputs = [(nbytes - (first_bytes if i == 0 else 0)) / t for i, t in enumerate(times)]
    return TcpFloor(
        bytes=nbytes,
        reps=reps,
        send_slice_bytes=CHUNK,
        receiver_so_rcvbuf=rcvbuf,
        seconds=Summary.of(times),
        bytes_per_second=Summary.of(throughputs),
    )


def _sink_handler(view: memoryview, mode: str, times: list[float], errors: list[str]) -> Callable[..., bytes]:
    """The receiving end of a client stream: copies each chunk into ``view``, times first message to last."""

    def handler(request_iterator: Iterator[Any], context: Any) -> bytes:
        t0 = 0.0
        got = 0
        try:
            for msg in request_iterator:
                data = msg if mode == "bytes" else msg.chunk
                if got == 0:
                    t0 = time.perf_counter()
                view[got : got + len(data)] = data
                got += len(data)
            times.append(time.perf_counter() - t0)
        except Exception as exc:
            errors.append(repr(exc))
        return b""

    return handler


def floor_grpc(nbytes: int, recv_buf: bytearray, mode: str, reps: int = GRPC_REPS, timeout: float = FLOOR_TIMEOUT) -> GrpcFloor:
    """gRPC-Python client streaming of ``nbytes`` in 4 MiB messages from a child process to a server in this
    process, with memstore's channel/server options. ``mode`` "bytes": raw bytes messages (no protobuf; one
    ``bytes()`` copy per chunk, the least gRPC-Python allows); "protobuf": ``PutRequest(chunk=...)`` as
    memstore's replication sends. The receiver copies each chunk into a pre-faulted buffer (no checksum).
    Timed on the receiver from the first message to the last."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from memstore.v1 import store_pb2 as pb
    from memstore.v1.channel import SERVER_OPTIONS

    view = memoryview(recv_buf)[:nbytes]
    times: list[float] = []
    errors: list[str] = []
    deserializer = None if mode == "bytes" else pb.PutRequest.FromString
    handler = _sink_handler(view, mode, times, errors)
    rpc = grpc.stream_unary_rpc_method_handler(handler, request_deserializer=deserializer, response_serializer=None)
    server = grpc.server(ThreadPoolExecutor(max_workers=4), options=SERVER_OPTIONS)
    service, _, method = SINK_METHOD.strip("/").partition("/")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {method: rpc}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        proc = subprocess.run(
            [*SENDERS, "grpc", str(port), str(nbytes), str(reps), mode, str(CHUNK)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=timeout,
            env=child_env(),
            check=False,
        )
    finally:
        server.stop(1).wait(5)
        view.release()
    if proc.returncode != 0 or errors or len(times) != reps:
        raise RuntimeError(f"gRPC floor ({mode}) failed: rc={proc.returncode} {errors} {proc.stderr.decode(errors='replace')[-2000:]}")
    return GrpcFloor(
        mode=mode,
        bytes=nbytes,
        reps=reps,
        message_bytes=CHUNK,
        seconds=Summary.of(times),
        bytes_per_second=Summary.of([nbytes / t for t in times]),
    )


def measure_floors(
    state: Any, tensors: list[torch.Tensor], shard_bytes: int, state_bytes: int, config: BenchConfig, reps: int,
    step_done: Callable[[str], None], monitor: Monitor, label: str,
) -> tuple[Floors, CostModel]:  # fmt: skip
    """The baselines of one state size, and the diagnosis cost model."""
    monitor.phase = f"{label}: floor memcpy"
    memcpy = floor_memcpy(tensors)
    gc.collect()
    step_done(f"{label}: baseline raw TCP on loopback")
    monitor.phase = f"{label}: floor tcp"
    recv_buf = prefaulted(shard_bytes)
    tcp = floor_tcp(shard_bytes, recv_buf)
    step_done(f"{label}: diagnosis gRPC streaming, raw bytes messages")
    monitor.phase = f"{label}: floor grpc"
    grpc_bytes = floor_grpc(shard_bytes, recv_buf, "bytes")
    step_done(f"{label}: diagnosis gRPC streaming, PutRequest messages")
    grpc_pb = floor_grpc(shard_bytes, recv_buf, "protobuf")
    del recv_buf
    gc.collect()
    step_done(f"{label}: baseline torch.save + fsync / torch.load")
    monitor.phase = f"{label}: floor disk"
    disk = floor_disk(state, config.disk_dir, reps)
    gc.collect()
    step_done(f"{label}: baseline DCP async_save")
    monitor.phase = f"{label}: floor dcp"
    dcp = floor_dcp(state, config.disk_dir, reps)
    gc.collect()
    step_done(f"{label}: diagnosis cost model of the save and replication paths")
    monitor.phase = f"{label}: cost model"
    cost = replication_cost_model(tensors, state_bytes)
    cost.save_path = save_path_model(state)
    gc.collect()
    step_done(f"{label}: baselines done")
    floors = Floors(memcpy=memcpy, tcp=tcp, grpc_bytes=grpc_bytes, grpc_protobuf=grpc_pb, disk=disk, dcp=dcp)
    return floors, cost
