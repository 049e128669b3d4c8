"""The bulk data channel: one-time tickets issued over gRPC, and the transfers they admit."""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import time

from memstore.core.model import Manifest, ShardKey, TransferHeader
from memstore.errors import (
    ShardNotFound,
)
from memstore.faults import fault
from memstore.server.catalog import (
    Ticket,
    sender_error,
)
from memstore.server.saving import Saving
from memstore.v1.datachannel import TICKET_BYTES, receive_verified, send_all, send_status

log = logging.getLogger(__name__)


class DataPath(Saving):
    """Pushes and pulls of shard bytes over the raw TCP data channel."""

    def prepare_receive(self, header: TransferHeader) -> bytes:
        """Reserve memory for a shard that will arrive on the data channel; returns its one-time ticket."""
        inbound = self._begin_receive(header)
        ticket = secrets.token_bytes(TICKET_BYTES)
        deadline = time.monotonic() + 10.0 + inbound.manifest.nbytes / self.config.transfer_min_rate
        with self._lock:
            self._tickets[ticket] = Ticket(deadline, inbound=inbound)
        return ticket

    def prepare_send(self, key: ShardKey) -> tuple[Manifest, bytes]:
        """Pin a verified copy to be read from the data channel; returns (manifest, ticket)."""
        entry = self._readable(key)
        if not self._pin(entry):
            raise ShardNotFound(f"shard {key} was evicted while preparing to send it")
        assert entry.manifest is not None
        ticket = secrets.token_bytes(TICKET_BYTES)
        with self._lock:
            self._tickets[ticket] = Ticket(time.monotonic() + 10.0 + entry.nbytes / self.config.transfer_min_rate, outbound=entry)
        return entry.manifest, ticket

    def serve_ticket(self, ticket: bytes, sock: socket.socket) -> None:
        """Run the transfer a ticket was issued for, on an accepted data connection."""
        with self._lock:
            t = self._tickets.pop(ticket, None)
        if t is None:
            log.warning("data channel: unknown or expired ticket; closing the connection")
            return
        if t.outbound is not None:
            try:
                send_all(sock, t.outbound.segment.view(t.outbound.nbytes), t.deadline, on_piece=lambda: fault("serve.after_chunk"))
            finally:
                self._unpin(t.outbound)
            return
        assert t.inbound is not None
        try:
            receive_verified(sock, t.inbound.manifest, t.inbound.segment.view(), t.deadline, on_chunk=lambda: fault("receive.after_chunk"))
        except BaseException as exc:
            self._abort_receive(t.inbound)
            err = sender_error(exc)
            with contextlib.suppress(OSError):
                send_status(sock, f"{getattr(err, 'status', 'UNAVAILABLE')}: {err}")
            return
        self._finish_receive(t.inbound)
        send_status(sock, None)

    def _expire_tickets(self) -> None:
        now = time.monotonic()
        with self._lock:
            stale = [k for k, t in self._tickets.items() if t.deadline < now]
            expired = [self._tickets.pop(k) for k in stale]
        for t in expired:
            if t.inbound is not None:
                self._abort_receive(t.inbound)
            if t.outbound is not None:
                self._unpin(t.outbound)
