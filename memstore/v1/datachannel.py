"""The bulk data channel of the wire contract: raw shard bytes over TCP, keyed by a gRPC-issued ticket.

gRPC in Python copies every message several times and tops out near 1 GB/s on loopback; a plain
socket writing straight from the sender's shared-memory segment and ``recv_into`` straight into the
receiver's segment runs at the wire's speed. Integrity is the same as on gRPC: each chunk is checked
against the manifest's checksums as soon as its last byte lands.

Framing: ``ticket (16 bytes)``, then the payload; a receiver of a push answers with one status byte
(0 = stored) and, on failure, a u32 length plus a UTF-8 message.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time
from collections.abc import Callable

from memstore.core.model import Manifest
from memstore.errors import DataChannelError
from memstore.v1.integrity import chunk_spans
from memstore.v1.pagefaults import FaultAhead
from memstore.v1.streams import verify_chunk

TICKET_BYTES = 16
STATUS_OK = 0
STATUS_FAILED = 1
SOCKET_BUFFER_BYTES = 4 << 20
# Bytes moved per send/recv call: large enough to amortise the syscall, small enough to stay in L2.
IO_SLICE_BYTES = 1 << 20


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


def connect(host: str, port: int, timeout: float, tls: ssl.SSLContext | None = None, server_name: str = "") -> socket.socket:
    """A data connection to ``host:port``; with ``tls``, the server's certificate is verified for ``server_name``
    (default: ``host``)."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise DataChannelError(f"cannot connect to data channel {host}:{port}: {exc}") from None
    tune(sock)
    if tls is None:
        return sock
    try:
        return tls.wrap_socket(sock, server_hostname=server_name or host)
    except (ssl.SSLError, ssl.CertificateError, OSError) as exc:
        sock.close()
        raise DataChannelError(f"TLS handshake with data channel {host}:{port} failed: {exc}") from None


def recv_exact(sock: socket.socket, view: memoryview, deadline: float) -> None:
    got = 0
    n = len(view)
    while got < n:
        _set_deadline(sock, deadline)
        try:
            r = sock.recv_into(view[got : min(n, got + IO_SLICE_BYTES)])
        except OSError as exc:
            raise DataChannelError(f"data channel receive failed after {got} of {n} bytes: {exc}") from None
        if r == 0:
            raise DataChannelError(f"data channel closed after {got} of {n} bytes")
        got += r


def send_all(sock: socket.socket, view: memoryview, deadline: float, on_piece: Callable[[], None] | None = None) -> None:
    """Send ``view`` in IO_SLICE_BYTES pieces; ``on_piece`` runs after each (fault-injection points)."""
    for off in range(0, len(view), IO_SLICE_BYTES):
        _set_deadline(sock, deadline)
        try:
            sock.sendall(view[off : off + IO_SLICE_BYTES])
        except OSError as exc:
            raise DataChannelError(f"data channel send failed at byte {off} of {len(view)}: {exc}") from None
        if on_piece:
            on_piece()


def _set_deadline(sock: socket.socket, deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise DataChannelError("data channel transfer exceeded its deadline")
    sock.settimeout(remaining)


def receive_verified(
    sock: socket.socket,
    manifest: Manifest,
    dest: memoryview,
    deadline: float,
    on_chunk: Callable[[], None] | None = None,
    fault_ahead: bool = False,
) -> None:
    """Read the shard's bytes into ``dest`` chunk by chunk, verifying each; StreamError on a mismatch.

    ``fault_ahead``: ``dest`` is fresh memory; a second thread faults its pages in ahead of the socket
    (``FaultAhead``), so allocating and zeroing them overlaps the transfer instead of adding to it.
    """
    out = memoryview(dest)
    ahead = FaultAhead(out[: manifest.nbytes]) if fault_ahead else None
    try:
        for index, (off, length) in enumerate(chunk_spans(manifest.nbytes, manifest.chunk_size)):
            piece = out[off : off + length]
            recv_exact(sock, piece, deadline)
            verify_chunk(manifest, index, piece, where=" on the data channel")
            if on_chunk:
                on_chunk()
    finally:
        if ahead is not None:
            ahead.stop()


def send_status(sock: socket.socket, error: str | None) -> None:
    if error is None:
        sock.sendall(bytes([STATUS_OK]))
    else:
        data = error.encode()[:65536]
        sock.sendall(bytes([STATUS_FAILED]) + struct.pack("<I", len(data)) + data)


def read_status(sock: socket.socket, deadline: float) -> str | None:
    """None if the peer stored the bytes, else its error message."""
    head = bytearray(1)
    recv_exact(sock, memoryview(head), deadline)
    if head[0] == STATUS_OK:
        return None
    size = bytearray(4)
    recv_exact(sock, memoryview(size), deadline)
    (n,) = struct.unpack("<I", size)
    msg = bytearray(min(n, 65536))
    recv_exact(sock, memoryview(msg), deadline)
    return msg.decode(errors="replace")
