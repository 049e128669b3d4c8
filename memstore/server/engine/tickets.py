"""The data channel's one-time tickets: what each 16-byte ticket issued over gRPC admits on a data connection.

``DataPath`` (``memstore.server.engine.datapath``) owns the one ``Tickets`` of a store: it issues a ticket per stream of a
transfer (``PrepareReceive``, ``PrepareSend``), takes it back when a data connection presents it, and releases what
the tickets nobody used before their deadline held (the janitor asks it to, ``DataPath.expire_tickets``).

Lock: its own, a leaf (nothing else is taken under it). That is enough: a ticket refers to the engine's state (an
inbound transfer's memory, a pinned copy) but its issue and its end are each one step on this map alone; whoever takes
a ticket out (``take``, or ``expired``) owns what it holds and releases that afterwards, through the catalog and the
saver, which take their own locks. A ticket is taken out once, so what it holds is released once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from memstore.server.engine.entries import Entry, Inbound
from memstore.v1.datachannel import Parts


@dataclass
class Ticket:
    deadline: float
    inbound: Inbound | None = None
    outbound: Entry | None = None
    chunks: tuple[int, int] | None = None  # one of parallel streams: the chunks [first, end) it carries (None: all)
    parts: Parts | None = None  # an inbound stream's shard-wide outcome (memstore.v1.datachannel.Parts)


class Tickets:
    """The tickets issued and not yet used or expired, by their 16 bytes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._issued: dict[bytes, Ticket] = {}

    def add(self, ticket: bytes, issued: Ticket) -> None:
        with self._lock:
            self._issued[ticket] = issued

    def take(self, ticket: bytes) -> Ticket | None:
        """The transfer a ticket was issued for (once: the ticket is gone after); None if unknown, used or expired."""
        with self._lock:
            return self._issued.pop(ticket, None)

    def expired(self, now: float) -> list[Ticket]:
        """Take out the tickets whose deadline passed before ``now``: the caller releases what they hold."""
        with self._lock:
            stale = [k for k, t in self._issued.items() if t.deadline < now]
            return [self._issued.pop(k) for k in stale]

    def __len__(self) -> int:
        with self._lock:
            return len(self._issued)
