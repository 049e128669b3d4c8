"""Serve the same-host control channel (``memstore.v1.local_control``) on a Unix-domain socket.

Each request is handed to the gRPC servicer's own method with a small context that carries the token and
turns ``abort`` into a status frame, so validation, errors, authentication and the RPC metrics are the
gRPC path's. One thread per connection, so calls never wait on each other here: a trainer keeps a few open, one per
call it has in flight (``trainer_client.transport.local_control_client.LocalStub``), and a ``WaitCommitted`` blocked in the
store (on the catalog's condition, which it releases while it waits) delays no other call, of that trainer or of another
rank. Connections beyond ``MAX_CONNECTIONS`` are closed at once (a client sees UNAVAILABLE on them).

The socket lives next to the store's segment directory (``<shm_dir>/<host_id>-<port>.sock``), with the
directory's permissions: whoever may map the store's segments may also call it here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from typing import Any, NoReturn

import grpc

from memstore.v1.local_control import METHODS, OK, FrameError, error_payload, recv_request, send_response
from memstore.v1.security import AUTH_METADATA_KEY

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 256  # e.g. 8 ranks x LocalStub's 8 calls in flight, with room to spare


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _Context:
    """What the servicer's handlers use of a ``grpc.ServicerContext``."""

    def __init__(self, token: str) -> None:
        self._metadata = ((AUTH_METADATA_KEY, f"Bearer {token}"),) if token else ()
        self.trailing: Any = ()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def set_trailing_metadata(self, metadata: Any) -> None:
        self.trailing = metadata

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise _Aborted(code, details)

    def is_active(self) -> bool:
        return True

    def time_remaining(self) -> float | None:
        return None

    def peer(self) -> str:
        return "unix:"


def control_socket_path(segment_dir: str) -> str:
    """Where the store of ``segment_dir`` listens ('' without a segment dir)."""
    return f"{segment_dir.rstrip('/')}.sock" if segment_dir else ""


class LocalControlServer:
    """Accepts connections on ``path`` and answers their requests through ``servicer``."""

    def __init__(self, path: str, servicer: Any) -> None:
        self.path = path
        self._servicer = servicer
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a socket file left by a store that was killed (the segment dir's lock is already ours)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(path)
            os.chmod(path, 0o600)
            self._sock.listen(64)
        except OSError:
            self._sock.close()
            raise
        self._thread = threading.Thread(target=self._accept_loop, name="local-control", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                if len(self._conns) >= MAX_CONNECTIONS:
                    conn.close()
                    continue
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="local-control-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._closed.is_set():
                try:
                    method, token, message = recv_request(conn)
                except (FrameError, OSError):
                    return  # the client went away (or spoke garbage): drop the connection
                status, payload = self._answer(method, token, message)
                send_response(conn, status, payload)
        except OSError:
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _answer(self, method: int, token: str, message: bytes) -> tuple[int, bytes]:
        spec = METHODS.get(method)
        if spec is None:
            return grpc.StatusCode.UNIMPLEMENTED.value[0], error_payload(f"unknown control method {method}")
        name, request_type, _ = spec
        try:
            request = request_type.FromString(message)
        except Exception:  # a malformed message: what gRPC would refuse before the handler
            return grpc.StatusCode.INVALID_ARGUMENT.value[0], error_payload(f"{name}: request is not a valid {request_type.__name__}")
        context = _Context(token)
        try:
            response = getattr(self._servicer, name)(request, context)
        except _Aborted as exc:
            return exc.code.value[0], error_payload(exc.details, context.trailing)
        return OK, response.SerializeToString()
