"""The S3 fault proxy of the recovery matrix (tools/s3_proxy.py) against a small HTTP server on loopback:
requests pass whole, throttled ones are answered 503 SlowDown as S3 does, and "down" refuses connections."""

from __future__ import annotations

import http.client
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tools.s3_proxy import S3FaultProxy, throttled

pytestmark = pytest.mark.unit


class _Echo(BaseHTTPRequestHandler):
    """Answers every request with its method, path and body, and a header the proxy must pass back."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        return None

    def _answer(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        data = f"{self.command} {self.path} ".encode() + body
        self.send_response(200)
        self.send_header("ETag", '"abc"')
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_HEAD = _answer


@pytest.fixture
def proxy() -> Iterator[S3FaultProxy]:
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=upstream.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    p = S3FaultProxy(("127.0.0.1", upstream.server_address[1])).start()
    try:
        yield p
    finally:
        p.close()
        upstream.shutdown()
        upstream.server_close()
        thread.join(timeout=5)


def _request(conn: http.client.HTTPConnection, method: str, path: str, body: bytes | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, bytes, http.client.HTTPResponse]:  # fmt: skip
    conn.request(method, path, body=body, headers=headers or {})
    resp = conn.getresponse()
    return resp.status, resp.read(), resp


def test_which_requests_are_throttled() -> None:
    assert [throttled(i, 2) for i in range(6)] == [False, True, False, True, False, True]
    assert all(throttled(i, 1) for i in range(5))
    assert [throttled(i, 3) for i in range(6)] == [False, False, True, False, False, True]


def test_requests_pass_whole_on_one_connection(proxy: S3FaultProxy) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
    status, data, resp = _request(conn, "PUT", "/ckpt/a", b"x" * 100_000)
    assert (status, data, resp.getheader("ETag")) == (200, b"PUT /ckpt/a " + b"x" * 100_000, '"abc"')
    conn.putrequest("PUT", "/ckpt/chunked")  # a chunked body is read whole and forwarded with its length
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    conn.send(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    assert conn.getresponse().read() == b"PUT /ckpt/chunked abcde"
    status, data, resp = _request(conn, "HEAD", "/ckpt/a")
    assert (status, data, resp.getheader("Content-Length")) == (200, b"", str(len("HEAD /ckpt/a ")))
    assert _request(conn, "GET", "/ckpt/b?x=1")[:2] == (200, b"GET /ckpt/b?x=1 ")
    assert proxy.forwarded == 4 and proxy.answered_503 == 0


def test_throttle_answers_slowdown_and_keeps_the_connection(proxy: S3FaultProxy) -> None:
    proxy.set("throttle", every=2)
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
    answers = [_request(conn, "PUT", f"/ckpt/{i}", b"body", {"Expect": "100-continue"})[:2] for i in range(4)]
    assert [status for status, _ in answers] == [200, 503, 200, 503]
    assert b"<Code>SlowDown</Code>" in answers[1][1]
    assert (proxy.answered_503, proxy.forwarded) == (2, 2)
    proxy.set("pass")
    assert _request(conn, "GET", "/ckpt/after")[0] == 200


def test_down_refuses_connections_until_it_is_back_on_the_same_port(proxy: S3FaultProxy) -> None:
    open_conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
    assert _request(open_conn, "GET", "/ckpt/a")[0] == 200
    port = proxy.port
    proxy.set("down")
    with pytest.raises(ConnectionRefusedError):
        http.client.HTTPConnection("127.0.0.1", port, timeout=5).connect()
    with pytest.raises((OSError, http.client.HTTPException)):
        _request(open_conn, "GET", "/ckpt/a")  # the open connection was cut
    proxy.set("pass")
    assert proxy.port == port
    assert _request(http.client.HTTPConnection("127.0.0.1", port, timeout=5), "GET", "/ckpt/a")[:2] == (200, b"GET /ckpt/a ")
