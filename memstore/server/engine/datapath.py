"""The bulk data channel: one-time tickets issued over gRPC, and the transfers they admit (``memstore.server.engine.tickets``)."""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import time
from dataclasses import replace

from memstore.config import StoreConfig
from memstore.core.model import Manifest, ShardKey, TransferHeader
from memstore.errors import DataChannelError, ShardNotFound
from memstore.faults import fault
from memstore.server.engine.catalog import Catalog
from memstore.server.engine.entries import sender_error
from memstore.server.engine.saving import Saver
from memstore.server.engine.tickets import Ticket, Tickets
from memstore.v1.datachannel import (
    TICKET_BYTES,
    Parts,
    abort_check,
    await_close,
    by_reference,
    granted_streams,
    part_spans,
    receive_verified,
    send_chunks,
    send_status,
)

log = logging.getLogger(__name__)


class DataPath:
    """Pushes and pulls of shard bytes over the raw TCP data channel.

    A receive is the saver's (``Saver.begin_receive`` / ``finish_receive``) with the bytes arriving on one or
    more data connections (parallel streams, one ticket each, sharing a ``Parts``); a send pins a verified copy
    once per stream until that connection has read its part. It owns the tickets (``Tickets``): whoever takes one
    out (a data connection, expiry, a send given up) releases what it holds.
    """

    def __init__(self, catalog: Catalog, saver: Saver, config: StoreConfig) -> None:
        self.catalog = catalog
        self.saver = saver
        self.config = config
        self.tickets = Tickets()

    def _deadline(self, nbytes: int) -> float:
        return time.monotonic() + 10.0 + nbytes / self.config.transfer_min_rate

    def prepare_receive(self, header: TransferHeader, streams: int = 1, checksums_follow: bool = False) -> bytes:
        """Reserve memory for a shard that will arrive on the data channel in up to ``streams`` parallel streams;
        returns one 16-byte one-time ticket per stream, concatenated. ``checksums_follow``: the header's checksums are
        placeholders, each chunk's comes after it on the data connection and the registered manifest carries those."""
        inbound = self.saver.begin_receive(header)
        m = inbound.manifest
        spans = part_spans(m.nbytes, m.chunk_size, granted_streams(streams, m.nbytes, m.chunk_size, self.config.transfer_streams))
        deadline = self._deadline(m.nbytes)

        def finish() -> None:
            if parts.checksums is not None:
                inbound.manifest = replace(m, checksums=tuple(parts.checksums))
            self.saver.finish_receive(inbound)

        parts = Parts(len(spans), finish, lambda: self.saver.abort_receive(inbound))
        if checksums_follow:
            parts.checksums = [0] * len(m.checksums)
        tickets = [secrets.token_bytes(TICKET_BYTES) for _ in spans]
        for ticket, chunks in zip(tickets, spans, strict=True):
            self.tickets.add(ticket, Ticket(deadline, inbound=inbound, chunks=chunks, parts=parts))
        return b"".join(tickets)

    def prepare_send(self, key: ShardKey, streams: int = 1) -> tuple[Manifest, bytes]:
        """Pin a verified copy to be read from the data channel in up to ``streams`` parallel streams;
        returns (manifest, one 16-byte ticket per stream, concatenated)."""
        entry = self.catalog.readable(key)
        assert entry.manifest is not None
        chunk_size = entry.manifest.chunk_size
        spans = part_spans(entry.nbytes, chunk_size, granted_streams(streams, entry.nbytes, chunk_size, self.config.transfer_streams))
        deadline = self._deadline(entry.nbytes)
        tickets: list[bytes] = []
        for chunks in spans:
            if not self.catalog.pin(entry):
                for ticket in tickets:  # never served: unpin what they held
                    if self.tickets.take(ticket) is not None:
                        self.catalog.unpin(entry)
                raise ShardNotFound(f"shard {key} was evicted while preparing to send it")
            tickets.append(secrets.token_bytes(TICKET_BYTES))
            self.tickets.add(tickets[-1], Ticket(deadline, outbound=entry, chunks=chunks))
        return entry.manifest, b"".join(tickets)

    def expire_tickets(self, now: float) -> None:
        """Tickets nobody used before their deadline (the janitor asks): their memory goes back, their copies are unpinned."""
        for t in self.tickets.expired(now):
            if t.parts is not None:  # one of an inbound shard's streams: the last to stop frees the memory
                t.parts.end(DataChannelError("a stream's ticket expired unused"))
            elif t.inbound is not None:
                self.saver.abort_receive(t.inbound)
            if t.outbound is not None:
                self.catalog.unpin(t.outbound)

    def serve_ticket(self, ticket: bytes, sock: socket.socket) -> None:
        """Run the transfer (or the part of it) a ticket was issued for, on an accepted data connection."""
        t = self.tickets.take(ticket)
        if t is None:
            log.warning("data channel: unknown or expired ticket; closing the connection")
            return
        if t.outbound is not None:
            entry = t.outbound
            try:
                assert entry.manifest is not None and t.chunks is not None
                view = entry.segment.view(entry.nbytes)
                with entry.segment.opened() as fd:
                    send_chunks(sock, view, entry.manifest.chunk_size, t.chunks, t.deadline, on_piece=lambda: fault("serve.after_chunk"),
                                source_fd=fd)  # fmt: skip
                    if by_reference(sock, fd):
                        await_close(sock, t.deadline)  # the pages went by reference: unpinned only once they are read
            finally:
                self.catalog.unpin(entry)
            return
        assert t.inbound is not None and t.parts is not None
        parts, check = t.parts, abort_check(t.parts.failed)

        def on_chunk() -> None:
            fault("receive.after_chunk")
            check()

        try:
            view = t.inbound.segment.view()
            receive_verified(sock, t.inbound.manifest, view, t.deadline, on_chunk=on_chunk, chunks=t.chunks, streamed=parts.checksums)
        except BaseException as exc:
            parts.end(exc)
        else:
            parts.end()
        error = parts.outcome(t.deadline)
        if error is None:
            send_status(sock, None)
            return
        err = sender_error(error)
        with contextlib.suppress(OSError):
            send_status(sock, f"{getattr(err, 'status', 'UNAVAILABLE')}: {err}")
