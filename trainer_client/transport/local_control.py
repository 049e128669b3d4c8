"""The client end of the same-host control channel (``memstore.v1.local_control``).

``LocalStub`` has the unary save-path methods of the gRPC stub (``Allocate``, ``Commit``, ``Release``,
``WaitCommitted``, ``Open``) with the same signatures, and raises the same ``grpc.RpcError`` shape
(``code()``, ``details()``, ``trailing_metadata()``), so the client's error mapping is unchanged. One
connection, one call at a time (a lock); a call that cannot reach the socket raises UNAVAILABLE and the
connection is re-opened by the next call.
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
    """Unary store calls over the store's Unix socket at ``path``, presenting ``token``."""

    def __init__(self, path: str, token: str = "") -> None:
        self.path = path
        self._token = token
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def connect(self, timeout: float) -> None:
        """Open the connection now (raises OSError if the socket does not answer)."""
        with self._lock:
            self._connected(timeout)

    def _connected(self, timeout: float | None) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(timeout)
                sock.connect(self.path)
            except OSError:
                sock.close()
                raise
            self._sock = sock
        self._sock.settimeout(timeout)
        return self._sock

    def _drop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def call(self, name: str, request: Any, timeout: float | None = None) -> Any:
        number = NUMBERS[name]
        response_type = METHODS[number][2]
        message = request.SerializeToString()
        with self._lock:
            try:
                sock = self._connected(timeout)
            except OSError as exc:
                raise RpcFailure(grpc.StatusCode.UNAVAILABLE, f"store control socket {self.path}: {exc}", sent=False) from None
            try:
                send_request(sock, number, self._token, message)
                status, payload = recv_response(sock)
            except TimeoutError:
                self._drop()  # a late answer must not be read as the next call's
                raise RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer on {self.path} within {timeout}s") from None
            except (OSError, FrameError) as exc:
                self._drop()
                raise RpcFailure(grpc.StatusCode.UNAVAILABLE, f"store control socket {self.path}: {exc}") from None
        if status == OK:
            return response_type.FromString(payload)
        detail, metadata = parse_error(payload)
        raise RpcFailure(_CODES.get(status, grpc.StatusCode.UNKNOWN), detail, metadata)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name not in NUMBERS:
            raise AttributeError(name)
        return lambda request, timeout=None: self.call(name, request, timeout)

    def close(self) -> None:
        with self._lock:
            self._drop()
