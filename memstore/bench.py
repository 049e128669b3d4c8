"""``memstore bench``: save stall, replication and restore of memstore against hardware floors.

One run measures, on an embedded :class:`~memstore.local_cluster.LocalCluster` on 127.0.0.1:

* the trainer's stall per ``save()`` (the cold first saves, then p50/p95 over warm saves),
* the time until the save is committed (R copies) and the replication throughput derived from it,
* restore from local RAM (a new client, i.e. a restarted trainer, on the owner's store),
* restore from peer RAM (the owner's store lacks the shard and its Fetch pulls it from a group peer),
* restore on a replacement host (owner store SIGKILLed and restarted with empty RAM),

and, in the same run and on the same bytes, the floors they are compared with: a torch ``copy_`` into
pre-faulted memory (also measured right before every measured save, so both see the same background
load), raw TCP between two Python processes on loopback, ``torch.save`` + fsync / ``torch.load`` on
local disk. For diagnosis it also measures gRPC-Python streaming between two processes (raw bytes
messages, then memstore's ``PutRequest`` protobuf) and an in-process cost model of the save and
replication paths (checksum, per-chunk copies, protobuf), and samples the memory footprint (PSS of this
process and its children: the stores and the floor helpers) and the machine's CPU pressure.

This module is imported by ``memstore.cli``, so it only imports the standard library at module level;
torch, numpy, grpc and rich are imported where used.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
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
CHUNK = 4 * MiB  # TCP/gRPC floor message size and cost-model chunk (= memstore's default chunk size)
CAPACITY_SLACK = 64 * MiB
STALL_TARGET = 2.0  # save stall <= 2x memcpy
REPLICATION_TARGET = 0.5  # replication throughput >= 0.5x raw TCP
MEMCPY_REPS = 5
TCP_REPS = 3
GRPC_REPS = 3
FLOOR_TIMEOUT = 300.0
PHASES = 12  # progress steps besides the saves and restores


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default=None, help="state bytes on the one benchmarked rank (e.g. 64MiB, 256MiB, 1GiB; default 1GiB)")
    p.add_argument("--hosts", type=int, default=2, help="stores in the local cluster (default 2)")
    p.add_argument("--replicas", type=int, default=2, help="replication factor R (default 2)")
    p.add_argument("--saves", type=int, default=None, help="measured (warm) saves after the warm-up ones (default 5; --quick 2)")
    p.add_argument("--restores", type=int, default=None, help="repetitions of each restore and of torch.load (default 3; --quick 1)")
    p.add_argument("--keep", type=int, default=2, help="steps each store keeps (default 2); warm-up is keep+1 saves")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write every raw number, ratio and machine info here")
    p.add_argument("--quick", action="store_true", help="64MiB, 2 saves, 1 restore unless given explicitly (smoke test)")
    p.add_argument("--disk-dir", default=None, help="directory on local disk for the torch.save floor (default: the temp dir)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random state")
    p.add_argument(
        "--data-plane",
        choices=("tcp", "grpc"),
        default=None,
        help="passed to the stores as --data-plane (how replicas and pulls travel); default: the store's default",
    )
    p.add_argument(
        "--store-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment of the store processes, repeatable (e.g. MALLOC_TRIM_THRESHOLD_=268435456 to try allocator tuning)",
    )


@dataclass
class BenchConfig:
    size: int
    hosts: int
    replicas: int
    saves: int
    restores: int
    keep: int
    warmup: int
    json_path: str | None
    disk_dir: str | None
    seed: int
    quick: bool
    store_env: dict[str, str]
    data_plane: str | None


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    from memstore.core.sizes import parse_size

    size_text = args.size or ("64MiB" if args.quick else "1GiB")
    size = parse_size(size_text)
    saves = args.saves if args.saves is not None else (2 if args.quick else 5)
    restores = args.restores if args.restores is not None else (1 if args.quick else 3)
    if size < MiB:
        raise ValueError(f"--size {size_text} is too small: expected at least 1MiB")
    if saves < 1 or restores < 1:
        raise ValueError(f"--saves {saves} / --restores {restores} are invalid: expected >= 1")
    if args.hosts < 1 or not 1 <= args.replicas <= args.hosts:
        raise ValueError(f"--hosts {args.hosts} / --replicas {args.replicas} are invalid: expected 1 <= replicas <= hosts")
    if args.keep < 1:
        raise ValueError(f"--keep {args.keep} is invalid: expected >= 1")
    store_env = {}
    for item in args.store_env or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--store-env {item!r} is invalid: expected KEY=VALUE")
        store_env[key] = value
    return BenchConfig(
        size=size,
        hosts=args.hosts,
        replicas=args.replicas,
        saves=saves,
        restores=restores,
        keep=args.keep,
        warmup=args.keep + 1,
        json_path=args.json_path,
        disk_dir=args.disk_dir,
        seed=args.seed,
        quick=bool(args.quick),
        store_env=store_env,
        data_plane=args.data_plane,
    )


def run_from_args(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    from rich.console import Console

    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"memstore bench: error: {exc}", file=sys.stderr)
        return 2
    console = Console()
    if not console.is_terminal:
        console = Console(width=150)  # logs and pipes: don't squeeze the tables into 80 columns
    result = run(config, shlex.join([sys.executable, *sys.argv]), console)
    result["bench_argv"] = argv
    render(result, console)
    if config.json_path:
        path = Path(config.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
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


def cpu_pressure() -> dict[str, float] | None:
    """The 'some' line of /proc/pressure/cpu: share of time runnable tasks waited for a CPU."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/pressure/cpu").read_text().splitlines():
            if line.startswith("some"):
                fields = dict(item.split("=") for item in line.split()[1:])
                return {"avg10": float(fields["avg10"]), "avg60": float(fields["avg60"]), "total_us": float(fields["total"])}
    return None


def machine_info() -> dict[str, Any]:
    import grpc
    import numpy as np
    import torch

    thp = {}
    for name in ("enabled", "shmem_enabled"):
        with contextlib.suppress(OSError):
            thp[name] = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
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
        "transparent_hugepage": thp,
    }


class Monitor:
    """Samples, every ``interval`` s, the memory of this process and its children (PSS, so pages
    shared by a store and the client count once) and remembers the peak and the phase it happened in."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.phase = "start"
        self.peak_bytes = 0
        self.peak_phase = ""
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-monitor", daemon=True)
        self.pressure_start = cpu_pressure()
        self.load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
        self.t_start = time.monotonic()

    def __enter__(self) -> Monitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def sample(self) -> None:
        total = sum(_pss(pid) for pid in [os.getpid(), *_children(os.getpid())])
        self.samples += 1
        if total > self.peak_bytes:
            self.peak_bytes = total
            self.peak_phase = self.phase

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(Exception):
                self.sample()

    def report(self) -> dict[str, Any]:
        end = cpu_pressure()
        elapsed = time.monotonic() - self.t_start
        busy = None
        if self.pressure_start and end and elapsed > 0:
            busy = (end["total_us"] - self.pressure_start["total_us"]) / 1e6 / elapsed
        return {
            "memory_peak_pss_bytes": self.peak_bytes,
            "memory_peak_phase": self.peak_phase,
            "memory_samples": self.samples,
            "cpu_pressure_start": self.pressure_start,
            "cpu_pressure_end": end,
            "cpu_pressure_some_share_during_run": busy,
            "loadavg_start": self.load_start,
            "loadavg_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
        }


def _pss(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def _children(ppid: int) -> list[int]:
    out = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{entry.name}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == ppid:
                    out.append(int(entry.name))
    return out


def make_state(nbytes: int, seed: int) -> dict[str, Any]:
    """A model + Adam-like state of ``nbytes`` float32 bytes: 4 layers x (weight, exp_avg, exp_avg_sq), random."""
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


def _prefaulted(nbytes: int) -> bytearray:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    zeros = bytes(min(CHUNK, nbytes))
    for off in range(0, nbytes, CHUNK):
        view[off : off + CHUNK] = zeros[: min(CHUNK, nbytes - off)]
    view.release()
    return buf


def _child_env() -> dict[str, str]:
    """Environment for helper processes: this memstore importable first."""
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# --------------------------------------------------------------------------------------------------
# floors
# --------------------------------------------------------------------------------------------------


def _copy_all(dst: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    off = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        dst[off : off + n].view(t.dtype).copy_(t.reshape(-1))
        off += n


def floor_memcpy(tensors: list[torch.Tensor], reps: int = MEMCPY_REPS) -> dict[str, Any]:
    """torch ``copy_`` (multi-threaded) of every state tensor into a pre-faulted buffer; memmove single-thread;
    the same copy into a /dev/shm mapping and into fresh (never touched) memory, for reference."""
    import torch

    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    result: dict[str, Any] = {"bytes": nbytes, "torch_threads": torch.get_num_threads()}

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
    gc.collect()
    result["shm_torch_copy_seconds"] = _shm_copy(tensors, nbytes, reps)
    return result


def _shared_mapping(nbytes: int, directory: str | None) -> Any:
    """An unlinked, pre-populated MAP_SHARED file mapping: the kind of memory a save writes into."""
    import mmap

    fd, path = tempfile.mkstemp(prefix="memstore-bench-", dir=directory)
    try:
        os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
        os.unlink(path)


def _shm_copy(tensors: list[torch.Tensor], nbytes: int, reps: int) -> dict[str, Any] | None:
    """The same copy into a pre-faulted MAP_SHARED file mapping on /dev/shm (what a save writes into)."""

    import torch

    if not os.path.isdir("/dev/shm"):
        return None
    mm = _shared_mapping(nbytes, "/dev/shm")
    times = []
    try:
        dst = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
        dst.fill_(1)
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


def floor_tcp(nbytes: int, recv_buf: bytearray, reps: int = TCP_REPS, timeout: float = FLOOR_TIMEOUT) -> dict[str, Any]:
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
        [sys.executable, "-c", _TCP_SENDER, str(port), str(nbytes), str(reps), str(CHUNK)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    times: list[float] = []
    first_bytes = 0
    rcvbuf = 0
    try:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(timeout)
            rcvbuf = conn.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
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
    return {
        "bytes": nbytes,
        "reps": reps,
        "send_slice_bytes": CHUNK,
        "receiver_so_rcvbuf": rcvbuf,
        "seconds": _summary(times),
        "bytes_per_second": _summary(throughputs),
    }


_GRPC_SENDER = r"""
import sys
import grpc
from memstore.v1 import store_pb2 as pb
from memstore.v1.channel import insecure_channel
port, n, reps, mode, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
buf = bytearray(n)
mv = memoryview(buf)
pattern = bytes(range(256)) * (chunk // 256)
for off in range(0, n, chunk):
    mv[off : off + chunk] = pattern[: min(chunk, n - off)]
ch = insecure_channel(f"127.0.0.1:{port}")
grpc.channel_ready_future(ch).result(timeout=60)
if mode == "bytes":
    put = ch.stream_unary("/memstore.bench.Sink/Put", request_serializer=None, response_deserializer=None)
    gen = lambda: (bytes(mv[o : o + chunk]) for o in range(0, n, chunk))
else:
    put = ch.stream_unary("/memstore.bench.Sink/Put", request_serializer=pb.PutRequest.SerializeToString, response_deserializer=None)
    gen = lambda: (pb.PutRequest(chunk=bytes(mv[o : o + chunk])) for o in range(0, n, chunk))
for _ in range(reps):
    put(gen(), timeout=600)
ch.close()
"""


def floor_grpc(nbytes: int, recv_buf: bytearray, mode: str, reps: int = GRPC_REPS, timeout: float = FLOOR_TIMEOUT) -> dict[str, Any]:
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

    def handler(request_iterator: Iterator[Any], context: grpc.ServicerContext) -> bytes:
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

    deserializer = None if mode == "bytes" else pb.PutRequest.FromString
    rpc = grpc.stream_unary_rpc_method_handler(handler, request_deserializer=deserializer, response_serializer=None)
    server = grpc.server(ThreadPoolExecutor(max_workers=4), options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("memstore.bench.Sink", {"Put": rpc}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _GRPC_SENDER, str(port), str(nbytes), str(reps), mode, str(CHUNK)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=timeout,
            env=_child_env(),
            check=False,
        )
    finally:
        server.stop(1).wait(5)
        view.release()
    if proc.returncode != 0 or errors or len(times) != reps:
        raise RuntimeError(f"gRPC floor ({mode}) failed: rc={proc.returncode} {errors} {proc.stderr.decode(errors='replace')[-2000:]}")
    return {
        "mode": mode,
        "bytes": nbytes,
        "reps": reps,
        "message_bytes": CHUNK,
        "seconds": _summary(times),
        "bytes_per_second": _summary([nbytes / t for t in times]),
    }


def floor_disk(state: Any, disk_dir: str | None, reps: int) -> dict[str, Any]:
    """torch.save + flush + fsync to a temp file on local disk; torch.load(weights_only=True) with the file's
    page cache evicted (cold) and warm, ``reps`` times each."""
    import torch

    cold: list[float] = []
    warm: list[float] = []
    evicted = False
    ok = True
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
        for i in range(reps):
            evicted = _evict_page_cache(path)
            t3 = time.perf_counter()
            loaded = torch.load(path, weights_only=True)
            cold.append(time.perf_counter() - t3)
            if i == 0:
                ok = states_equal(state, loaded)
            del loaded
            gc.collect()
            t3 = time.perf_counter()
            loaded = torch.load(path, weights_only=True)
            warm.append(time.perf_counter() - t3)
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
        "load_cold_seconds": _summary(cold),
        "load_cold_page_cache_evicted": evicted,
        "load_warm_seconds": _summary(warm),
        "load_verified": ok,
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
# cost model of the save and replication paths (in process)
# --------------------------------------------------------------------------------------------------


def replication_cost_model(tensors: list[torch.Tensor], nbytes: int) -> dict[str, Any]:
    """Time each CPU step the replication pipeline applies to every byte, on the same bytes, in this process,
    one thread. Sender (owner store): xxh3 over the whole shard before any byte is sent, ``bytes(view[chunk])``
    per chunk (memstore.v1.streams.iter_chunks), ``PutRequest(chunk=...)`` and its serialisation by gRPC.
    Receiver (peer store): protobuf parse and ``msg.chunk``, xxh3 verify, copy into the segment."""
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
    dest = _prefaulted(CHUNK)
    dview = memoryview(dest)
    blob = bytes(CHUNK)
    t0 = time.perf_counter()
    for c in _chunks(views):
        dview[: len(c)] = blob[: len(c)]
    out["copy_into_segment"] = time.perf_counter() - t0
    dview.release()
    for v in views:
        v.release()
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
            "on another core when one is free; gRPC framing and the kernel copies are in the gRPC/TCP floors."
        ),
    }


def save_path_model(state: Any, reps: int = 3) -> dict[str, Any]:
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
    mm = _shared_mapping(nbytes, shm_dir)
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
    return {"bytes": nbytes, "dir": shm_dir, "plan_seconds": _summary(plan_times), "write_into_shm_seconds": _summary(write_times)}


# --------------------------------------------------------------------------------------------------
# the cluster part
# --------------------------------------------------------------------------------------------------


@dataclass
class SaveSample:
    step: int
    phase: str  # "cold" (a new segment: the first keep+1 saves) | "measured"
    save_wall_seconds: float  # wall time of save()
    stall_seconds: float  # SaveHandle.stall_seconds (measured inside save())
    committed_seconds: float  # save() start -> wait() returned
    copies: int
    replication_seconds: float  # committed - save wall
    replication_bytes_per_second: float
    paired_memcpy_seconds: float | None  # torch copy_ into pre-faulted memory, right before this save


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


_PULLED = re.compile(r"(fetch|repair): pulled (\S+) from (\S+)")


def _pull_notes(log_text: str) -> dict[str, Any]:
    """The replacement store's 'fetch: pulled' / 'repair: pulled' log lines since its last start."""
    start = log_text.rfind("serving on")
    tail = log_text[start:] if start >= 0 else log_text
    pulls = [{"by": m.group(1), "key": m.group(2), "from": m.group(3)} for m in _PULLED.finditer(tail)]
    by_key: dict[str, set[str]] = {}
    for p in pulls:
        by_key.setdefault(p["key"], set()).add(p["by"])
    return {
        "pulls": pulls,
        "fetch_pulls": sum(1 for p in pulls if p["by"] == "fetch"),
        "repair_pulls": sum(1 for p in pulls if p["by"] == "repair"),
        "pulled_twice": sorted(k for k, who in by_key.items() if len(who) > 1),
    }


def _timed_load(address: str, state: Any, include_connect: bool = False) -> dict[str, Any]:
    from trainer_client import CheckpointClient

    t0 = time.perf_counter()
    client = CheckpointClient(JOB_ID, 0, 1, store=address)
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
        "verified_equal": ok,
    }


def _restore_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "load_seconds": _summary([r["load_seconds"] for r in runs]),
        "source_hosts": sorted({r["source_host"] for r in runs}),
        "verified_equal": all(r["verified_equal"] for r in runs),
        "runs": runs,
    }


def measure_cluster(
    config: BenchConfig, state: Any, shard_bytes: int, step_done: Callable[[str], None], monitor: Monitor
) -> dict[str, Any]:
    import torch

    from memstore.local_cluster import LocalCluster, wait_for
    from trainer_client import CheckpointClient

    capacity = (config.keep + 1) * _round_page(shard_bytes) + CAPACITY_SLACK
    hosts = [f"h{i}" for i in range(config.hosts)]
    # --repair-interval 3600: after the startup pass (when the stores are still empty) no anti-entropy pass
    # runs during the measurements, so the peer restore below is the Fetch path and nothing else.
    extra = ["--repair-interval", "3600"]
    if config.data_plane:
        extra += ["--data-plane", config.data_plane]
    cluster = LocalCluster(
        hosts=config.hosts,
        replicas=config.replicas,
        capacity=str(capacity),
        keep=config.keep,
        extra_args=extra,
        env=dict(config.store_env) or None,
    )
    out: dict[str, Any] = {"capacity_bytes_per_store": capacity, "store_extra_args": extra}
    commit_timeout = 60.0 + shard_bytes / (10 * MiB)
    tensors = state_tensors(state)
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

        # -- saves ------------------------------------------------------------------------------
        monitor.phase = "saves"
        samples: list[SaveSample] = []
        floor_dst = torch.empty(sum(t.numel() * t.element_size() for t in tensors), dtype=torch.uint8)
        floor_dst.fill_(1)
        client = CheckpointClient(JOB_ID, 0, 1, store=cluster.address("h0"))
        try:
            out["shared_memory"] = client.shared_memory
            out["store_version"] = client.hello.version
            out["store_data_port"] = int(getattr(client.hello, "data_port", 0))  # 0: replicas and pulls travel over gRPC
            out["data_plane"] = _data_plane(asdict(config), out)
            total = config.warmup + config.saves
            for i in range(total):
                step = i + 1
                measured = i >= config.warmup
                paired = None
                if measured:
                    t0 = time.perf_counter()
                    _copy_all(floor_dst, tensors)
                    paired = time.perf_counter() - t0
                t0 = time.perf_counter()
                handle = client.save(step, state)
                t1 = time.perf_counter()
                info = handle.wait(timeout=commit_timeout)
                t2 = time.perf_counter()
                rep = t2 - t1
                samples.append(
                    SaveSample(
                        step=step,
                        phase="measured" if measured else "cold",
                        save_wall_seconds=t1 - t0,
                        stall_seconds=handle.stall_seconds,
                        committed_seconds=t2 - t0,
                        copies=int(info.copies),
                        replication_seconds=rep,
                        replication_bytes_per_second=shard_bytes / rep if rep > 0 else float("nan"),
                        paired_memcpy_seconds=paired,
                    )
                )
                # Let retention evict the oldest step so the next save reuses its (pre-faulted) segment.
                wait_for(retention_settled, 60.0, interval=0.02, what="retention to drop old steps")
                monitor.sample()
                step_done(f"save {step}/{total}")
        finally:
            client.close()
            del floor_dst
            gc.collect()
        last_step = samples[-1].step
        out["last_step"] = last_step
        out["saves"] = [asdict(s) for s in samples]
        measured_saves = [s for s in samples if s.phase == "measured"]
        cold_saves = [s for s in samples if s.phase == "cold"]
        out["stall_seconds"] = _summary([s.save_wall_seconds for s in measured_saves])
        out["stall_inside_save_seconds"] = _summary([s.stall_seconds for s in measured_saves])
        out["paired_memcpy_seconds"] = _summary([s.paired_memcpy_seconds or 0.0 for s in measured_saves])
        out["committed_seconds"] = _summary([s.committed_seconds for s in measured_saves])
        out["replication_seconds"] = _summary([s.replication_seconds for s in measured_saves])
        out["replication_bytes_per_second"] = _summary([s.replication_bytes_per_second for s in measured_saves])
        out["first_save"] = asdict(samples[0])
        out["cold_saves_stall_seconds"] = _summary([s.save_wall_seconds for s in cold_saves])
        out["health_after_saves"] = {h: _health_dict(cluster.health(h, timeout=5)) for h in hosts}

        # -- restore from local RAM: a new client (restarted trainer) on the owner's store ----------------
        monitor.phase = "restore_local"
        runs = []
        for i in range(config.restores):
            runs.append(_timed_load(cluster.address("h0"), state))
            monitor.sample()
            step_done(f"restore from local RAM {i + 1}/{config.restores}")
        out["restore_local"] = _restore_summary(runs)

        if config.replicas >= 2:
            # -- restore from peer RAM: the owner store lacks the shard (deleted there), a group peer holds it.
            monitor.phase = "restore_peer"
            runs = []
            for i in range(config.restores):
                deleted = _delete_shard(cluster.address("h0"), last_step)
                r = _timed_load(cluster.address("h0"), state)
                r["deleted_on_owner"] = deleted
                runs.append(r)
                monitor.sample()
                step_done(f"restore from peer RAM {i + 1}/{config.restores}")
            peer = _restore_summary(runs)
            pull = peer["load_seconds"]["p50"] - out["restore_local"]["load_seconds"]["p50"]
            peer["pull_seconds_estimate"] = pull
            peer["pull_bytes_per_second_estimate"] = shard_bytes / pull if pull > 0 else None
            out["restore_peer"] = peer

            # -- replacement host: SIGKILL the owner store, start its replacement (empty RAM), restore there.
            monitor.phase = "restore_replacement"
            cluster.kill("h0")
            t0 = time.perf_counter()
            cluster.restart("h0", timeout=60)
            t1 = time.perf_counter()
            r = _timed_load(cluster.address("h0"), state, include_connect=True)
            r["restart_seconds"] = t1 - t0
            monitor.sample()
            # Let the startup repair pass finish so its pulls are in the log.
            wait_for(lambda: _repairs_idle(cluster), 120.0, interval=0.1, what="the replacement's repair pass")
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
        monitor.phase = "cluster_stop"
        cluster.stop()
    return out


def _repairs_idle(cluster: Any) -> bool:
    h = cluster.health("h0", timeout=5)
    return h is not None and h.repairs_in_flight == 0


def _health_dict(h: Any) -> dict[str, Any] | None:
    if h is None:
        return None
    return {"used_bytes": int(h.used_bytes), "capacity_bytes": int(h.capacity_bytes), "shards": int(h.shards)}


# --------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------


def run(config: BenchConfig, command: str, console: Console | None = None) -> dict[str, Any]:
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from trainer_client import serialization

    total_phases = PHASES + config.warmup + config.saves + 2 * config.restores
    started = time.time()
    with (
        Monitor() as monitor,
        Progress(
            SpinnerColumn(),
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        ) as progress,
    ):
        task = progress.add_task("generating the state", total=total_phases)

        def step_done(what: str) -> None:
            progress.update(task, advance=1, description=what)

        monitor.phase = "generate"
        t0 = time.perf_counter()
        state = make_state(config.size, config.seed)
        tensors = state_tensors(state)
        state_bytes = sum(t.numel() * t.element_size() for t in tensors)
        shard_bytes = serialization.plan(state).nbytes
        gen_seconds = time.perf_counter() - t0
        step_done("floor: memcpy")

        monitor.phase = "floor_memcpy"
        memcpy = floor_memcpy(tensors)
        gc.collect()
        step_done("floor: raw TCP on loopback")
        monitor.phase = "floor_tcp"
        recv_buf = _prefaulted(shard_bytes)
        tcp = floor_tcp(shard_bytes, recv_buf)
        step_done("diagnosis: gRPC streaming, raw bytes messages")
        monitor.phase = "floor_grpc"
        grpc_bytes = floor_grpc(shard_bytes, recv_buf, "bytes")
        step_done("diagnosis: gRPC streaming, PutRequest messages")
        grpc_pb = floor_grpc(shard_bytes, recv_buf, "protobuf")
        del recv_buf
        gc.collect()
        step_done("floor: torch.save + fsync / torch.load")
        monitor.phase = "floor_disk"
        disk = floor_disk(state, config.disk_dir, config.restores)
        gc.collect()
        step_done("diagnosis: cost model of the save and replication paths")
        monitor.phase = "cost_model"
        cost = replication_cost_model(tensors, state_bytes)
        cost["save_path"] = save_path_model(state)
        gc.collect()
        step_done("starting the local cluster")
        monitor.phase = "cluster"
        cluster = measure_cluster(config, state, shard_bytes, step_done, monitor)
        step_done("done")

    floors = {"memcpy": memcpy, "tcp": tcp, "grpc_bytes": grpc_bytes, "grpc_protobuf": grpc_pb, "disk": disk}
    return assemble(config, command, started, gen_seconds, state_bytes, shard_bytes, len(tensors), floors, cost, cluster, monitor.report())


def assemble(
    config: BenchConfig,
    command: str,
    started: float,
    gen_seconds: float,
    state_bytes: int,
    shard_bytes: int,
    n_tensors: int,
    floors: dict[str, Any],
    cost: dict[str, Any],
    cluster: dict[str, Any],
    monitor: dict[str, Any],
) -> dict[str, Any]:
    memcpy, tcp, disk = floors["memcpy"], floors["tcp"], floors["disk"]
    stall = cluster["stall_seconds"]["p50"]
    stall95 = cluster["stall_seconds"]["p95"]
    paired = cluster["paired_memcpy_seconds"]["p50"]
    repl_bps = cluster["replication_bytes_per_second"]["p50"] if config.replicas >= 2 else None
    tcp_bps = tcp["bytes_per_second"]["p50"]
    load_warm = disk["load_warm_seconds"]["p50"]
    load_cold = disk["load_cold_seconds"]["p50"]
    local = cluster["restore_local"]["load_seconds"]["p50"]
    peer = cluster["restore_peer"]["load_seconds"]["p50"] if "restore_peer" in cluster else None
    repl_host = cluster["restore_replacement"]["load_seconds"] if "restore_replacement" in cluster else None
    ratios = {
        "stall_p50_over_memcpy": _ratio(stall, paired),
        "stall_p95_over_memcpy": _ratio(stall95, paired),
        "stall_p50_over_memcpy_standalone": _ratio(stall, memcpy["torch_copy_seconds"]["p50"]),
        "stall_p50_over_shm_memcpy": _ratio(stall, (memcpy.get("shm_torch_copy_seconds") or {}).get("p50")),
        "first_save_over_memcpy_fresh": _ratio(cluster["first_save"]["save_wall_seconds"], memcpy["torch_copy_fresh_seconds"]["p50"]),
        "stall_p50_over_torch_save_fsync": _ratio(stall, disk["save_fsync_seconds"]),
        "committed_p50_over_torch_save_fsync": _ratio(cluster["committed_seconds"]["p50"], disk["save_fsync_seconds"]),
        "replication_over_raw_tcp": _ratio(repl_bps, tcp_bps),
        "replication_over_grpc_bytes": _ratio(repl_bps, floors["grpc_bytes"]["bytes_per_second"]["p50"]),
        "replication_over_grpc_protobuf": _ratio(repl_bps, floors["grpc_protobuf"]["bytes_per_second"]["p50"]),
        "grpc_bytes_over_raw_tcp": _ratio(floors["grpc_bytes"]["bytes_per_second"]["p50"], tcp_bps),
        "grpc_protobuf_over_raw_tcp": _ratio(floors["grpc_protobuf"]["bytes_per_second"]["p50"], tcp_bps),
        "restore_local_over_torch_load_warm": _ratio(local, load_warm),
        "restore_local_over_torch_load_cold": _ratio(local, load_cold),
        "restore_peer_over_torch_load_warm": _ratio(peer, load_warm),
        "restore_peer_over_torch_load_cold": _ratio(peer, load_cold),
        "restore_replacement_over_torch_load_warm": _ratio(repl_host, load_warm),
        "restore_replacement_over_torch_load_cold": _ratio(repl_host, load_cold),
    }
    s_ratio = ratios["stall_p50_over_memcpy"]
    r_ratio = ratios["replication_over_raw_tcp"]
    targets = {
        "stall_p50_le_2x_memcpy": {
            "target": f"save() stall p50 <= {STALL_TARGET}x torch copy_ of the same bytes into pre-faulted memory (paired p50)",
            "ratio": s_ratio,
            "pass": s_ratio is not None and s_ratio <= STALL_TARGET,
        },
        "replication_ge_half_raw_tcp": {
            "target": f"replication throughput p50 >= {REPLICATION_TARGET}x raw TCP on loopback",
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
        "conditions": monitor,
        "state": {
            "bytes": state_bytes,
            "shard_bytes": shard_bytes,
            "tensors": n_tensors,
            "dtype": "float32",
            "layout": "4 layers x (weight, exp_avg, exp_avg_sq) + 4 scalar step tensors, torch.rand; one rank of world size 1",
            "generate_seconds": gen_seconds,
        },
        "floors": floors,
        "cluster": cluster,
        "diagnosis": cost,
        "ratios": ratios,
        "targets": targets,
        "method": _METHOD | {"warmup": f"{config.warmup} saves (keep+1={config.keep}+1): {_METHOD['warmup']}"},
    }


_METHOD: dict[str, str] = {
    "warmup": (
        "each of the first keep+1 saves gets a new segment (the store pools a segment only once retention evicts the oldest "
        "of keep steps), so save keep+2 is the first into a recycled, pre-faulted segment; those cold saves are reported apart"
    ),
    "stall": "wall time of CheckpointClient.save() over the measured saves",
    "memcpy_floor": (
        "paired: torch copy_ of the state's tensors into one pre-faulted uint8 buffer, right before each measured save "
        "(same background load); standalone: median of 5 before the cluster starts; memmove single-thread, a /dev/shm "
        "mapping and fresh memory for reference"
    ),
    "committed": "save() start until SaveHandle.wait() returned (all R copies verified); the next save starts after retention settled",
    "replication_throughput": "shard bytes / (time to committed - save() wall time); includes the owner's xxh3 pass over the shard",
    "tcp_floor": "child python sendall of 4 MiB memoryview slices, this process recv_into a pre-faulted buffer; median of 3",
    "grpc_floors": (
        "diagnosis of the gRPC data plane (--data-plane grpc, and the fallback), not a target: gRPC-Python client stream from "
        "a child process, 4 MiB messages, memstore's channel and server options; raw bytes messages and PutRequest protobuf "
        "messages; receiver copies into a pre-faulted buffer"
    ),
    "restore_local": "new CheckpointClient on h0 (a restarted trainer), load() of the latest step; connect excluded; median",
    "restore_peer": (
        "the newest step is deleted on h0 (Delete RPC, h0 stays up), then a new client on h0 load()s it: h0's Fetch pulls it "
        "from the group peer over the stores' data plane (into h0's pooled segment) and the client maps, verifies and decodes "
        "it; connect excluded; median. Background repair is off (--repair-interval 3600) so nothing else brings the shard back"
    ),
    "restore_replacement": (
        "h0 SIGKILLed and restarted (empty RAM; its startup repair pass pulls the newest keep steps from the peer at once); "
        "timed from restart() returning (store serving) through client connect and load(); once. source_host and the "
        "store's log (pulls) say whether the client's Fetch, the repair pass, or both pulled the shard"
    ),
    "disk_floor": "torch.save to a file, flush + fsync; torch.load(weights_only=True) after POSIX_FADV_DONTNEED (cold) and again (warm)",
    "memory": "peak of the summed PSS of this process and its children (stores, floor helpers), sampled every 0.5 s and per step",
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


def _data_plane(cfg: dict[str, Any], cl: dict[str, Any]) -> str:
    if cl.get("store_data_port"):
        return "raw TCP data channel" if cfg.get("data_plane") != "grpc" else "gRPC streams"
    return "gRPC streams"


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
        f"memstore bench: {_fmt_bytes(st['bytes'])} of float32 state ({st['tensors']} tensors) on 1 rank, "
        f"{cfg['hosts']} hosts, R={cfg['replicas']}, 127.0.0.1, data plane: {_data_plane(cfg, cl)}"
    )
    t = Table(title=title)
    t.add_column("figure")
    t.add_column("memstore", justify="right")
    t.add_column("floor (same run)")
    t.add_column("ratio", justify="right")
    t.add_column("target", justify="right")
    t.add_column("", justify="center")

    stall = cl["stall_seconds"]
    paired = cl["paired_memcpy_seconds"]["p50"]
    fresh_s = fl["memcpy"]["torch_copy_fresh_seconds"]["p50"]
    t.add_row(
        f"save() stall p50 (warm, n={stall['n']})",
        f"{_fmt_s(stall['p50'])} ({_fmt_bps(nb / stall['p50'])})",
        f"torch copy_ pre-faulted {_fmt_s(paired)} ({_fmt_bps(nb / paired)})",
        _fmt_ratio(ra["stall_p50_over_memcpy"]),
        f"<= {STALL_TARGET:.1f}x",
        verdict(tg["stall_p50_le_2x_memcpy"]),
    )
    t.add_row("save() stall p95 (warm)", _fmt_s(stall["p95"]), "same", _fmt_ratio(ra["stall_p95_over_memcpy"]), "", "")
    cold = cl["cold_saves_stall_seconds"]
    t.add_row(
        f"first save / cold saves p50, max (n={cold['n']})",
        f"{_fmt_s(cl['first_save']['save_wall_seconds'])} / {_fmt_s(cold['p50'])}, {_fmt_s(cold['max'])}",
        f"torch copy_ into fresh memory {_fmt_s(fresh_s)}",
        _fmt_ratio(ra["first_save_over_memcpy_fresh"]),
        "",
        "",
    )
    disk = fl["disk"]
    t.add_row(
        "save() stall p50 vs disk",
        _fmt_s(stall["p50"]),
        f"torch.save + fsync {_fmt_s(disk['save_fsync_seconds'])}",
        _fmt_ratio(ra["stall_p50_over_torch_save_fsync"]),
        "",
        "",
    )
    com = cl["committed_seconds"]
    t.add_row(
        "time to committed p50 / p95",
        f"{_fmt_s(com['p50'])} / {_fmt_s(com['p95'])}",
        f"torch.save + fsync {_fmt_s(disk['save_fsync_seconds'])}",
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
    warm = disk["load_warm_seconds"]["p50"]
    cold_load = disk["load_cold_seconds"]["p50"]
    load_floor = f"torch.load cached {_fmt_s(warm)} / evicted {_fmt_s(cold_load)}"
    loc = cl["restore_local"]
    t.add_row(
        f"restore from local RAM p50 (src {','.join(loc['source_hosts'])}, n={loc['load_seconds']['n']})",
        f"{_fmt_s(loc['load_seconds']['p50'])} ({_fmt_bps(nb / loc['load_seconds']['p50'])})",
        load_floor,
        f"{_fmt_ratio(ra['restore_local_over_torch_load_warm'])} / {_fmt_ratio(ra['restore_local_over_torch_load_cold'])}",
        "",
        "",
    )
    if "restore_peer" in cl:
        p = cl["restore_peer"]
        t.add_row(
            f"restore from peer RAM p50 (src {','.join(p['source_hosts'])}, n={p['load_seconds']['n']})",
            f"{_fmt_s(p['load_seconds']['p50'])} ({_fmt_bps(nb / p['load_seconds']['p50'])})",
            load_floor,
            f"{_fmt_ratio(ra['restore_peer_over_torch_load_warm'])} / {_fmt_ratio(ra['restore_peer_over_torch_load_cold'])}",
            "",
            "",
        )
        t.add_row(
            "  of which the peer pull (peer - local)",
            f"{_fmt_s(p['pull_seconds_estimate'])} ({_fmt_bps(p['pull_bytes_per_second_estimate'])})",
            f"raw TCP loopback {_fmt_bps(tcp_bps)}",
            _fmt_ratio(_ratio(p["pull_bytes_per_second_estimate"], tcp_bps)),
            "",
            "",
        )
    if "restore_replacement" in cl:
        r = cl["restore_replacement"]
        who = "+".join(k for k in ("fetch", "repair") if r[f"{k}_pulls"]) or "?"
        t.add_row(
            f"replacement h0: serving -> loaded (src {r['source_host']}; pulls: {who})",
            _fmt_s(r["load_seconds"]),
            load_floor,
            f"{_fmt_ratio(ra['restore_replacement_over_torch_load_warm'])} / {_fmt_ratio(ra['restore_replacement_over_torch_load_cold'])}",
            "",
            "",
        )
    console.print(t)

    f = Table(title="floors and references (same run)")
    f.add_column("measurement")
    f.add_column("time", justify="right")
    f.add_column("throughput", justify="right")
    mc = fl["memcpy"]
    f.add_row(
        f"torch copy_ pre-faulted, paired with the saves (p50 of {cl['paired_memcpy_seconds']['n']})", _fmt_s(paired), _fmt_bps(nb / paired)
    )
    copy_s = mc["torch_copy_seconds"]["p50"]
    f.add_row(f"torch copy_ pre-faulted, {mc['torch_threads']} threads, standalone (p50 of 5)", _fmt_s(copy_s), _fmt_bps(nb / copy_s))
    mm = mc["memmove_single_thread_seconds"]["p50"]
    f.add_row("ctypes.memmove single thread, pre-faulted", _fmt_s(mm), _fmt_bps(nb / mm))
    if mc.get("shm_torch_copy_seconds"):
        shm = mc["shm_torch_copy_seconds"]["p50"]
        f.add_row("torch copy_ into a pre-faulted /dev/shm MAP_SHARED mapping (p50 of 5)", _fmt_s(shm), _fmt_bps(nb / shm))
    f.add_row("torch copy_ into fresh memory (incl. page faults, p50 of 2)", _fmt_s(fresh_s), _fmt_bps(nb / fresh_s))
    f.add_row(f"raw TCP loopback, 4 MiB sendall / recv_into (p50 of {TCP_REPS})", _fmt_s(fl["tcp"]["seconds"]["p50"]), _fmt_bps(tcp_bps))
    for key, label in (("grpc_bytes", "raw bytes messages"), ("grpc_protobuf", "PutRequest protobuf messages")):
        g = fl[key]
        f.add_row(
            f"gRPC-Python stream, 4 MiB {label} (p50 of {GRPC_REPS})",
            _fmt_s(g["seconds"]["p50"]),
            f"{_fmt_bps(g['bytes_per_second']['p50'])} = {_fmt_ratio(_ratio(g['bytes_per_second']['p50'], tcp_bps))} TCP",
        )
    f.add_row(
        f"torch.save + fsync ({disk['filesystem'] or 'local disk'})",
        _fmt_s(disk["save_fsync_seconds"]),
        _fmt_bps(nb / disk["save_fsync_seconds"]),
    )
    f.add_row("  of which fsync", _fmt_s(disk["fsync_seconds"]), "")
    n_loads = disk["load_cold_seconds"]["n"]
    f.add_row(f"torch.load, page cache evicted (p50 of {n_loads})", _fmt_s(cold_load), _fmt_bps(nb / cold_load))
    f.add_row(f"torch.load, page cache warm (p50 of {n_loads})", _fmt_s(warm), _fmt_bps(nb / warm))
    console.print(f)

    cm = result["diagnosis"]
    c = Table(title="diagnosis: CPU cost of the save path and of the gRPC data plane's per-chunk steps (this process, same bytes)")
    c.add_column("step")
    c.add_column("time", justify="right")
    c.add_column("throughput", justify="right")
    sp = cm["save_path"]
    c.add_row("save: serialization.plan()", _fmt_s(sp["plan_seconds"]["p50"]), "")
    w = sp["write_into_shm_seconds"]["p50"]
    c.add_row("save: ShardLayout.write_into(pre-faulted /dev/shm mapping)", _fmt_s(w), _fmt_bps(nb / w))
    c.add_row("save: measured save() p50 (adds Allocate + Commit RPCs)", _fmt_s(stall["p50"]), "")
    for k, v in cm["seconds"].items():
        c.add_row(f"replication: {k}", _fmt_s(v), _fmt_bps(cm["bytes"] / v if v > 0 else None))
    c.add_row("replication: sender CPU estimate (xxh3 + build + serialize)", _fmt_s(cm["sender_cpu_seconds_estimate"]), "")
    c.add_row("replication: receiver CPU estimate (parse + xxh3 + copy)", _fmt_s(cm["receiver_cpu_seconds_estimate"]), "")
    if cfg["replicas"] >= 2:
        c.add_row(f"replication: measured (committed - stall) p50, {_data_plane(cfg, cl)}", _fmt_s(cl["replication_seconds"]["p50"]), "")
    console.print(c)

    cond = result["conditions"]
    busy = cond.get("cpu_pressure_some_share_during_run")
    console.print(
        f"[dim]{m['cpu_count']} CPUs ({m['cpu_model']}), {_fmt_bytes(m['ram_bytes'])} RAM, Python {m['python']}, torch {m['torch']} "
        f"({m['torch_threads']} threads), grpcio {m['grpcio']}. Warm-up: {cfg['warmup']} cold saves (keep+1) so the store's "
        f"segment pool is warm, then {cfg['saves']} measured saves. Peak memory (PSS, this process + stores): "
        f"{_fmt_bytes(cond['memory_peak_pss_bytes'])} during {cond['memory_peak_phase']}. CPU pressure during the run: "
        f"{'-' if busy is None else f'{busy * 100:.0f}%'} of the time some task (this bench's own included) waited for a CPU.[/]"
    )
    if cfg["store_env"]:
        console.print(f"[yellow]store processes ran with extra environment: {' '.join(f'{k}={v}' for k, v in cfg['store_env'].items())}[/]")
    if not result["ok"]:
        console.print("[bold red]a restored state differed from the saved one[/]")
