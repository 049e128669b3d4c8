"""Leaving on purpose: before a store exits on SIGTERM or ``memstore drain``, every shard it alone holds gets another copy.

Order of events:

1. ``draining`` is set: Health and Hello say so, new saves and incoming copies are refused (``Draining``),
   repair stops pulling.
2. Replications in flight finish (their copies count).
3. The store asks every other member whether it is alive and not draining itself, and lists what they hold.
   A shard of which no such member (nor the durable tier) holds a verified copy is *alone* here.
4. Each lone shard is pushed (verified on receipt, like any replica) to a member: its slot's group peers
   first, then the others in slot order after this one. What no member takes is left to the durable tier,
   which the server flushes next when ``--spill`` is set.

With R=1 and a spill target a planned removal thus loses no committed step; with R>=2 and healthy peers
nothing is alone and the drain costs one listing round.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from memstore.config import StoreConfig
from memstore.core.model import PutOrigin, ShardKey, TransferHeader
from memstore.errors import StoreError
from memstore.server.engine.catalog import Catalog
from memstore.server.engine.entries import Entry
from memstore.server.engine.recovery import durable_holdings
from memstore.server.engine.replication import push_copy
from memstore.server.membership import Membership
from memstore.server.peers import PeerDirectory
from memstore.spill.port import DurableTier

log = logging.getLogger(__name__)


class Drainer:
    """Gives away, before the store leaves, every shard only it holds (``drain``), and says how far it got."""

    def __init__(
        self, catalog: Catalog, config: StoreConfig, membership: Membership, peers: PeerDirectory, draining: threading.Event
    ) -> None:
        self.catalog = catalog
        self.config = config
        self.host_id = config.host_id
        self.membership = membership
        self.peers = peers
        self.draining = draining
        self.durable: DurableTier | None = None  # set by the store when --spill is on: what it holds is not alone here
        self.progress = ""

    def drain(self, grace: float) -> list[str]:
        """Give every shard only this store holds another copy within ``grace`` seconds. Returns what could not be kept."""
        deadline = time.monotonic() + grace
        self.draining.set()
        self._note("waiting for replications in flight")
        while self.catalog.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        targets = self._drain_targets(deadline)
        alone = self._alone(targets)
        self._note(f"{len(alone)} shard(s) held only here; {len(targets)} member(s) can take copies")
        failures: list[str] = []
        for i, entry in enumerate(alone):
            if time.monotonic() >= deadline:
                failures.append(f"{entry.key}: drain grace of {grace:.0f}s ran out")
                continue
            where = self._give_away(entry, targets, deadline)
            if where is None:
                failures.append(f"{entry.key}: no member took a copy")
            self._note(f"copied {i + 1 - len(failures)} of {len(alone)} lone shard(s) to peers")
        log.info("drain of %s: %s; %d not copied", self.host_id, self.progress, len(failures))
        return failures

    def _note(self, progress: str) -> None:
        self.progress = progress
        log.info("drain: %s", progress)

    def _drain_targets(self, deadline: float) -> list[str]:
        """Members that can take copies (alive, not draining), group peers first, then in slot order after this host."""
        view = self.membership.view
        group = view.replication_targets()
        others = view.ring_after_me()  # starting after our slot spreads the load of successive drains
        candidates = [*group, *(h for h in others if h not in group)]

        def takes_copies(h: str) -> bool:
            try:
                return not self.peers[h].hello(timeout, fresh=True).draining  # a replacement that just started counts
            except StoreError as exc:
                log.info("drain: %s cannot take copies: %s", h, exc)
                return False

        timeout = max(0.5, min(self.config.peer_timeout, deadline - time.monotonic()))
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(candidates)))) as pool:  # all at once: dead peers cost one timeout
            answers = list(pool.map(takes_copies, candidates))
        return [h for h, ok in zip(candidates, answers, strict=True) if ok]

    def _alone(self, targets: list[str]) -> list[Entry]:
        """Settled, verified shards here of which no target member and not the durable tier holds a verified copy."""
        held = self.catalog.settled_copies()
        elsewhere: set[ShardKey] = set()
        for shards in self.peers.list_all("", self.config.peer_timeout, hosts=targets).values():
            if not isinstance(shards, StoreError):
                elsewhere.update(i.manifest.key for i in shards if i.verified and not i.cached)  # a cached copy may go any time
        if self.durable is not None:
            for job in {e.key.job_id for e in held}:
                elsewhere.update(h.key for h in durable_holdings(self.durable, job, []))
        return sorted((e for e in held if e.key not in elsewhere), key=lambda e: (-e.key.step, e.key.job_id, e.key.rank))

    def _give_away(self, entry: Entry, targets: list[str], deadline: float) -> str | None:
        assert entry.manifest is not None
        header = TransferHeader(entry.manifest, PutOrigin.REPLICA, self.host_id)
        if not self.catalog.pin(entry):
            return None
        try:
            for h in targets:
                try:
                    with entry.segment.opened() as fd:
                        view, left = entry.segment.view(entry.nbytes), max(1.0, deadline - time.monotonic())
                        push_copy(self.peers, self.config, h, header, view, left, source_fd=fd)
                    return h
                except StoreError as exc:
                    log.warning("drain: %s refused %s: %s", h, entry.key, exc)
            return None
        finally:
            self.catalog.unpin(entry)
