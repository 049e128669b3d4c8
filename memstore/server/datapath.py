"""The bulk data channel: one-time tickets issued over gRPC, and the transfers they admit."""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import time

from memstore.config import StoreConfig
from memstore.core.model import Manifest, ShardKey, TransferHeader
from memstore.errors import (
    ShardNotFound,
)
from memstore.faults import fault
from memstore.server.catalog import Catalog
from memstore.server.entries import Ticket, sender_error
from memstore.server.saving import Saver
from memstore.v1.datachannel import TICKET_BYTES, receive_verified, send_all, send_status

log = logging.getLogger(__name__)


class DataPath:
    """Pushes and pulls of shard bytes over the raw TCP data channel.

    A receive is the saver's (``Saver.begin_receive`` / ``finish_receive``) with the bytes arriving on a data
    connection; a send pins a verified copy until the connection has read it. The catalog holds the tickets.
    """

    def __init__(self, catalog: Catalog, saver: Saver, config: StoreConfig) -> None:
        self.catalog = catalog
        self.saver = saver
        self.config = config

    def _deadline(self, nbytes: int) -> float:
        return time.monotonic() + 10.0 + nbytes / self.config.transfer_min_rate

    def prepare_receive(self, header: TransferHeader) -> bytes:
        """Reserve memory for a shard that will arrive on the data channel; returns its one-time ticket."""
        inbound = self.saver.begin_receive(header)
        ticket = secrets.token_bytes(TICKET_BYTES)
        self.catalog.add_ticket(ticket, Ticket(self._deadline(inbound.manifest.nbytes), inbound=inbound))
        return ticket

    def prepare_send(self, key: ShardKey) -> tuple[Manifest, bytes]:
        """Pin a verified copy to be read from the data channel; returns (manifest, ticket)."""
        entry = self.catalog.readable(key)
        if not self.catalog.pin(entry):
            raise ShardNotFound(f"shard {key} was evicted while preparing to send it")
        assert entry.manifest is not None
        ticket = secrets.token_bytes(TICKET_BYTES)
        self.catalog.add_ticket(ticket, Ticket(self._deadline(entry.nbytes), outbound=entry))
        return entry.manifest, ticket

    def serve_ticket(self, ticket: bytes, sock: socket.socket) -> None:
        """Run the transfer a ticket was issued for, on an accepted data connection."""
        t = self.catalog.take_ticket(ticket)
        if t is None:
            log.warning("data channel: unknown or expired ticket; closing the connection")
            return
        if t.outbound is not None:
            try:
                send_all(sock, t.outbound.segment.view(t.outbound.nbytes), t.deadline, on_piece=lambda: fault("serve.after_chunk"))
            finally:
                self.catalog.unpin(t.outbound)
            return
        assert t.inbound is not None
        try:
            receive_verified(sock, t.inbound.manifest, t.inbound.segment.view(), t.deadline, on_chunk=lambda: fault("receive.after_chunk"))
        except BaseException as exc:
            self.catalog.abort_inbound(t.inbound)
            err = sender_error(exc)
            with contextlib.suppress(OSError):
                send_status(sock, f"{getattr(err, 'status', 'UNAVAILABLE')}: {err}")
            return
        self.saver.finish_receive(t.inbound)
        send_status(sock, None)
