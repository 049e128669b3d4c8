"""The bulk data channel of the wire contract: raw shard bytes over TCP, keyed by a gRPC-issued ticket.

gRPC in Python copies every message several times and tops out near 1 GB/s on loopback; a plain
socket writing straight from the sender's shared-memory segment and ``recv_into`` straight into the
receiver's segment runs at the wire's speed. Integrity is the same as on gRPC: each chunk is checked
against the manifest's checksums as soon as its last byte lands.

Framing: ``ticket (16 bytes)``, then the payload; a receiver of a push answers with one status byte
(0 = stored) and, on failure, a u32 length plus a UTF-8 message.

Parallel streams: one shard may move on P connections at once, each with its own ticket and its own
contiguous run of whole chunks (``part_spans``), so every stream is verified per chunk on its own. P comes
from the shard's size and ``--transfer-streams`` (``stream_count``); a failed stream fails the shard
(``Parts``: the receiver registers nothing and frees the memory once every stream has stopped).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence

from memstore.core.model import Manifest
from memstore.errors import DataChannelError
from memstore.v1.integrity import StreamedChecksums, chunk_count, chunk_spans, running_checksum
from memstore.v1.pagefaults import FaultAhead
from memstore.v1.streams import check_chunk

TICKET_BYTES = 16
STATUS_OK = 0
STATUS_FAILED = 1
CHECKSUM = struct.Struct("<Q")  # a streamed chunk checksum (PutHeader.checksums_follow), after its chunk
SOCKET_BUFFER_BYTES = 4 << 20
# Bytes moved per send/recv call: large enough to amortise the syscall, small enough to stay in L2.
IO_SLICE_BYTES = 1 << 20
MAX_STREAMS = 16  # parallel streams of one shard (--transfer-streams, and what a store grants a request)
AUTO_STREAMS = 4  # --transfer-streams auto: streams of a shard of at least AUTO_STREAMS_FROM bytes
AUTO_STREAMS_FROM = 64 << 20  # below this, one stream: the connections' set-up costs more than they gain
FileSource = tuple[int, int] | None  # (fd, offset): the file a view's bytes are in, from that offset (send_all)


def stream_count(nbytes: int, chunk_size: int, streams: int = 0) -> int:
    """Streams to move a shard of ``nbytes`` on: ``streams`` (``--transfer-streams``; 0 = auto), at most one per chunk."""
    want = streams if streams > 0 else (AUTO_STREAMS if nbytes >= AUTO_STREAMS_FROM else 1)
    return max(1, min(want, MAX_STREAMS, chunk_count(nbytes, chunk_size)))


def granted_streams(requested: int, nbytes: int, chunk_size: int, streams: int = 0) -> int:
    """Streams a store grants a request for ``requested`` (0 or 1: one): at most its own choice, ``stream_count``."""
    return 1 if requested <= 1 else min(requested, stream_count(nbytes, chunk_size, streams))


def part_spans(nbytes: int, chunk_size: int, parts: int) -> list[tuple[int, int]]:
    """The chunk index ranges ``(first, end)`` of ``parts`` streams: contiguous, as even as whole chunks allow."""
    n = chunk_count(nbytes, chunk_size)
    parts = max(1, min(parts, n)) if n else 1
    return [(n * i // parts, n * (i + 1) // parts) for i in range(parts)]


def byte_span(nbytes: int, chunk_size: int, chunks: tuple[int, int]) -> tuple[int, int]:
    """The (offset, length) in the shard of the chunks ``[first, end)``."""
    first, end = chunks
    start = min(nbytes, first * chunk_size)
    return start, min(nbytes, end * chunk_size) - start


def split_tickets(tickets: bytes) -> list[bytes]:
    """The per-stream tickets of a (possibly multi-stream) answer; DataChannelError if it is malformed."""
    if not tickets or len(tickets) % TICKET_BYTES or len(tickets) // TICKET_BYTES > MAX_STREAMS:
        raise DataChannelError(f"data channel ticket of {len(tickets)} bytes: expected 1..{MAX_STREAMS} x {TICKET_BYTES}")
    return [tickets[i : i + TICKET_BYTES] for i in range(0, len(tickets), TICKET_BYTES)]


def run_streams(streams: Sequence[Callable[[threading.Event], None]]) -> None:
    """Run every stream (the last on this thread) until all have stopped; the first error is raised.

    Each gets an Event that is set once any of them failed: a stream checks it between pieces and stops.
    """
    failed = threading.Event()
    errors: list[BaseException] = []

    def one(fn: Callable[[threading.Event], None]) -> None:
        try:
            fn(failed)
        except BaseException as exc:
            errors.append(exc)
            failed.set()

    threads = [threading.Thread(target=one, args=(fn,), name="data-stream", daemon=True) for fn in streams[:-1]]
    for t in threads:
        t.start()
    if streams:
        one(streams[-1])
    for t in threads:
        t.join()
    if errors:
        first = next((e for e in errors if not isinstance(e, StreamAborted)), errors[0])
        raise first


class StreamAborted(DataChannelError):
    """This stream stopped because another stream of the same shard failed."""


def abort_check(failed: threading.Event) -> Callable[[], None]:
    def check() -> None:
        if failed.is_set():
            raise StreamAborted("another stream of this shard failed")

    return check


class Parts:
    """The receiving end of one shard's P streams: the last stream to stop finishes the shard (all verified) or
    aborts it (any failed), so nothing half-received is registered and the memory is freed only once no stream
    writes into it any more. Every stream then answers the sender with the shard's outcome."""

    def __init__(self, count: int, finish: Callable[[], None], abort: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._left = count
        self._finish = finish
        self._abort = abort
        self.error: BaseException | None = None
        self.checksums: list[int] | None = None  # streamed checksums (PutHeader.checksums_follow), as they land
        self.failed = threading.Event()  # some stream failed: the others stop at their next chunk
        self.done = threading.Event()

    def end(self, error: BaseException | None = None) -> None:
        """One stream stopped (``error``: it failed, or its ticket expired unused). Never blocks."""
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
                self.failed.set()
            self._left -= 1
            last = self._left == 0
        if not last:
            return
        if self.error is None:
            try:
                self._finish()
            except BaseException as exc:  # the finish released what it held
                self.error = exc
        else:
            self._abort()
        self.done.set()

    def outcome(self, deadline: float) -> BaseException | None:
        """The shard's outcome, once every stream has stopped (a DataChannelError past ``deadline``)."""
        if not self.done.wait(max(0.0, deadline - time.monotonic())):
            return DataChannelError("the other streams of this shard did not finish before the deadline")
        return self.error


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


def recv_exact(sock: socket.socket, view: memoryview, deadline: float, on_bytes: Callable[[memoryview], object] | None = None) -> None:
    """Fill ``view`` from ``sock``; ``on_bytes`` sees every piece as it lands, in order (a running checksum)."""
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
        if on_bytes is not None:
            on_bytes(view[got : got + r])
        got += r


def send_all(
    sock: socket.socket, view: memoryview, deadline: float, on_piece: Callable[[], None] | None = None, source: FileSource = None
) -> None:
    """Send ``view`` in IO_SLICE_BYTES pieces; ``on_piece`` runs after each (fault-injection points).

    ``source``: ``(fd, offset)``, a file whose bytes from ``offset`` on are ``view``'s (a segment on the tmpfs): the
    kernel then sends its pages as they are (``sendfile``) instead of copying ``view`` into the socket first, one
    copy of every byte fewer. A TLS socket ignores it. The pages are sent by reference: they must not change until the
    receiver has read them (``await_close`` on a transfer that gets no answer)."""
    by_file = source is not None and by_reference(sock, source[0])
    for off in range(0, len(view), IO_SLICE_BYTES):
        _set_deadline(sock, deadline)
        piece = min(IO_SLICE_BYTES, len(view) - off)
        try:
            if by_file:
                assert source is not None
                _sendfile_exact(sock, source[0], source[1] + off, piece, deadline)
            else:
                sock.sendall(view[off : off + piece])
        except OSError as exc:
            raise DataChannelError(f"data channel send failed at byte {off} of {len(view)}: {exc}") from None
        if on_piece:
            on_piece()


def by_reference(sock: socket.socket, source_fd: int | None) -> bool:
    """Whether a send from ``source_fd`` on ``sock`` goes by reference (``sendfile``): a plain socket (TLS copies)."""
    return source_fd is not None and not isinstance(sock, ssl.SSLSocket)


def _sendfile_exact(sock: socket.socket, fd: int, offset: int, count: int, deadline: float) -> None:
    """``count`` bytes of file ``fd`` from ``offset`` into ``sock`` (non-blocking once it has a timeout: wait for room)."""
    poller = None  # made only when the socket's buffer is full
    end = offset + count
    while offset < end:
        try:
            sent = os.sendfile(sock.fileno(), fd, offset, end - offset)
        except BlockingIOError:
            if poller is None:
                poller = select.poll()
                poller.register(sock, select.POLLOUT)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(remaining * 1000):
                raise DataChannelError("data channel transfer exceeded its deadline") from None
            continue
        if sent == 0:
            raise DataChannelError(f"the segment file ends at byte {offset}, before the {count} bytes asked for")
        offset += sent


def await_close(sock: socket.socket, deadline: float) -> None:
    """Wait until the receiver has closed its end: it read everything it wanted (a pull gets no answer, and bytes sent
    from a file by reference must not change until then). Anything it sends is dropped; a reset counts as closed."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
    while True:
        _set_deadline(sock, deadline)
        try:
            if not sock.recv(4096):
                return
        except OSError as exc:
            if isinstance(exc, (TimeoutError, socket.timeout)):
                raise DataChannelError("the receiver did not close the data connection before the deadline") from None
            return


def send_chunks(
    sock: socket.socket,
    shard: memoryview,
    chunk_size: int,
    chunks: tuple[int, int],
    deadline: float,
    sums: StreamedChecksums | None = None,
    on_piece: Callable[[], None] | None = None,
    ready: Callable[[int], None] | None = None,
    source_fd: int | None = None,
) -> None:
    """Send the chunks ``[first, end)`` of ``shard``; with ``sums``, each chunk is hashed just before it goes and its
    checksum follows it, so hashing chunk i+1 overlaps chunk i on the wire (``receive_verified(streamed=)``).
    ``ready(end)``: blocks until the shard's first ``end`` bytes are final (a capture still being written), or raises.
    ``source_fd``: a file holding ``shard`` from its first byte, sent from by reference (``send_all(source=)``)."""

    def at(offset: int) -> FileSource:
        return None if source_fd is None else (source_fd, offset)

    off, length = byte_span(len(shard), chunk_size, chunks)
    if sums is None:
        if ready is not None:
            ready(off + length)
        send_all(sock, shard[off : off + length], deadline, on_piece, at(off))
        return
    for index in range(*chunks):
        start = index * chunk_size
        if ready is not None:
            ready(min(len(shard), start + chunk_size))
        value = sums.of(index, shard)
        send_all(sock, shard[start : min(len(shard), start + chunk_size)], deadline, on_piece, at(start))
        send_all(sock, memoryview(CHECKSUM.pack(value)), deadline)


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
    chunks: tuple[int, int] | None = None,
    streamed: list[int] | None = None,
) -> None:
    """Read the shard's bytes into ``dest`` chunk by chunk, verifying each; StreamError on a mismatch.

    ``fault_ahead``: ``dest`` is fresh memory; a second thread faults its pages in ahead of the socket
    (``FaultAhead``), so allocating and zeroing them overlaps the transfer instead of adding to it.
    ``chunks``: this stream carries only the chunks ``[first, end)`` (one of several parallel streams).
    ``streamed``: each chunk is followed by its checksum, verified against and recorded here (the manifest's are
    placeholders).
    """
    out = memoryview(dest)
    first, end = chunks if chunks is not None else (0, chunk_count(manifest.nbytes, manifest.chunk_size))
    start, length = byte_span(manifest.nbytes, manifest.chunk_size, (first, end))
    ahead = FaultAhead(out[start : start + length]) if fault_ahead else None
    try:
        for index, (off, length) in enumerate(chunk_spans(manifest.nbytes, manifest.chunk_size)):
            if not first <= index < end:
                continue
            running = running_checksum()  # each piece hashed as it lands, still in cache
            recv_exact(sock, out[off : off + length], deadline, running.update)
            if streamed is None:
                check_chunk(manifest, index, running.intdigest(), where=" on the data channel")
            else:
                trailer = bytearray(CHECKSUM.size)
                recv_exact(sock, memoryview(trailer), deadline)
                (streamed[index],) = CHECKSUM.unpack(trailer)
                check_chunk(manifest, index, running.intdigest(), " on the data channel", expected=streamed[index])
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


def push_part(
    sock: socket.socket,
    ticket: bytes,
    shard: memoryview,
    chunk_size: int,
    chunks: tuple[int, int],
    deadline: float,
    sums: StreamedChecksums | None = None,
    on_piece: Callable[[], None] | None = None,
    ready: Callable[[int], None] | None = None,
    source_fd: int | None = None,
) -> str | None:
    """One stream of a push: the ticket, the chunks ``[first, end)`` (``send_chunks``), then the receiver's answer:
    None if it stored the shard, else its error. A send that fails because the receiver refused the shard and closed
    returns that refusal where it can still be read."""
    sock.sendall(ticket)
    try:
        send_chunks(sock, shard, chunk_size, chunks, deadline, sums, on_piece, ready, source_fd)
    except StreamAborted:
        raise
    except DataChannelError:
        error = refusal(sock)
        if error is None:
            raise
        return error
    return read_status(sock, deadline)


def refusal(sock: socket.socket, wait: float = 1.0) -> str | None:
    """After a send failed: the refusal the receiver sent before it closed, if it can still be read, else None."""
    try:
        return read_status(sock, time.monotonic() + wait)
    except DataChannelError:
        return None


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
