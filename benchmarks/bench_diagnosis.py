"""Why replication runs below raw TCP: gRPC-Python streaming of the same bytes, beside the raw TCP baseline.

    python benchmarks/bench_diagnosis.py run.json        # adds "diagnosis" to what `memstore bench --json run.json` wrote
    python benchmarks/bench_diagnosis.py --size 256MiB   # prints it alone

A child process streams the bench's state size to a gRPC server in this process in 4 MiB messages, with memstore's
channel and server options: raw ``bytes`` messages (the least gRPC-Python allows: one ``bytes()`` copy per chunk), and
``PutRequest(chunk=...)`` protobuf messages as replication over gRPC sends them. Each is timed on the receiver from the
first message to the last and given as a fraction of raw TCP (``memstore.bench.baselines.baseline_tcp``) measured alongside.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memstore.bench.baselines import BASELINE_TIMEOUT, CHUNK, baseline_tcp
from memstore.bench.state import module_env
from memstore.core.sizes import parse_size

SINK = "/memstore.bench.Sink/Put"
REPS = 3


def send(port: int, nbytes: int, reps: int, mode: str) -> None:
    """The child: a client stream per repetition, with memstore's channel options."""
    import grpc

    from memstore.v1 import store_pb2 as pb
    from memstore.v1.channel import insecure_channel

    data = bytes(range(256)) * (CHUNK // 256)
    ch = insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(ch).result(timeout=60)
    serializer = None if mode == "bytes" else pb.PutRequest.SerializeToString
    put = ch.stream_unary(SINK, request_serializer=serializer, response_deserializer=None)
    for _ in range(reps):
        chunks = (bytes(data[: min(CHUNK, nbytes - o)]) for o in range(0, nbytes, CHUNK))
        put(chunks if mode == "bytes" else (pb.PutRequest(chunk=c) for c in chunks), timeout=600)
    ch.close()


def baseline_grpc(nbytes: int, mode: str, reps: int = REPS) -> dict[str, Any]:
    """Receive ``reps`` streams of ``nbytes`` from a child, copying each chunk into a pre-faulted buffer."""
    import grpc

    from memstore.v1 import store_pb2 as pb
    from memstore.v1.channel import SERVER_OPTIONS

    view = memoryview(bytearray(nbytes))
    times: list[float] = []

    def handler(requests: Any, context: Any) -> bytes:
        got, t0 = 0, time.perf_counter()
        for msg in requests:
            data = msg if mode == "bytes" else msg.chunk
            view[got : got + len(data)] = data
            got += len(data)
        times.append(time.perf_counter() - t0)
        return b""

    rpc = grpc.stream_unary_rpc_method_handler(handler, request_deserializer=None if mode == "bytes" else pb.PutRequest.FromString)
    server = grpc.server(ThreadPoolExecutor(max_workers=4), options=SERVER_OPTIONS)
    service, _, method = SINK.strip("/").partition("/")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {method: rpc}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        argv = [sys.executable, __file__, "--send", str(port), str(nbytes), str(reps), mode]
        proc = subprocess.run(argv, capture_output=True, timeout=BASELINE_TIMEOUT, env=module_env(), check=False)
    finally:
        server.stop(1).wait(5)
    if proc.returncode != 0 or len(times) != reps:
        raise RuntimeError(f"gRPC baseline ({mode}) failed: rc={proc.returncode} {proc.stderr.decode(errors='replace')[-2000:]}")
    rates = [nbytes / t for t in times]
    return {"mode": mode, "bytes": nbytes, "message_bytes": CHUNK, "bytes_per_second": rates, "p50": statistics.median(rates)}


def diagnose(nbytes: int) -> dict[str, Any]:
    tcp = baseline_tcp(nbytes)
    out: dict[str, Any] = {"tcp": tcp}
    for mode in ("bytes", "protobuf"):
        out[f"grpc_{mode}"] = grpc = baseline_grpc(nbytes, mode)
        out[f"grpc_{mode}_over_tcp"] = grpc["p50"] / tcp["p50"]
    return out


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--send"]:
        send(int(args[1]), int(args[2]), int(args[3]), args[4])
        return 0
    p = argparse.ArgumentParser(prog="python benchmarks/bench_diagnosis.py", description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="?", help="a memstore bench --json file: measure its state size and add 'diagnosis' to it")
    p.add_argument("--size", default="256MiB", help="bytes to stream without a JSON file (default 256MiB)")
    ns = p.parse_args(args)
    doc = json.loads(Path(ns.json).read_text()) if ns.json else None
    found = diagnose(doc["state"]["shard_bytes"] if doc else parse_size(ns.size))
    for mode in ("bytes", "protobuf"):
        print(f"gRPC-Python stream, 4 MiB {mode} messages: {found[f'grpc_{mode}']['p50'] / 2**30:.2f} GiB/s = "
              f"{found[f'grpc_{mode}_over_tcp']:.2f}x raw TCP ({found['tcp']['p50'] / 2**30:.2f} GiB/s)")  # fmt: skip
    if doc is not None:
        doc["diagnosis"] = found
        Path(ns.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"added 'diagnosis' to {ns.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
