"""Replication of owned shards to their group peers."""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future

from memstore.core.model import Manifest, PutOrigin, ShardState, TransferHeader
from memstore.errors import (
    DataChannelUnsupported,
    StoreError,
)
from memstore.faults import fault
from memstore.server.catalog import (
    Catalog,
    Entry,
)
from memstore.v1.integrity import compute_checksums

log = logging.getLogger(__name__)

CHECKSUM_WORKERS = max(1, min(4, os.cpu_count() or 1))
SUPERSEDED = "superseded"  # how a push skipped for a newer capture of the same rank starts its error


class Replication(Catalog):
    """Checksums a captured shard, pushes it to the R-1 group peers and settles it (COMMITTED or UNDER_REPLICATED)."""

    def foreground_busy(self) -> bool:
        """A trainer is copying a save in (an open allocation) or a shard is being checksummed/replicated."""
        return any(not lease.ahead for lease in self._alloc_leases.values()) or self._in_flight > 0

    def _in_flight_add(self, n: int) -> None:
        with self._lock:
            self._in_flight += n

    def _capture_and_replicate(self, entry: Entry) -> None:
        with self._lock:
            superseded = entry.dropped
            entry.checksumming = True
        if superseded:  # a newer save of its rank came first (Saving._supersede_older)
            self._in_flight_add(-1)
            self._retention_due.set()
            return
        try:
            if entry.manifest is None:
                # On threads (xxhash lets go of the GIL): the time from save() to committed includes this pass.
                checksums = compute_checksums(entry.segment.view(), entry.nbytes, self.config.chunk_bytes, workers=CHECKSUM_WORKERS)
                manifest = Manifest(
                    key=entry.key,
                    world_size=entry.world_size,
                    nbytes=entry.nbytes,
                    chunk_size=self.config.chunk_bytes,
                    checksums=tuple(checksums),
                    owner_host=self.host_id,
                    format_version=entry.format_version,
                    metrics=entry.metrics,
                    created_unix=entry.created_unix,
                    spill_codec=entry.spill_codec,
                )
                with self._lock:
                    entry.manifest = manifest
                    entry.state = ShardState.REPLICATING
                    self._lock.notify_all()
            self._replicate(entry)
        except Exception as exc:  # never lose the local copy because replication broke
            log.exception("replication of %s failed", entry.key)
            self._settle(entry, copies=1, errors=[f"internal error: {exc}"])
        finally:
            self._in_flight_add(-1)

    def _replicate(self, entry: Entry) -> None:
        view = self.membership.view
        peers = view.replication_targets()
        if not peers:
            held = len(view.table.members())
            why = f"the slot table (v{view.table.version}) holds {held} store(s): no group peer to copy to yet"
            self._settle(entry, copies=1, errors=[why] if self.config.replicas > 1 else [])
            return
        assert entry.manifest is not None
        header = TransferHeader(entry.manifest, PutOrigin.REPLICA, self.host_id)
        deadline = 10.0 + entry.nbytes / self.config.transfer_min_rate

        def push(peer_id: str) -> str | None:
            if entry.dropped:
                return f"{entry.key} was dropped before it reached {peer_id}: {entry.error}"
            newer = self._newer_capture(entry)
            if newer is not None:
                return f"{SUPERSEDED} by step {newer} before it was sent to {peer_id}"
            pinned = self._pin(entry)
            if not pinned:
                return f"{entry.key} was dropped before it reached {peer_id}"
            try:
                fault("replicate.before_send")
                self._push_to(peer_id, header, entry.segment.view(entry.nbytes), deadline)
                self.events.pushed(entry.nbytes)
                fault("replicate.after_ack")
                return None
            except StoreError as exc:
                return str(exc)
            finally:
                self._unpin(entry)

        futures: list[Future[str | None]] = [self._push.submit(push, p) for p in peers]
        errors = [e for e in (f.result() for f in futures) if e]
        if errors and all(e.startswith(SUPERSEDED) for e in errors):
            with self._lock:
                entry.superseded = True  # newest wins: the client's wait() returns, saying so
                self.saves_superseded += 1
        if not errors and entry.taken_at:
            self.events.replicated(time.monotonic() - entry.taken_at)  # the last peer's ack
        self._settle(entry, copies=1 + len(peers) - len(errors), errors=errors)

    def _push_to(self, peer_id: str, header: TransferHeader, view: memoryview, deadline: float) -> None:
        peer = self.peers[peer_id]
        if self.config.data_plane == "tcp":
            try:
                peer.push_data(header, view, deadline, self.config.peer_timeout)
                return
            except DataChannelUnsupported:
                log.info("peer %s has no data channel; falling back to gRPC streams", peer_id)
        peer.push(header, view, timeout=deadline)

    def _newer_capture(self, entry: Entry) -> int | None:
        """A newer step of the same rank captured after ``entry``: then pushing ``entry`` is pointless.

        Capture time matters, not the step number alone: after a job restarts from an older step, the
        stale newer steps of the killed run are still in RAM, and the re-saved steps must replicate.
        """
        key = entry.key
        with self._lock:
            newer = [
                k.step
                for k, e in self._entries.items()
                if k.job_id == key.job_id and k.rank == key.rank and k.step > key.step and e.created_unix > entry.created_unix
            ]
        return max(newer) if newer else None

    def _settle(self, entry: Entry, copies: int, errors: list[str]) -> None:
        with self._lock:
            entry.copies = copies
            if copies >= self.config.replicas:
                entry.state = ShardState.COMMITTED
                entry.error = ""
            else:
                entry.state = ShardState.UNDER_REPLICATED
                entry.error = f"{copies} of {self.config.replicas} copies: " + "; ".join(errors)
                log.warning("shard %s under-replicated: %s", entry.key, entry.error)
            self._describe(entry)
            self._lock.notify_all()
        self.events.settled(entry.state.value)
        self._retention_due.set()
