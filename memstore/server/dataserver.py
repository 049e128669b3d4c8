"""The listening side of the bulk data channel (see ``memstore.v1.datachannel``).

One accept thread; each connection gets a thread that reads the 16-byte ticket and hands the socket
to the store, which runs the transfer the ticket was issued for over gRPC. A connection with an
unknown ticket, or that sends nothing within a few seconds, is closed.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading

from memstore.errors import ConfigError
from memstore.server.store import Store
from memstore.v1 import datachannel

log = logging.getLogger(__name__)
TICKET_READ_SECONDS = 5.0
MAX_CONNECTIONS_PER_ADDRESS = 64  # concurrent data connections from one remote address; more are closed at once


class DataServer:
    def __init__(self, host: str, store: Store, tls: ssl.SSLContext | None = None, port: int = 0) -> None:
        self.store = store
        self._tls = tls  # serve TLS (and require client certificates when the context does)
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host.strip("[]"), port))
        except OSError as exc:
            self._sock.close()
            raise ConfigError(f"--data-port {port}: cannot bind the data channel on {host}: {exc.strerror}") from None
        self._sock.listen(64)
        self.port: int = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="data-accept", daemon=True)
        self._open: dict[str, int] = {}  # remote address -> connections being served
        self._open_lock = threading.Lock()

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, remote = self._sock.accept()
            except OSError:
                return
            address = str(remote[0])
            with self._open_lock:
                count = self._open.get(address, 0)
                if count < MAX_CONNECTIONS_PER_ADDRESS:
                    self._open[address] = count + 1
            if count >= MAX_CONNECTIONS_PER_ADDRESS:
                log.warning("data channel: %s has %d connections open (limit %d); closing a new one", address, count,
                            MAX_CONNECTIONS_PER_ADDRESS)  # fmt: skip
                conn.close()
                continue
            threading.Thread(target=self._serve_counted, args=(conn, address), name="data-conn", daemon=True).start()

    def _serve_counted(self, conn: socket.socket, address: str) -> None:
        try:
            self._serve(conn)
        finally:
            with self._open_lock:
                self._open[address] -= 1
                if not self._open[address]:
                    del self._open[address]

    def _serve(self, conn: socket.socket) -> None:
        import time

        try:
            datachannel.tune(conn)
            if self._tls is not None:
                conn.settimeout(TICKET_READ_SECONDS)
                try:
                    conn = self._tls.wrap_socket(conn, server_side=True)  # takes the connection over
                except (ssl.SSLError, OSError) as exc:
                    log.info("data connection refused: TLS handshake failed: %s", exc)
                    return
            ticket = bytearray(datachannel.TICKET_BYTES)
            datachannel.recv_exact(conn, memoryview(ticket), time.monotonic() + TICKET_READ_SECONDS)
            self.store.serve_ticket(bytes(ticket), conn)
        except datachannel.DataChannelError as exc:
            log.info("data connection dropped: %s", exc)
        except Exception:
            log.exception("data connection failed")
        finally:
            conn.close()
