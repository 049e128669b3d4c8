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

from memstore.server.store import Store
from memstore.v1 import datachannel

log = logging.getLogger(__name__)
TICKET_READ_SECONDS = 5.0


class DataServer:
    def __init__(self, host: str, store: Store, tls: ssl.SSLContext | None = None) -> None:
        self.store = store
        self._tls = tls  # serve TLS (and require client certificates when the context does)
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host.strip("[]"), 0))
        self._sock.listen(64)
        self.port: int = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="data-accept", daemon=True)

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
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="data-conn", daemon=True).start()

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
