"""The client end of the same-host control channel (``memstore.v1.local_control``).

``LocalStub`` has the unary save-path methods of the gRPC stub (``Allocate``, ``Commit``, ``Release``,
``WaitCommitted``, ``Open``) with the same signatures, and raises the same ``grpc.RpcError`` shape
(``code()``, ``details()``, ``trailing_metadata()``), so the client's error mapping is unchanged.

Calls run concurrently: each takes an idle connection of a small pool or opens a new one (at most
``MAX_CONNECTIONS`` at once; a call beyond that waits for one, within its timeout), so a ``WaitCommitted`` that
blocks in the store for seconds (``handle.wait()`` on another thread, the floor agreement's watcher) never
delays the next save's ``Allocate``/``Commit``/``Release``. The store serves every connection on its own thread. A
connection whose call failed is closed, never reused (a late answer must not be read as the next call's); a call
that cannot reach the socket raises UNAVAILABLE with ``sent=False``.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from typing import Any

import grpc

from memstore.v1.local_control import METHODS, NUMBERS, OK, FrameError, parse_error, recv_response, send_request

_CODES = {code.value[0]: code for code in grpc.StatusCode}

MAX_CONNECTIONS = 8  # per client: calls in flight at once (a save's, a few waits, a restore's); the store takes 256 in all


class RpcFailure(grpc.RpcError):
    """A failed call that did not go through gRPC (the control socket, the data channel), shaped like a failed
    gRPC call. ``sent``: whether the request may have reached the store (if not, it can safely go another way)."""

    def __init__(self, code: grpc.StatusCode, details: str, metadata: tuple[Any, ...] = (), sent: bool = True) -> None:
        super().__init__(details)
        self.sent = sent
        self._code = code
        self._details = details
        self._metadata = metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:
        return self._metadata


class LocalStub:
    """Unary store calls over the store's Unix socket at ``path``, presenting ``token``; up to ``max_connections``
    calls at once, each on its own connection."""

    def __init__(self, path: str, token: str = "", max_connections: int = MAX_CONNECTIONS) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.path = path
        self._token = token
        self._slots = threading.BoundedSemaphore(max_connections)  # calls in flight
        self._lock = threading.Lock()  # guards the two below
        self._idle: list[socket.socket] = []  # open, no call on them
        self._open: set[socket.socket] = set()  # every connection not closed yet (idle or in a call)

    def connect(self, timeout: float) -> None:
        """Open a connection now and keep it for the next call (raises OSError if the socket does not answer)."""
        self._put(self._new(timeout))

    @property
    def connections(self) -> int:
        """Connections open now (idle or in a call)."""
        with self._lock:
            return len(self._open)

    def _new(self, timeout: float | None) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(self.path)
        except OSError:
            sock.close()
            raise
        with self._lock:
            self._open.add(sock)
        return sock

    def _take(self, timeout: float | None) -> socket.socket:
        """An idle connection, or a new one."""
        with self._lock:
            sock = self._idle.pop() if self._idle else None
        if sock is None:
            sock = self._new(timeout)
        sock.settimeout(timeout)
        return sock

    def _put(self, sock: socket.socket) -> None:
        """``sock``'s call answered: kept for the next call, unless ``close()`` came meanwhile."""
        with self._lock:
            if sock in self._open:
                self._idle.append(sock)
                return
        sock.close()

    def _drop(self, sock: socket.socket) -> None:
        with self._lock:
            self._open.discard(sock)
        with contextlib.suppress(OSError):
            sock.close()

    def call(self, name: str, request: Any, timeout: float | None = None) -> Any:
        number = NUMBERS[name]
        response_type = METHODS[number][2]
        message = request.SerializeToString()
        if not self._slots.acquire(timeout=-1 if timeout is None else timeout):
            raise RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, f"{name}: all {self.path} connections busy for {timeout}s", sent=False)
        try:
            try:
                sock = self._take(timeout)
            except OSError as exc:
                raise RpcFailure(grpc.StatusCode.UNAVAILABLE, f"store control socket {self.path}: {exc}", sent=False) from None
            try:
                send_request(sock, number, self._token, message)
                status, payload = recv_response(sock)
            except TimeoutError:
                self._drop(sock)  # a late answer must not be read as the next call's
                raise RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer on {self.path} within {timeout}s") from None
            except (OSError, FrameError) as exc:
                self._drop(sock)
                raise RpcFailure(grpc.StatusCode.UNAVAILABLE, f"store control socket {self.path}: {exc}") from None
            self._put(sock)
        finally:
            self._slots.release()
        if status == OK:
            return response_type.FromString(payload)
        detail, metadata = parse_error(payload)
        raise RpcFailure(_CODES.get(status, grpc.StatusCode.UNKNOWN), detail, metadata)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name not in NUMBERS:
            raise AttributeError(name)
        return lambda request, timeout=None: self.call(name, request, timeout)

    def close(self) -> None:
        """Close the idle connections now and those in a call when it ends (the call itself is not cut short); a
        later call opens a new one."""
        with self._lock:
            idle, self._idle = self._idle, []
            self._open.clear()
        for sock in idle:
            with contextlib.suppress(OSError):
                sock.close()
