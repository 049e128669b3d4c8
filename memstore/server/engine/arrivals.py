"""The shards on their way into this store: pulls (a restore's, a repair's, an assembly's) and inbound transfers.

``Recovery`` claims each pull (one per shard at a time: a second caller waits for the first), counts the restores
pulling now and the repairs in flight, and defers a repair to the restores; the ``Saver`` marks a shard arriving as
a stream once its memory is reserved, and registers it as it stops arriving; the ``Assembler`` asks which stripes
are wanted that are neither held nor on their way. ``Store`` builds the one ``Arrivals``; its ``busy`` is part of
``Store.foreground_busy``.

Lock: the catalog's condition (``Catalog.cond``), none of its own. What is on its way must agree with what the
catalog holds at the same instant: a repair begins only if its shard is neither held nor arriving nor being pulled
(``begin_repair``), and a received shard joins the catalog in the same step as it stops arriving
(``register_inbound``), so no repair pass sees it as neither. Under the one lock each such step is atomic, and
``begin_repair`` waits on the same condition, woken by ``fetch_ended`` and by the catalog's ``wake`` (the store stops).
Under it this object calls only the catalog's ``*_locked`` methods (the catalog's lock, then the pool's: the engine's
one order), and nothing else.
"""

from __future__ import annotations

import threading

from memstore.core.model import ShardKey
from memstore.server.engine.catalog import Catalog
from memstore.server.engine.entries import Entry, Inbound


class Arrivals:
    """The pulls claimed, the restores pulling, the repairs in flight and the inbound transfers arriving."""

    def __init__(self, catalog: Catalog, stop: threading.Event) -> None:
        """``stop``: set when the store closes; ``begin_repair``'s wait gives up then (``Catalog.wake`` wakes it)."""
        self.catalog = catalog
        self._cond = catalog.cond
        self._stop = stop
        self._pulls: dict[ShardKey, threading.Event] = {}  # in-flight pulls, shared by fetch, repair and assembly
        self._receiving: set[ShardKey] = set()  # memory reserved, bytes arriving (Saver.begin_receive)
        self._fetching = 0  # restores pulling a shard now (repair waits for them: memstore.server.engine.recovery)
        self._repairs = 0

    @property
    def repairs_in_flight(self) -> int:
        return self._repairs

    def busy(self) -> bool:
        """A shard is pulled for a restore or a repair: part of what background work yields to
        (``Store.foreground_busy``). Takes no lock: the pool's reserve asks it while it may hold its own."""
        return self._fetching > 0 or self._repairs > 0

    def _coming_locked(self, key: ShardKey) -> bool:
        return key in self._pulls or key in self._receiving

    # ---- restores and pulls (Recovery)

    def fetch_started(self) -> None:
        """A restore pulls a shard now: repair starts no new pull meanwhile."""
        with self._cond:
            self._fetching += 1

    def fetch_ended(self) -> None:
        with self._cond:
            self._fetching -= 1
            self._cond.notify_all()

    def claim_pull(self, key: ShardKey) -> threading.Event | None:
        """Claim the pull of ``key`` (None: ``end_pull`` must follow), or the event of the pull already under way."""
        with self._cond:
            pending = self._pulls.get(key)
            if pending is None:
                self._pulls[key] = threading.Event()
            return pending

    def end_pull(self, key: ShardKey) -> None:
        with self._cond:
            done = self._pulls.pop(key)
        done.set()

    def begin_repair(self, key: ShardKey, restore_first: float) -> bool:
        """Start repairing ``key``: first wait (at most ``restore_first`` seconds) for restores in flight, then False when
        it is not needed (here, arriving, being pulled, or the store stops). True: ``end_repair`` must follow."""
        with self._cond:
            # Restores first: a trainer waiting for a shard gets the links and the memory before repair does.
            self._cond.wait_for(lambda: not self._fetching or self._stop.is_set(), timeout=restore_first)
            if self.catalog.get_locked(key) is not None or self._coming_locked(key) or self._stop.is_set():
                return False
            self._repairs += 1
            return True

    def end_repair(self) -> None:
        with self._cond:
            self._repairs -= 1

    # ---- inbound transfers (Saver.begin_receive: admitted, memory reserved)

    def mark_receiving(self, key: ShardKey) -> None:
        """Memory is reserved for ``key`` and its bytes are arriving (repair does not pull it meanwhile)."""
        with self._cond:
            self._receiving.add(key)

    def end_receiving(self, key: ShardKey) -> None:
        """A transfer failed (its memory given back already): ``key`` is no longer arriving."""
        with self._cond:
            self._receiving.discard(key)

    def register_inbound(self, inbound: Inbound, entry: Entry) -> None:
        """A fully received and verified shard: ``entry`` joins the catalog in the same step as it stops arriving."""
        with self._cond:
            self._receiving.discard(inbound.key)
            self.catalog.register_locked(entry)

    # ---- assembly (the Assembler)

    def stripes_wanted(self) -> list[tuple[ShardKey, int]]:
        """The stripes the catalog lacks of its members' newest saves (``Catalog.stripes_missing_locked``) that are not
        on their way in either, with the size of the member's own stripe, in key order."""
        with self._cond:
            return [(k, nbytes) for k, nbytes in self.catalog.stripes_missing_locked() if not self._coming_locked(k)]
