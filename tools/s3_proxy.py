"""An HTTP fault proxy in front of an S3 endpoint (e.g. :class:`tools.s3_server.MotoServer`): pass,
throttle (503 SlowDown, as S3 answers a request rate it will not serve), or be down (connections refused).

    proxy = S3FaultProxy(("127.0.0.1", moto.port)).start()   # http://127.0.0.1:<port> -> moto
    proxy.set("throttle", every=2)    # every 2nd request answered 503 SlowDown (the rest pass)
    proxy.set("down")                 # the port refuses connections; open ones are cut
    proxy.set("pass")
    proxy.close()

Requests are read whole (Content-Length or chunked body) and forwarded one by one over HTTP/1.1, so a
throttled request is answered as S3 answers it (an XML error body with code SlowDown, the connection kept),
and the client's retry is a new request. The objects live upstream: an outage here loses none of them.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
from http.server import BaseHTTPRequestHandler
from typing import Any

MODES = ("pass", "throttle", "down")
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "expect"}
SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>'
    b"<RequestId>memstore-s3-fault-proxy</RequestId></Error>"
)


def throttled(index: int, every: int) -> bool:
    """Whether request number ``index`` (0, 1, 2, ... since the mode was set) is answered 503: every ``every``-th one
    (``every=1``: all of them; ``every=2``: the 2nd, 4th, ...)."""
    return every >= 1 and (index + 1) % every == 0


class S3FaultProxy:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.mode = "pass"
        self.every = 0
        self.requests = 0  # requests seen since the mode was set
        self.answered_503 = 0  # throttled requests so far
        self.forwarded = 0  # requests passed upstream so far
        self.port = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> S3FaultProxy:
        self._listen()
        return self

    def set(self, mode: str, every: int = 2) -> None:
        """Switch to ``mode`` (see the module's docstring); ``every``: which requests ``throttle`` answers 503."""
        if mode not in MODES:
            raise ValueError(f"unknown S3 proxy mode {mode!r}: expected one of {', '.join(MODES)}")
        if mode == "throttle" and every < 1:
            raise ValueError(f"throttle every {every!r}: expected a count >= 1")
        with self._lock:
            was, self.mode, self.every, self.requests = self.mode, mode, every, 0
        if mode == "down" and was != "down":
            self._unlisten()
        elif mode != "down" and was == "down":
            self._listen()

    def close(self) -> None:
        self._stop.set()
        self._unlisten()
        for t in self._threads:
            t.join(timeout=5)

    # -- connections ------------------------------------------------------------------------
    def _listen(self) -> None:
        """Listen on our port (the same one again after an outage)."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        self._spawn(self._accept, listener)

    def _unlisten(self) -> None:
        """Refuse new connections and cut the open ones."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            conns, self._conns = self._conns, set()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)

    def _spawn(self, target: Any, *args: Any) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        t.start()
        self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _accept(self, listener: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                conn, addr = listener.accept()
            except OSError:
                return  # closed: down, or the proxy closed
            with self._lock:
                self._conns.add(conn)
            self._spawn(self._serve, conn, addr)

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        upstream = http.client.HTTPConnection(*self.target, timeout=60)
        try:
            _Handler(conn, addr, self, upstream)
        except OSError:
            pass  # cut by an outage, or the client went away
        finally:
            upstream.close()
            with self._lock:
                self._conns.discard(conn)
            with contextlib.suppress(OSError):
                conn.close()

    def _decide(self) -> bool:
        """Count one request; True if it is to be answered 503."""
        with self._lock:
            index, self.requests = self.requests, self.requests + 1
            answer_503 = self.mode == "throttle" and throttled(index, self.every)
            if answer_503:
                self.answered_503 += 1
            else:
                self.forwarded += 1
        return answer_503


class _Handler(BaseHTTPRequestHandler):
    """One client connection: each request read whole, then answered 503 SlowDown or forwarded upstream."""

    protocol_version = "HTTP/1.1"  # keep-alive, and ``Expect: 100-continue`` answered before the body is read

    def __init__(self, conn: socket.socket, addr: Any, proxy: S3FaultProxy, upstream: http.client.HTTPConnection) -> None:
        self.proxy = proxy
        self.upstream = upstream
        super().__init__(conn, addr, None)  # type: ignore[arg-type]  # handles the connection until it closes

    def log_message(self, format: str, *args: Any) -> None:
        return None

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _handle(self) -> None:
        body = self._body()
        if self.proxy._decide():
            self._reply(503, [("Content-Type", "application/xml"), ("x-amz-request-id", "memstore-s3-fault-proxy")], SLOW_DOWN)
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        headers["Content-Length"] = str(len(body))
        try:
            self.upstream.request(self.command, self.path, body=body or None, headers=headers)
            resp = self.upstream.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException):
            self.upstream.close()
            self.close_connection = True
            return  # as an endpoint that went away: the client sees the connection closed
        kept = [(k, v) for k, v in resp.getheaders() if k.lower() not in HOP_BY_HOP | {"content-length"}]
        self._reply(resp.status, kept, data, length=resp.getheader("Content-Length"))

    def _reply(self, status: int, headers: list[tuple[str, str]], data: bytes, length: str | None = None) -> None:
        self.send_response_only(status)
        for k, v in headers:
            self.send_header(k, v)
        head = self.command == "HEAD"
        self.send_header("Content-Length", length if head and length is not None else str(len(data)))
        self.end_headers()
        if not head:
            self.wfile.write(data)
        self.wfile.flush()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle
