"""Replication of owned shards to their group peers."""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

from memstore.config import StoreConfig
from memstore.core.floors import Floors
from memstore.core.model import Manifest, PutOrigin, ShardKey, ShardState, TransferHeader
from memstore.core.reserve_policy import MIN_UNIT
from memstore.errors import (
    CaptureAbandoned,
    DataChannelUnsupported,
    StoreError,
)
from memstore.faults import fault
from memstore.server.engine.catalog import Catalog
from memstore.server.engine.entries import Entry
from memstore.server.engine.progress import CaptureProgress
from memstore.server.events import StoreEvents
from memstore.server.membership import Membership
from memstore.server.peers import PeerDirectory
from memstore.v1.datachannel import stream_count
from memstore.v1.integrity import StreamedChecksums, chunk_count, compute_checksums

log = logging.getLogger(__name__)

CHECKSUM_WORKERS = max(1, min(4, os.cpu_count() or 1))
REPLICATION_WORKERS = 4  # shards checksummed and pushed at once
SUPERSEDED = "superseded"  # how a push skipped for a newer capture of the same rank starts its error


def push_copy(
    peers: PeerDirectory,
    config: StoreConfig,
    peer_id: str,
    header: TransferHeader,
    view: memoryview,
    deadline: float,
    sums: StreamedChecksums | None = None,
    progress: CaptureProgress | None = None,
    source_fd: int | None = None,
) -> None:
    """Send one verified copy to ``peer_id``: over its raw TCP data channel when ``--data-plane tcp``, else (or when the
    peer has none) as a gRPC stream. Replication and drain push this way. ``sums``: the header's checksums are
    placeholders, computed as the chunks go (``StreamedChecksums``); a gRPC stream gets them all first. ``progress``:
    the shard is still being captured; each chunk goes once it is final (a gRPC stream once the capture is finished).
    ``source_fd``: the segment file ``view`` maps (``Segment.opened``): the data channel sends its pages without a copy."""
    peer = peers[peer_id]
    if config.data_plane == "tcp":
        try:
            streams = stream_count(header.manifest.nbytes, header.manifest.chunk_size, config.transfer_streams)
            peer.push_data(header, view, deadline, config.peer_timeout, streams, sums, progress.wait_for if progress else None, source_fd)
            return
        except DataChannelUnsupported:
            log.info("peer %s has no data channel (or no streamed checksums); falling back to gRPC streams", peer_id)
    if progress is not None:
        progress.wait_finished()
    if sums is not None:
        header = replace(header, manifest=replace(header.manifest, checksums=sums.complete(view)))
    peer.push(header, view, timeout=deadline)


class Replicator:
    """Checksums a captured shard, pushes it to the R-1 group peers and settles it (COMMITTED or UNDER_REPLICATED).

    Owns two executors: ``replicate`` (one task per shard taken in) and ``push`` (one task per peer a shard goes to).
    """

    def __init__(
        self,
        catalog: Catalog,
        config: StoreConfig,
        membership: Membership,
        peers: PeerDirectory,
        events: StoreEvents,
        retention_due: threading.Event,
        floors: Floors,
    ) -> None:
        self.catalog = catalog
        self.floors = floors  # pushed replicas carry their job's restorable floor (memstore.core.floors)
        self.config = config
        self.host_id = config.host_id
        self.membership = membership
        self.peers = peers
        self.events = events
        self.retention_due = retention_due  # set when a shard settles: the janitor looks at retention again
        self._replication = ThreadPoolExecutor(max_workers=REPLICATION_WORKERS, thread_name_prefix="replicate")
        self._push = ThreadPoolExecutor(max_workers=max(2, 2 * (config.replicas - 1)), thread_name_prefix="push")
        # (job, rank) -> the shard size its peers were told (announce), until the rank's first save is taken in
        self._announced: dict[tuple[str, int], int] = {}
        self._announced_lock = threading.Lock()

    def announce(self, job_id: str, rank: int, nbytes: int) -> None:
        """Tell the group peers, in the background, that replicas of ``job_id``'s rank ``rank``, ``nbytes`` each, will
        come (``Expect``), before the rank's first save is taken in: once per stream, and again when its shards grow.
        Their automatic reserves fault that memory in before the first replica arrives, instead of under it (after a
        ``prepare()`` at set-up, the first commit no longer waits for every peer to fault in fresh pages). Once a save
        of the rank was taken in, the peers learn from its replicas: faulting in the whole cycle there during a job's
        first saves only competes with them (measured: save 2 of 1 GiB stalled 2.7-3.0 s instead of 1.8 s on 2 cores)."""
        if nbytes < MIN_UNIT or any(key.rank == rank for key, _, _ in self.catalog.held(job_id)):
            return  # a save of the rank is held here: its replicas taught the peers
        with self._announced_lock:
            if self._announced.get((job_id, rank), 0) >= nbytes:
                return
            self._announced[(job_id, rank)] = nbytes
        targets = self.membership.view.replication_targets()
        self.peers.announce(targets, job_id, rank, nbytes, self.config.peer_timeout)

    def submit(self, entry: Entry) -> None:
        """Replicate ``entry`` (just registered: a client's save taken in) in the background."""
        with self._announced_lock:
            self._announced.pop((entry.key.job_id, entry.key.rank), None)  # from now on the catalog holds the rank
        self.catalog.add_in_flight(1)
        self._replication.submit(self.capture_and_replicate, entry)

    def close(self) -> None:
        self._replication.shutdown(wait=False, cancel_futures=True)
        self._push.shutdown(wait=False, cancel_futures=True)

    def capture_and_replicate(self, entry: Entry) -> None:
        """Checksum ``entry`` (unless it has its manifest, or its client's checksums), push it to the group peers,
        settle it.

        Over the data channel the checksums travel with the chunks: each is computed just before its chunk is sent,
        so hashing overlaps sending, and the owner's manifest gets the very checksums its peers verified. Otherwise
        (``--data-plane grpc``) every checksum is computed first, on threads."""
        if not self.catalog.take_up(entry):  # a newer save of its rank came first (Catalog.commit_lease: newest wins)
            self.catalog.add_in_flight(-1)
            self.retention_due.set()
            return
        try:
            sums = None
            if entry.manifest is None:
                if entry.client_checksums is not None:  # hashed by its client as it copied (Commit): nothing to read back
                    self.catalog.checksummed(entry, self._manifest(entry, entry.client_checksums))
                elif self.config.data_plane == "tcp":
                    sums = StreamedChecksums(entry.nbytes, self.config.chunk_bytes)
                else:
                    if entry.progress is not None:
                        entry.progress.wait_finished()
                    checksums = compute_checksums(entry.segment.view(), entry.nbytes, self.config.chunk_bytes, workers=CHECKSUM_WORKERS)
                    self.catalog.checksummed(entry, self._manifest(entry, tuple(checksums)))
            self._replicate(entry, sums)
        except CaptureAbandoned as exc:  # its client never finished it: no copy of it anywhere is complete
            log.warning("dropping %s: %s", entry.key, exc)
            self.catalog.drop(entry, reason=str(exc))
        except Exception as exc:  # never lose the local copy because replication broke
            log.exception("replication of %s failed", entry.key)
            self._settle(entry, copies=1, errors=[f"internal error: {exc}"])
        finally:
            self.catalog.add_in_flight(-1)

    def _manifest(self, entry: Entry, checksums: tuple[int, ...]) -> Manifest:
        return Manifest(
            key=entry.key,
            world_size=entry.world_size,
            nbytes=entry.nbytes,
            chunk_size=self.config.chunk_bytes,
            checksums=checksums,
            owner_host=self.host_id,
            format_version=entry.format_version,
            metrics=entry.metrics,
            created_unix=entry.created_unix,
            spill_codec=entry.spill_codec,
            stripe=entry.stripe,
        )

    def _checksummed(self, entry: Entry, sums: StreamedChecksums) -> None:
        """The owner's copy gets every checksum: those the pushes computed already, the rest now."""
        if not self.catalog.pin(entry):
            return  # dropped meanwhile: nothing left to describe
        try:
            self.catalog.checksummed(entry, self._manifest(entry, sums.complete(entry.segment.view(entry.nbytes))))
        finally:
            self.catalog.unpin(entry)

    def _own_checksums(self, entry: Entry, sums: StreamedChecksums | None) -> None:
        """The owner's copy gets its checksums (``sums``: those the pushes computed and the rest) once its capture is
        finished; CaptureAbandoned if its client never finishes it."""
        if entry.progress is not None:
            entry.progress.wait_finished()  # the rest of the checksums need the whole shard
        if sums is not None:
            self._checksummed(entry, sums)

    def _replicate(self, entry: Entry, sums: StreamedChecksums | None = None) -> None:
        view = self.membership.view
        peers = view.replication_targets()
        if not peers:
            self._own_checksums(entry, sums)
            held = len(view.table.members())
            why = f"the slot table (v{view.table.version}) holds {held} store(s): no group peer to copy to yet"
            self._settle(entry, copies=1, errors=[why] if self.config.replicas > 1 else [])
            return
        manifest = entry.manifest if sums is None else self._manifest(entry, (0,) * chunk_count(entry.nbytes, self.config.chunk_bytes))
        assert manifest is not None
        header = TransferHeader(manifest, PutOrigin.REPLICA, self.host_id, *self._floor_for(entry.key))
        deadline = 10.0 + entry.nbytes / self.config.transfer_min_rate

        def push(peer_id: str) -> str | None:
            if entry.dropped:
                return f"{entry.key} was dropped before it reached {peer_id}: {entry.error}"
            newer = self._newer_capture(entry)
            if newer is not None:
                return f"{SUPERSEDED} by step {newer} before it was sent to {peer_id}"
            if not self.catalog.pin(entry):
                return f"{entry.key} was dropped before it reached {peer_id}"
            try:
                fault("replicate.before_send")
                with entry.segment.opened() as fd:
                    view = entry.segment.view(entry.nbytes)
                    push_copy(self.peers, self.config, peer_id, header, view, deadline, sums, entry.progress, fd)
                self.events.pushed(entry.nbytes)
                fault("replicate.after_ack")
                return None
            except StoreError as exc:
                return str(exc)
            finally:
                self.catalog.unpin(entry)

        futures: list[Future[str | None]] = [self._push.submit(push, p) for p in peers]
        try:  # hash beside the pushes (each chunk once, by whoever comes first): the owner's copy is verified about
            self._own_checksums(entry, sums)  # when the bytes are sent, even if a peer stalls or is down
        finally:
            errors = [e for e in (f.result() for f in futures) if e]
        if errors and all(e.startswith(SUPERSEDED) for e in errors):
            self.catalog.mark_superseded(entry)  # newest wins: the client's wait() returns, saying so
        if not errors and entry.taken_at:
            self.events.replicated(time.monotonic() - entry.taken_at)  # the last peer's ack
        self._settle(entry, copies=1 + len(peers) - len(errors), errors=errors)

    def _floor_for(self, key: ShardKey) -> tuple[int | None, str]:
        """The job's floor, as a push of ``key`` carries it (``TransferHeader``): a step of ``key``'s timeline up to its
        step, or a version of another timeline (a DCP save's); (None, "") when none, or when it is a newer step of
        ``key``'s own timeline (an older shard's push cannot name it)."""
        floor = self.floors.get(key.job_id)
        if floor is None:
            return None, ""
        if floor.timeline != key.timeline:
            return floor.step, floor.timeline
        return (floor.step, "") if floor.step <= key.step else (None, "")

    def _newer_capture(self, entry: Entry) -> int | None:
        """A newer step of the same rank captured after ``entry``: then pushing ``entry`` is pointless.

        Capture time matters, not the step number alone: after a job restarts from an older step, the
        stale newer steps of the killed run are still in RAM, and the re-saved steps must replicate.
        """
        key = entry.key
        held = self.catalog.held(key.job_id)  # one look under the catalog's lock
        newer = [k.step for k, _, created in held if k.rank == key.rank and k.step > key.step and created > entry.created_unix]
        return max(newer, default=None)

    def _settle(self, entry: Entry, copies: int, errors: list[str]) -> None:
        state: ShardState = self.catalog.settle(entry, copies, errors)
        self.events.settled(state.value)
        self.retention_due.set()
