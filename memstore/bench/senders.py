"""The sending side of the raw TCP and gRPC baselines, run in a child process by :mod:`memstore.bench.floors`:

    python -m memstore.bench.senders tcp PORT NBYTES REPS CHUNK
    python -m memstore.bench.senders grpc PORT NBYTES REPS {bytes,protobuf} CHUNK

Each fills ``NBYTES`` of memory once, then sends it ``REPS`` times in ``CHUNK``-sized pieces to 127.0.0.1:PORT.
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Callable, Iterator
from typing import Any

SINK_METHOD = "/memstore.bench.Sink/Put"


def _filled(n: int, chunk: int) -> memoryview:
    buf = bytearray(n)
    mv = memoryview(buf)
    pattern = bytes(range(256)) * (chunk // 256)
    for off in range(0, n, chunk):
        mv[off : off + chunk] = pattern[: min(chunk, n - off)]
    return mv


def send_tcp(port: int, n: int, reps: int, chunk: int) -> None:
    """sendall of ``chunk``-sized memoryview slices; waits for the receiver's one-byte acknowledgement."""
    mv = _filled(n, chunk)
    s = socket.create_connection(("127.0.0.1", port), timeout=120)
    for _ in range(reps):
        for off in range(0, n, chunk):
            s.sendall(mv[off : off + chunk])
    s.shutdown(socket.SHUT_WR)
    s.settimeout(120)
    s.recv(1)
    s.close()


def send_grpc(port: int, n: int, reps: int, mode: str, chunk: int) -> None:
    """A gRPC-Python client stream per repetition, with memstore's channel options: raw ``bytes`` messages, or
    ``PutRequest(chunk=...)`` protobuf messages as memstore's replication sends."""
    import grpc

    from memstore.v1 import store_pb2 as pb
    from memstore.v1.channel import insecure_channel

    mv = _filled(n, chunk)
    ch = insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(ch).result(timeout=60)
    gen: Callable[[], Iterator[Any]]
    if mode == "bytes":
        put = ch.stream_unary(SINK_METHOD, request_serializer=None, response_deserializer=None)

        def gen() -> Iterator[Any]:
            return (bytes(mv[o : o + chunk]) for o in range(0, n, chunk))
    else:
        put = ch.stream_unary(SINK_METHOD, request_serializer=pb.PutRequest.SerializeToString, response_deserializer=None)

        def gen() -> Iterator[Any]:
            return (pb.PutRequest(chunk=bytes(mv[o : o + chunk])) for o in range(0, n, chunk))

    for _ in range(reps):
        put(gen(), timeout=600)
    ch.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m memstore.bench.senders", description="sender of the bench's TCP/gRPC baselines")
    sub = p.add_subparsers(dest="kind", required=True)
    tcp = sub.add_parser("tcp")
    grpc_p = sub.add_parser("grpc")
    for q in (tcp, grpc_p):
        q.add_argument("port", type=int)
        q.add_argument("nbytes", type=int)
        q.add_argument("reps", type=int)
    grpc_p.add_argument("mode", choices=("bytes", "protobuf"))
    for q in (tcp, grpc_p):
        q.add_argument("chunk", type=int)
    args = p.parse_args(argv)
    if args.kind == "tcp":
        send_tcp(args.port, args.nbytes, args.reps, args.chunk)
    else:
        send_grpc(args.port, args.nbytes, args.reps, args.mode, args.chunk)
    return 0


if __name__ == "__main__":
    sys.exit(main())
