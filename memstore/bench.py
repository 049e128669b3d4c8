"""``memstore bench``: save stall, replication and restore of memstore against hardware floors.

One run measures, on an embedded :class:`~memstore.local_cluster.LocalCluster` on 127.0.0.1:

* the trainer's stall per ``save()`` (cold first save, then p50/p95 over warm saves),
* the time until the save is committed (R copies) and the replication throughput derived from it,
* restore from local RAM (a new client, i.e. a restarted trainer, on the owner's store),
* restore from peer RAM (the owner's store lacks the shard and pulls it from a group peer),
* restore on a replacement host (owner store SIGKILLed and restarted with empty RAM),

and, in the same run and on the same bytes, the floors they are compared with: a torch ``copy_`` into
pre-faulted memory (plus a single-thread memmove for reference), raw TCP between two Python processes
on loopback, and ``torch.save`` + fsync / ``torch.load`` to local disk. It ends with an in-process cost
model of the replication pipeline (checksum, per-chunk copies, protobuf) to show where the time goes.

This module is imported by ``memstore.cli`` for every command (the parser is built eagerly), so it only
imports the standard library at module level; torch, numpy, grpc and rich are imported where used.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from rich.console import Console

MiB = 1 << 20
GiB = 1 << 30
JOB_ID = "bench"
CHUNK = 4 * MiB  # TCP floor send slice and cost-model chunk (= memstore's default chunk size)
CAPACITY_SLACK = 64 * MiB
STALL_TARGET = 2.0  # save stall <= 2x memcpy
REPLICATION_TARGET = 0.5  # replication throughput >= 0.5x raw TCP
MEMCPY_REPS = 5
TCP_REPS = 3
PHASES = 11


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default=None, help="state bytes on the one benchmarked rank (e.g. 64MiB, 256MiB, 1GiB; default 1GiB)")
    p.add_argument("--hosts", type=int, default=2, help="stores in the local cluster (default 2)")
    p.add_argument("--replicas", type=int, default=2, help="replication factor R (default 2)")
    p.add_argument("--saves", type=int, default=None, help="measured (warm) saves after the warm-up ones (default 5)")
    p.add_argument("--keep", type=int, default=2, help="steps each store keeps (default 2); warm-up is keep+1 saves")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write every raw number, ratio and machine info here")
    p.add_argument("--quick", action="store_true", help="64MiB and 2 saves unless given explicitly (smoke test)")
    p.add_argument("--disk-dir", default=None, help="directory on local disk for the torch.save floor (default: the temp dir)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random state")


@dataclass
class BenchConfig:
    size: int
    hosts: int
    replicas: int
    saves: int
    keep: int
    warmup: int
    json_path: str | None
    disk_dir: str | None
    seed: int
    quick: bool


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    from memstore.core.sizes import parse_size

    size_text = args.size or ("64MiB" if args.quick else "1GiB")
    size = parse_size(size_text)
    saves = args.saves if args.saves is not None else (2 if args.quick else 5)
    if size < MiB:
        raise ValueError(f"--size {size_text} is too small: expected at least 1MiB")
    if saves < 1:
        raise ValueError(f"--saves {saves} is invalid: expected >= 1")
    if args.hosts < 1 or not 1 <= args.replicas <= args.hosts:
        raise ValueError(f"--hosts {args.hosts} / --replicas {args.replicas} are invalid: expected 1 <= replicas <= hosts")
    if args.keep < 1:
        raise ValueError(f"--keep {args.keep} is invalid: expected >= 1")
    return BenchConfig(
        size=size,
        hosts=args.hosts,
        replicas=args.replicas,
        saves=saves,
        keep=args.keep,
        warmup=args.keep + 1,
        json_path=args.json_path,
        disk_dir=args.disk_dir,
        seed=args.seed,
        quick=bool(args.quick),
    )


def run_from_args(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    from rich.console import Console

    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"memstore bench: error: {exc}", file=sys.stderr)
        return 2
    command = shlex.join([sys.executable, *sys.argv])
    console = Console()
    if not console.is_terminal:
        console = Console(width=150)  # logs and pipes: don't squeeze the tables into 80 columns
    result = run(config, command, console)
    result["bench_argv"] = argv
    render(result, console)
    if config.json_path:
        path = Path(config.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")
        console.print(f"raw numbers written to {path}")
    return 0 if result["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="memstore bench", description="Measure memstore's save stall, replication and restore.")
    add_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # `memstore bench -- --size 1GiB`: the CLI hands its REMAINDER over with the separator
        argv = argv[1:]
    args = parser.parse_args(argv)
    return run_from_args(args, argv=argv)


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), without numpy."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _summary(values: list[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "min": min(values),
        "p50": _percentile(values, 50),
        "p95": _percentile(values, 95),
        "max": max(values),
        "values": values,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def _mem_total() -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def machine_info() -> dict[str, Any]:
    import grpc
    import numpy as np
    import torch

    return {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _cpu_model(),
        "ram_bytes": _mem_total(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "numpy": np.__version__,
        "grpcio": grpc.__version__,
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
    }


def make_state(nbytes: int, seed: int) -> dict[str, Any]:
    """A model + Adam-like state of ``nbytes`` float32 bytes in 12 tensors (4 layers x weight/exp_avg/exp_avg_sq)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    layers = 4
    total = nbytes // 4
    base = total // (3 * layers)
    sizes = [base] * (3 * layers)
    sizes[-1] += total - base * 3 * layers
    made = iter([torch.rand(n, generator=gen) for n in sizes])
    model = {f"layers.{i}.weight": next(made) for i in range(layers)}
    optim_state = {i: {"step": torch.tensor(100.0), "exp_avg": next(made), "exp_avg_sq": next(made)} for i in range(layers)}
    return {
        "model": model,
        "optim": {
            "state": optim_state,
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": list(range(layers))}],
        },
        "step": 100,
    }


def state_tensors(state: Any) -> list[torch.Tensor]:
    import torch

    out: list[torch.Tensor] = []

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list | tuple):
            for x in v:
                walk(x)

    walk(state)
    return out


def states_equal(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(states_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(states_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _byte_views(tensors: list[torch.Tensor]) -> list[memoryview]:
    import torch

    return [t.detach().reshape(-1).view(torch.uint8).numpy().data for t in tensors]


def _chunks(views: list[memoryview], chunk: int = CHUNK) -> Iterator[memoryview]:
    for mv in views:
        for off in range(0, len(mv), chunk):
            yield mv[off : off + chunk]


# --------------------------------------------------------------------------------------------------
# floors
# --------------------------------------------------------------------------------------------------


def floor_memcpy(tensors: list[torch.Tensor], reps: int = MEMCPY_REPS) -> dict[str, Any]:
    """torch ``copy_`` (multi-threaded) of every state tensor into a pre-faulted buffer; memmove single-thread."""
    import torch

    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    result: dict[str, Any] = {"bytes": nbytes, "torch_threads": torch.get_num_threads()}

    # Fresh (not yet faulted) destination: what the first save into a new segment / a decode pays.
    fresh_times = []
    for _ in range(2):
        t0 = time.perf_counter()
        dst = torch.empty(nbytes, dtype=torch.uint8)
        _copy_all(dst, tensors)
        fresh_times.append(time.perf_counter() - t0)
        del dst
    result["torch_copy_fresh_seconds"] = _summary(fresh_times)

    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.fill_(1)  # touch every page once: pre-faulted, like memstore's pooled segments
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _copy_all(dst, tensors)
        times.append(time.perf_counter() - t0)
    result["torch_copy_seconds"] = _summary(times)

    result["shm_torch_copy_seconds"] = _shm_copy(tensors, nbytes, reps)

    mm_times = []
    for _ in range(max(1, reps // 2)):
        base = dst.data_ptr()
        t0 = time.perf_counter()
        off = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            ctypes.memmove(base + off, t.data_ptr(), n)
            off += n
        mm_times.append(time.perf_counter() - t0)
    result["memmove_single_thread_seconds"] = _summary(mm_times)
    del dst
    return result


def _shm_copy(tensors: list[torch.Tensor], nbytes: int, reps: int) -> dict[str, Any] | None:
    """Reference: the same copy into a pre-faulted MAP_SHARED file mapping on /dev/shm (what a save writes into)."""
    import mmap

    import torch

    if not os.path.isdir("/dev/shm"):
        return None
    fd, path = tempfile.mkstemp(prefix="memstore-bench-", dir="/dev/shm")
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
        os.unlink(path)
    try:
        dst = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
        dst.fill_(1)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            _copy_all(dst, tensors)
            times.append(time.perf_counter() - t0)
        del dst
    finally:
        gc.collect()
        with contextlib.suppress(BufferError):
            mm.close()
    return _summary(times)


def save_path_model(state: Any, reps: int = 3) -> dict[str, Any]:
    """The client side of save() without the store: serialization.plan() and ShardLayout.write_into() a
    pre-faulted /dev/shm mapping. save() minus these two is the Allocate/Commit RPCs and the mapping lookup."""
    import mmap

    from trainer_client import serialization

    plan_times = []
    layout = serialization.plan(state)
    for _ in range(reps):
        t0 = time.perf_counter()
        layout = serialization.plan(state)
        plan_times.append(time.perf_counter() - t0)
    nbytes = layout.nbytes
    shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="memstore-bench-", dir=shm_dir)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
        os.unlink(path)
    try:
        layout.write_into(mm)  # first touch
        write_times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            layout.write_into(mm)
            write_times.append(time.perf_counter() - t0)
    finally:
        with contextlib.suppress(BufferError):
            mm.close()
    return {"bytes": nbytes, "dir": shm_dir, "plan_seconds": _summary(plan_times), "write_into_shm_seconds": _summary(write_times)}


def _copy_all(dst: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    off = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        dst[off : off + n].view(t.dtype).copy_(t.reshape(-1))
        off += n


_TCP_SENDER = r"""
import socket, sys
port, n, reps, chunk = (int(a) for a in sys.argv[1:5])
buf = bytearray(n)
mv = memoryview(buf)
pattern = bytes(range(256)) * (chunk // 256)
for off in range(0, n, chunk):
    mv[off : off + chunk] = pattern[: min(chunk, n - off)]
s = socket.create_connection(("127.0.0.1", port), timeout=120)
for _ in range(reps):
    for off in range(0, n, chunk):
        s.sendall(mv[off : off + chunk])
s.shutdown(socket.SHUT_WR)
s.settimeout(120)
s.recv(1)
s.close()
"""


def floor_tcp(nbytes: int, reps: int = TCP_REPS, timeout: float = 120.0) -> dict[str, Any]:
    """A child Python process sends ``nbytes`` ``reps`` times with sendall of 4 MiB memoryview slices;
    this process receives with recv_into a pre-faulted buffer. Time per repetition from the first byte
    (rep 0) or the previous repetition's last byte to its last byte."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(timeout)
    port = listener.getsockname()[1]
    buf = bytearray(nbytes)
    view = memoryview(buf)
    for off in range(0, nbytes, CHUNK):  # pre-fault the receive buffer
        view[off : off + CHUNK] = bytes(min(CHUNK, nbytes - off))
    child = subprocess.Popen(
        [sys.executable, "-c", _TCP_SENDER, str(port), str(nbytes), str(reps), str(CHUNK)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(timeout)
            rcvbuf = conn.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
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
            conn.sendall(b"k")
        child.wait(timeout=timeout)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
        listener.close()
    if child.returncode != 0:
        err = child.stderr.read().decode(errors="replace") if child.stderr else ""
        raise RuntimeError(f"TCP sender failed with {child.returncode}: {err[-2000:]}")
    if child.stderr:
        child.stderr.close()
    # Rep 0 is timed from its first recv's return, so it misses those first bytes.
    throughputs = [(nbytes - (first_bytes if i == 0 else 0)) / t for i, t in enumerate(times)]
    del view, buf
    return {
        "bytes": nbytes,
        "reps": reps,
        "send_slice_bytes": CHUNK,
        "receiver_so_rcvbuf": rcvbuf,
        "seconds": _summary(times),
        "bytes_per_second": _summary(throughputs),
    }


def floor_disk(state: Any, disk_dir: str | None) -> dict[str, Any]:
    """torch.save + flush + fsync to a temp file on local disk; torch.load(weights_only=True) cold and warm."""
    import torch

    with tempfile.TemporaryDirectory(prefix="memstore-bench-", dir=disk_dir) as d:
        path = os.path.join(d, "state.pt")
        t0 = time.perf_counter()
        with open(path, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            t1 = time.perf_counter()
            os.fsync(fh.fileno())
        t2 = time.perf_counter()
        file_bytes = os.path.getsize(path)
        evicted = _evict_page_cache(path)
        t3 = time.perf_counter()
        loaded = torch.load(path, weights_only=True)
        t4 = time.perf_counter()
        ok_cold = states_equal(state, loaded)
        del loaded
        gc.collect()
        t5 = time.perf_counter()
        loaded = torch.load(path, weights_only=True)
        t6 = time.perf_counter()
        del loaded
        gc.collect()
        fs = _filesystem_of(d)
    return {
        "dir": d,
        "filesystem": fs,
        "file_bytes": file_bytes,
        "save_seconds": t1 - t0,
        "fsync_seconds": t2 - t1,
        "save_fsync_seconds": t2 - t0,
        "load_cold_seconds": t4 - t3,
        "load_cold_page_cache_evicted": evicted,
        "load_warm_seconds": t6 - t5,
        "load_verified": ok_cold,
    }


def _evict_page_cache(path: str) -> bool:
    """Drop the file's clean pages from the page cache (POSIX_FADV_DONTNEED; no root needed)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _filesystem_of(path: str) -> str:
    best = ("", "")
    with contextlib.suppress(OSError):
        real = os.path.realpath(path)
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")) and len(parts[1]) >= len(best[0]):
                best = (parts[1], f"{parts[2]} ({parts[0]} on {parts[1]})")
    return best[1]


# --------------------------------------------------------------------------------------------------
# replication cost model (in process, single thread)
# --------------------------------------------------------------------------------------------------


def replication_cost_model(tensors: list[torch.Tensor], nbytes: int) -> dict[str, Any]:
    """Time each CPU step the replication pipeline applies to every byte, on the same bytes, in this process.

    Sender (owner store): xxh3 over the shard (before any byte is sent), ``bytes(view[chunk])`` per chunk
    (memstore.v1.streams.iter_chunks), ``PutRequest(chunk=...)`` and its serialisation by gRPC.
    Receiver (peer store): protobuf parse, ``msg.chunk``, xxh3 verify, copy into the segment.
    Kernel loopback copies are in the raw TCP floor.
    """
    from memstore.v1 import store_pb2 as pb
    from memstore.v1.integrity import checksum

    views = _byte_views(tensors)
    out: dict[str, float] = {}

    def timed(name: str, fn: Callable[[memoryview], object]) -> None:
        t0 = time.perf_counter()
        for c in _chunks(views):
            fn(c)
        out[name] = time.perf_counter() - t0

    timed("xxh3_checksum", checksum)
    timed("bytes_copy_per_chunk", bytes)
    timed("pb_putrequest_build", lambda c: pb.PutRequest(chunk=bytes(c)))
    timed("pb_serialize", lambda c: pb.PutRequest(chunk=bytes(c)).SerializeToString())
    wire = pb.PutRequest(chunk=bytes(CHUNK)).SerializeToString()
    n_chunks = sum(1 for _ in _chunks(views))
    t0 = time.perf_counter()
    for _ in range(n_chunks):
        pb.PutRequest.FromString(wire).chunk  # noqa: B018 - parse + field access is the measured work
    out["pb_parse_and_chunk_access"] = time.perf_counter() - t0
    dest = bytearray(CHUNK)
    dview = memoryview(dest)
    dview[:] = bytes(CHUNK)
    blob = bytes(CHUNK)
    t0 = time.perf_counter()
    for c in _chunks(views):
        dview[: len(c)] = blob[: len(c)]
    out["copy_into_segment"] = time.perf_counter() - t0
    for v in views:
        v.release()
    # Derived: what each side spends per shard, single-threaded.
    sender = out["xxh3_checksum"] + out["pb_serialize"]
    receiver = out["pb_parse_and_chunk_access"] + out["xxh3_checksum"] + out["copy_into_segment"]
    return {
        "bytes": nbytes,
        "chunk_bytes": CHUNK,
        "chunks": n_chunks,
        "seconds": out,
        "bytes_per_second": {k: nbytes / v for k, v in out.items() if v > 0},
        "sender_cpu_seconds_estimate": sender,
        "receiver_cpu_seconds_estimate": receiver,
        "notes": (
            "pb_serialize includes bytes_copy_per_chunk and pb_putrequest_build; the owner checksums the whole shard "
            "before it pushes the first chunk, so that part is serial; receiver work overlaps the sender's "
            "on another core when one is free."
        ),
    }


# --------------------------------------------------------------------------------------------------
# the cluster part
# --------------------------------------------------------------------------------------------------


@dataclass
class SaveSample:
    step: int
    phase: str  # "cold" | "warmup" | "measured"
    save_wall_seconds: float
    stall_seconds: float  # SaveHandle.stall_seconds (measured inside save())
    committed_seconds: float  # save() start -> wait() returned
    copies: int
    replication_seconds: float  # committed - save wall
    replication_bytes_per_second: float


def _round_page(n: int) -> int:
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    return -(-n // page) * page


def _delete_shard(address: str, step: int) -> int:
    from memstore.v1 import store_pb2 as pb
    from memstore.v1 import store_pb2_grpc as pb_grpc
    from memstore.v1.channel import insecure_channel

    with insecure_channel(address) as ch:
        resp = pb_grpc.StoreStub(ch).Delete(pb.DeleteRequest(job_id=JOB_ID, step=step, rank=0), timeout=30)
    return int(resp.deleted)


def _pull_notes(log_text: str) -> dict[str, int]:
    """Count the replacement store's 'fetch: pulled' / 'repair: pulled' log lines since its last start."""
    start = log_text.rfind("serving on")
    tail = log_text[start:] if start >= 0 else log_text
    return {
        "fetch_pulls": sum(1 for line in tail.splitlines() if "fetch: pulled" in line),
        "repair_pulls": sum(1 for line in tail.splitlines() if "repair: pulled" in line),
    }


def measure_cluster(config: BenchConfig, state: Any, shard_bytes: int, step_done: Callable[[str], None]) -> dict[str, Any]:
    from memstore.local_cluster import LocalCluster, wait_for
    from trainer_client import CheckpointClient

    capacity = (config.keep + 1) * _round_page(shard_bytes) + CAPACITY_SLACK
    hosts = [f"h{i}" for i in range(config.hosts)]
    # --repair-interval 3600: after the startup pass (when the stores are still empty) no anti-entropy pass
    # runs during the measurements, so the peer restore below is the Fetch path and nothing else.
    cluster = LocalCluster(
        hosts=config.hosts,
        replicas=config.replicas,
        capacity=str(capacity),
        keep=config.keep,
        extra_args=["--repair-interval", "3600"],
    )
    out: dict[str, Any] = {"capacity_bytes_per_store": capacity, "store_args_extra": ["--repair-interval", "3600"]}
    commit_timeout = 60.0 + shard_bytes / (10 * MiB)
    t0 = time.perf_counter()
    cluster.start()
    out["cluster_start_seconds"] = time.perf_counter() - t0
    try:
        step_done("cluster started")

        def retention_settled() -> bool:
            for h in hosts:
                hh = cluster.health(h, timeout=5)
                if hh is None or hh.shards > config.keep:
                    return False
            return True

        samples: list[SaveSample] = []
        client = CheckpointClient(JOB_ID, 0, 1, store=cluster.address("h0"))
        try:
            out["shared_memory"] = client.shared_memory
            total = config.warmup + config.saves
            for i in range(total):
                step = i + 1
                t0 = time.perf_counter()
                handle = client.save(step, state)
                t1 = time.perf_counter()
                info = handle.wait(timeout=commit_timeout)
                t2 = time.perf_counter()
                rep = (t2 - t0) - (t1 - t0)
                samples.append(
                    SaveSample(
                        step=step,
                        phase="cold" if i == 0 else ("warmup" if i < config.warmup else "measured"),
                        save_wall_seconds=t1 - t0,
                        stall_seconds=handle.stall_seconds,
                        committed_seconds=t2 - t0,
                        copies=int(info.copies),
                        replication_seconds=rep,
                        replication_bytes_per_second=shard_bytes / rep if rep > 0 else float("nan"),
                    )
                )
                # Let retention evict the oldest step so the next save reuses its (pre-faulted) segment.
                wait_for(retention_settled, 60.0, interval=0.02, what="retention to drop old steps")
                step_done(f"save {step}/{total}")
        finally:
            client.close()
        last_step = samples[-1].step
        out["saves"] = [asdict(s) for s in samples]
        measured = [s for s in samples if s.phase == "measured"]
        out["stall_seconds"] = _summary([s.save_wall_seconds for s in measured])
        out["stall_inside_save_seconds"] = _summary([s.stall_seconds for s in measured])
        out["committed_seconds"] = _summary([s.committed_seconds for s in measured])
        out["replication_seconds"] = _summary([s.replication_seconds for s in measured])
        out["replication_bytes_per_second"] = _summary([s.replication_bytes_per_second for s in measured])
        out["cold_save"] = asdict(samples[0])
        out["health_after_saves"] = {h: _health_dict(cluster.health(h, timeout=5)) for h in hosts}

        # -- restore from local RAM: a new client (restarted trainer) on the owner's store.
        gc.collect()
        out["restore_local"] = _timed_load(CheckpointClient, cluster.address("h0"), state, last_step)
        step_done("restore from local RAM")

        if config.replicas >= 2:
            # -- restore from peer RAM: the owner store lacks the shard (deleted there), a group peer holds it.
            deleted = _delete_shard(cluster.address("h0"), last_step)
            gc.collect()
            r = _timed_load(CheckpointClient, cluster.address("h0"), state, last_step)
            r["deleted_on_owner"] = deleted
            r["pull_seconds_estimate"] = max(0.0, r["load_seconds"] - out["restore_local"]["load_seconds"])
            r["pull_bytes_per_second_estimate"] = (
                shard_bytes / r["pull_seconds_estimate"] if r["pull_seconds_estimate"] > 0 else float("nan")
            )
            out["restore_peer"] = r
            step_done("restore from peer RAM")

            # -- replacement host: SIGKILL the owner store, start its replacement (empty RAM), restore there.
            cluster.kill("h0")
            t0 = time.perf_counter()
            cluster.restart("h0", timeout=60)
            t1 = time.perf_counter()
            gc.collect()
            r = _timed_load(CheckpointClient, cluster.address("h0"), state, last_step, include_connect=True)
            r["restart_seconds"] = t1 - t0
            r["restart_to_loaded_seconds"] = r["load_seconds"]
            r.update(_pull_notes(cluster.log_tail("h0", lines=400)))
            out["restore_replacement"] = r
            step_done("restore on a replacement host")
        else:
            step_done("restore from peer RAM (skipped: R=1)")
            step_done("restore on a replacement host (skipped: R=1)")
    except BaseException:
        for h in hosts:
            tail = cluster.log_tail(h, lines=30)
            if tail:
                print(f"--- log of store {h} ---\n{tail}", file=sys.stderr)
        raise
    finally:
        cluster.stop()
    return out


def _health_dict(h: Any) -> dict[str, Any] | None:
    if h is None:
        return None
    return {"used_bytes": int(h.used_bytes), "capacity_bytes": int(h.capacity_bytes), "shards": int(h.shards)}


def _timed_load(client_cls: Any, address: str, state: Any, step: int, include_connect: bool = False) -> dict[str, Any]:
    t0 = time.perf_counter()
    client = client_cls(JOB_ID, 0, 1, store=address)
    try:
        t1 = time.perf_counter()
        restored = client.load()
        t2 = time.perf_counter()
        source = client.last_load_source
        shm = client.shared_memory
    finally:
        client.close()
    ok = states_equal(state, restored)
    del restored
    gc.collect()
    return {
        "load_seconds": (t2 - t0) if include_connect else (t2 - t1),
        "connect_seconds": t1 - t0,
        "source_host": source,
        "shared_memory": shm,
        "step": step,
        "verified_equal": ok,
    }


# --------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------


def run(config: BenchConfig, command: str, console: Console | None = None) -> dict[str, Any]:
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from trainer_client import serialization

    progress_console = console
    total_phases = PHASES + config.warmup + config.saves
    started = time.time()
    with Progress(
        SpinnerColumn(),
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=progress_console,
        transient=True,
    ) as progress:
        task = progress.add_task("generating state", total=total_phases)

        def step_done(what: str) -> None:
            progress.update(task, advance=1, description=what)

        t0 = time.perf_counter()
        state = make_state(config.size, config.seed)
        tensors = state_tensors(state)
        state_bytes = sum(t.numel() * t.element_size() for t in tensors)
        shard_bytes = serialization.plan(state).nbytes
        gen_seconds = time.perf_counter() - t0
        step_done("floor: memcpy")

        memcpy = floor_memcpy(tensors)
        gc.collect()
        step_done("floor: raw TCP on loopback")
        tcp = floor_tcp(shard_bytes)
        gc.collect()
        step_done("floor: torch.save + fsync / torch.load")
        disk = floor_disk(state, config.disk_dir)
        gc.collect()
        step_done("cost model of the save and replication paths")
        cost = replication_cost_model(tensors, state_bytes)
        cost["save_path"] = save_path_model(state)
        gc.collect()
        step_done("starting the local cluster")
        cluster = measure_cluster(config, state, shard_bytes, step_done)
        step_done("done")

    result = assemble(config, command, started, gen_seconds, state_bytes, shard_bytes, len(tensors), memcpy, tcp, disk, cost, cluster)
    return result


def assemble(
    config: BenchConfig,
    command: str,
    started: float,
    gen_seconds: float,
    state_bytes: int,
    shard_bytes: int,
    n_tensors: int,
    memcpy: dict[str, Any],
    tcp: dict[str, Any],
    disk: dict[str, Any],
    cost: dict[str, Any],
    cluster: dict[str, Any],
) -> dict[str, Any]:
    stall = cluster["stall_seconds"]["p50"]
    stall95 = cluster["stall_seconds"]["p95"]
    copy_floor = memcpy["torch_copy_seconds"]["p50"]
    repl_bps = cluster["replication_bytes_per_second"]["p50"] if config.replicas >= 2 else None
    tcp_bps = tcp["bytes_per_second"]["p50"]
    local = cluster["restore_local"]["load_seconds"]
    peer = cluster.get("restore_peer", {}).get("load_seconds")
    repl_host = cluster.get("restore_replacement", {}).get("load_seconds")
    ratios = {
        "stall_p50_over_memcpy": _ratio(stall, copy_floor),
        "stall_p95_over_memcpy": _ratio(stall95, copy_floor),
        "stall_p50_over_shm_memcpy": _ratio(stall, (memcpy.get("shm_torch_copy_seconds") or {}).get("p50")),
        "cold_stall_over_memcpy_fresh": _ratio(cluster["cold_save"]["save_wall_seconds"], memcpy["torch_copy_fresh_seconds"]["p50"]),
        "replication_over_raw_tcp": _ratio(repl_bps, tcp_bps),
        "restore_local_over_torch_load_warm": _ratio(local, disk["load_warm_seconds"]),
        "restore_local_over_torch_load_cold": _ratio(local, disk["load_cold_seconds"]),
        "restore_peer_over_torch_load_warm": _ratio(peer, disk["load_warm_seconds"]),
        "restore_peer_over_torch_load_cold": _ratio(peer, disk["load_cold_seconds"]),
        "restore_replacement_over_torch_load_warm": _ratio(repl_host, disk["load_warm_seconds"]),
        "stall_p50_over_torch_save_fsync": _ratio(stall, disk["save_fsync_seconds"]),
        "committed_p50_over_torch_save_fsync": _ratio(cluster["committed_seconds"]["p50"], disk["save_fsync_seconds"]),
    }
    s_ratio = ratios["stall_p50_over_memcpy"]
    r_ratio = ratios["replication_over_raw_tcp"]
    targets = {
        "stall_p50_le_2x_memcpy": {
            "target": f"stall p50 <= {STALL_TARGET}x torch copy_ into pre-faulted memory",
            "ratio": s_ratio,
            "pass": s_ratio is not None and s_ratio <= STALL_TARGET,
        },
        "replication_ge_half_raw_tcp": {
            "target": f"replication throughput p50 >= {REPLICATION_TARGET}x raw TCP loopback",
            "ratio": r_ratio,
            "pass": None if r_ratio is None else r_ratio >= REPLICATION_TARGET,
        },
    }
    verified = [cluster["restore_local"]["verified_equal"], disk["load_verified"]]
    verified += [cluster[k]["verified_equal"] for k in ("restore_peer", "restore_replacement") if k in cluster]
    return {
        "ok": all(verified),
        "command": command,
        "started_unix": started,
        "duration_seconds": time.time() - started,
        "config": asdict(config),
        "machine": machine_info(),
        "state": {
            "bytes": state_bytes,
            "shard_bytes": shard_bytes,
            "tensors": n_tensors,
            "dtype": "float32",
            "layout": "4 layers x (weight, exp_avg, exp_avg_sq), random (torch.rand), one rank of world size 1",
            "generate_seconds": gen_seconds,
        },
        "floors": {"memcpy": memcpy, "tcp": tcp, "disk": disk},
        "cluster": cluster,
        "replication_cost_model": cost,
        "ratios": ratios,
        "targets": targets,
        "method": {
            "stall": (
                f"wall time of CheckpointClient.save() over the measured saves, after {config.warmup} warm-up saves "
                f"(keep+1: the store pools a freed segment only once retention evicts the oldest of keep={config.keep} steps, "
                "so save keep+2 is the first into a recycled, pre-faulted segment); the first (cold) save is reported apart"
            ),
            "committed": (
                "save() start until SaveHandle.wait() returned (all R copies verified); the next save starts after retention settled"
            ),
            "replication_throughput": "shard bytes / (time to committed - save() wall time); includes the owner's xxh3 pass over the shard",
            "restore_local": "new CheckpointClient on h0 (restarted trainer), load() (latest step) timed; connect excluded",
            "restore_peer": (
                "the newest step is deleted on h0 (Delete RPC, h0 stays up), then a new client on h0 load()s it: h0's Fetch pulls it "
                "from the group peer over gRPC (into h0's pooled segment) and the client maps, verifies and decodes it; connect excluded. "
                "Background repair is disabled (--repair-interval 3600) so nothing else brings it back"
            ),
            "restore_replacement": (
                "h0 SIGKILLed and restarted (empty RAM; its startup repair pass pulls the newest keep steps from the peer at once); "
                "timed from restart() returning (store serving) through client connect and load(); source_host and the store's log "
                "say whether the client's Fetch or the repair pass pulled the shard"
            ),
            "memcpy_floor": (
                "torch copy_ of the state's tensors into one pre-faulted uint8 buffer (median of 5); "
                "memmove single-thread and the same copy into a /dev/shm mapping for reference"
            ),
            "tcp_floor": f"child python sendall of 4 MiB memoryview slices, parent recv_into a pre-faulted buffer, {TCP_REPS} reps, median",
            "disk_floor": (
                "torch.save to a file, flush + fsync; torch.load(weights_only=True) after POSIX_FADV_DONTNEED (cold) and again (warm)"
            ),
        },
    }


# --------------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------------


def _fmt_s(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.1f} ms" if v < 1 else f"{v:.3f} s"


def _fmt_bps(v: float | None) -> str:
    return "-" if v is None else f"{v / GiB:.2f} GiB/s"


def _fmt_ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _fmt_bytes(n: int) -> str:
    from memstore.core.sizes import format_size

    return format_size(n)


def render(result: dict[str, Any], console: Console) -> None:
    from rich.table import Table

    cfg = result["config"]
    m = result["machine"]
    st = result["state"]
    fl = result["floors"]
    cl = result["cluster"]
    ra = result["ratios"]
    tg = result["targets"]
    nb = st["shard_bytes"]

    def verdict(t: dict[str, Any]) -> str:
        if t["pass"] is None:
            return "n/a"
        return "[bold green]PASS[/]" if t["pass"] else "[bold red]MISS[/]"

    title = (
        f"memstore bench: {_fmt_bytes(st['bytes'])} state ({st['tensors']} float32 tensors, shard {_fmt_bytes(nb)}) on 1 rank, "
        f"{cfg['hosts']} hosts, R={cfg['replicas']}, 127.0.0.1"
    )
    t = Table(title=title, show_lines=False)
    t.add_column("figure")
    t.add_column("memstore", justify="right")
    t.add_column("floor (same run)")
    t.add_column("ratio", justify="right")
    t.add_column("target", justify="right")
    t.add_column("", justify="center")

    stall = cl["stall_seconds"]
    copy_s = fl["memcpy"]["torch_copy_seconds"]["p50"]
    fresh_s = fl["memcpy"]["torch_copy_fresh_seconds"]["p50"]
    t.add_row(
        f"save() stall p50 (warm, n={stall['n']})",
        f"{_fmt_s(stall['p50'])} ({_fmt_bps(nb / stall['p50'])})",
        f"torch copy_ pre-faulted {_fmt_s(copy_s)} ({_fmt_bps(nb / copy_s)})",
        _fmt_ratio(ra["stall_p50_over_memcpy"]),
        f"<= {STALL_TARGET:.1f}x",
        verdict(tg["stall_p50_le_2x_memcpy"]),
    )
    t.add_row("save() stall p95 (warm)", _fmt_s(stall["p95"]), "same", _fmt_ratio(ra["stall_p95_over_memcpy"]), "", "")
    t.add_row(
        "first save (cold segment)",
        _fmt_s(cl["cold_save"]["save_wall_seconds"]),
        f"torch copy_ into fresh memory {_fmt_s(fresh_s)}",
        _fmt_ratio(ra["cold_stall_over_memcpy_fresh"]),
        "",
        "",
    )
    t.add_row(
        "save() stall p50 vs disk",
        _fmt_s(stall["p50"]),
        f"torch.save+fsync {_fmt_s(fl['disk']['save_fsync_seconds'])}",
        _fmt_ratio(ra["stall_p50_over_torch_save_fsync"]),
        "",
        "",
    )
    com = cl["committed_seconds"]
    t.add_row(
        "time to committed p50 / p95",
        f"{_fmt_s(com['p50'])} / {_fmt_s(com['p95'])}",
        f"torch.save+fsync {_fmt_s(fl['disk']['save_fsync_seconds'])}",
        _fmt_ratio(ra["committed_p50_over_torch_save_fsync"]),
        "",
        "",
    )
    tcp_bps = fl["tcp"]["bytes_per_second"]["p50"]
    if cfg["replicas"] >= 2:
        t.add_row(
            "replication throughput p50",
            f"{_fmt_bps(cl['replication_bytes_per_second']['p50'])} ({_fmt_s(cl['replication_seconds']['p50'])})",
            f"raw TCP loopback {_fmt_bps(tcp_bps)}",
            _fmt_ratio(ra["replication_over_raw_tcp"]),
            f">= {REPLICATION_TARGET:.1f}x",
            verdict(tg["replication_ge_half_raw_tcp"]),
        )
    warm = fl["disk"]["load_warm_seconds"]
    cold = fl["disk"]["load_cold_seconds"]
    loc = cl["restore_local"]
    t.add_row(
        f"restore from local RAM (src {loc['source_host']})",
        f"{_fmt_s(loc['load_seconds'])} ({_fmt_bps(nb / loc['load_seconds'])})",
        f"torch.load page cache {_fmt_s(warm)} / cold {_fmt_s(cold)}",
        f"{_fmt_ratio(ra['restore_local_over_torch_load_warm'])} / {_fmt_ratio(ra['restore_local_over_torch_load_cold'])}",
        "",
        "",
    )
    if "restore_peer" in cl:
        p = cl["restore_peer"]
        t.add_row(
            f"restore from peer RAM (src {p['source_host']})",
            f"{_fmt_s(p['load_seconds'])} ({_fmt_bps(nb / p['load_seconds'])})",
            f"torch.load page cache {_fmt_s(warm)} / cold {_fmt_s(cold)}",
            f"{_fmt_ratio(ra['restore_peer_over_torch_load_warm'])} / {_fmt_ratio(ra['restore_peer_over_torch_load_cold'])}",
            "",
            "",
        )
        t.add_row(
            "  of which peer pull (peer - local)",
            f"{_fmt_s(p['pull_seconds_estimate'])} ({_fmt_bps(p['pull_bytes_per_second_estimate'])})",
            f"raw TCP loopback {_fmt_bps(tcp_bps)}",
            _fmt_ratio(_ratio(p["pull_bytes_per_second_estimate"], tcp_bps)),
            "",
            "",
        )
    if "restore_replacement" in cl:
        r = cl["restore_replacement"]
        who = "fetch" if r["fetch_pulls"] else ("repair" if r["repair_pulls"] else "?")
        t.add_row(
            f"replacement h0: serving -> loaded (src {r['source_host']}, pulled by {who})",
            _fmt_s(r["load_seconds"]),
            f"torch.load page cache {_fmt_s(warm)}",
            _fmt_ratio(ra["restore_replacement_over_torch_load_warm"]),
            "",
            "",
        )
    console.print(t)

    f = Table(title="floors and references (same run)")
    f.add_column("measurement")
    f.add_column("time", justify="right")
    f.add_column("throughput", justify="right")
    mc = fl["memcpy"]
    f.add_row(f"torch copy_ pre-faulted, {mc['torch_threads']} threads (p50 of 5)", _fmt_s(copy_s), _fmt_bps(nb / copy_s))
    mm = mc["memmove_single_thread_seconds"]["p50"]
    f.add_row("ctypes.memmove single thread, pre-faulted", _fmt_s(mm), _fmt_bps(nb / mm))
    if mc.get("shm_torch_copy_seconds"):
        shm = mc["shm_torch_copy_seconds"]["p50"]
        f.add_row("torch copy_ into pre-faulted /dev/shm MAP_SHARED mapping (p50 of 5)", _fmt_s(shm), _fmt_bps(nb / shm))
    f.add_row("torch copy_ into fresh memory (incl. page faults)", _fmt_s(fresh_s), _fmt_bps(nb / fresh_s))
    f.add_row(f"raw TCP loopback, 4 MiB sendall / recv_into (p50 of {TCP_REPS})", _fmt_s(fl["tcp"]["seconds"]["p50"]), _fmt_bps(tcp_bps))
    d = fl["disk"]
    f.add_row(
        f"torch.save + fsync ({d['filesystem'] or 'local disk'})", _fmt_s(d["save_fsync_seconds"]), _fmt_bps(nb / d["save_fsync_seconds"])
    )
    f.add_row("  of which fsync", _fmt_s(d["fsync_seconds"]), "")
    f.add_row("torch.load, page cache evicted", _fmt_s(cold), _fmt_bps(nb / cold))
    f.add_row("torch.load, page cache warm", _fmt_s(warm), _fmt_bps(nb / warm))
    console.print(f)

    cm = result["replication_cost_model"]
    c = Table(title="cost model of the save and replication paths (this process, same bytes)")
    c.add_column("step")
    c.add_column("time", justify="right")
    c.add_column("throughput", justify="right")
    for k, v in cm["seconds"].items():
        c.add_row(k, _fmt_s(v), _fmt_bps(cm["bytes"] / v if v > 0 else None))
    sp = cm["save_path"]
    c.add_row("save: serialization.plan()", _fmt_s(sp["plan_seconds"]["p50"]), "")
    c.add_row(
        "save: ShardLayout.write_into(pre-faulted shm)",
        _fmt_s(sp["write_into_shm_seconds"]["p50"]),
        _fmt_bps(nb / sp["write_into_shm_seconds"]["p50"]),
    )
    c.add_row("save: measured save() p50", _fmt_s(stall["p50"]), "")
    c.add_row("sender CPU estimate (xxh3 + serialize)", _fmt_s(cm["sender_cpu_seconds_estimate"]), "")
    c.add_row("receiver CPU estimate (parse + xxh3 + copy)", _fmt_s(cm["receiver_cpu_seconds_estimate"]), "")
    if cfg["replicas"] >= 2:
        c.add_row("measured replication (committed - stall), p50", _fmt_s(cl["replication_seconds"]["p50"]), "")
    console.print(c)

    console.print(
        f"[dim]{m['cpu_count']} CPUs ({m['cpu_model']}), {_fmt_bytes(m['ram_bytes'])} RAM, Python {m['python']}, torch {m['torch']} "
        f"({m['torch_threads']} threads), grpcio {m['grpcio']}. Warm-up: {cfg['warmup']} saves (keep+1) so the store's segment pool is "
        f"warm; the cold first save is shown apart. {cfg['saves']} measured saves.[/]"
    )
    if not result["ok"]:
        console.print("[bold red]a restored state differed from the saved one[/]")
