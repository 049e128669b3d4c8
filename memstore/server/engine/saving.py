"""Save paths: the local fast path (allocate, commit) and shards arriving as streams (clients and peers)."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Protocol

from memstore.config import StoreConfig
from memstore.core.floors import Floors, floor_problem, sent_floor
from memstore.core.limits import transfer_sender
from memstore.core.model import Manifest, PutOrigin, ShardInfo, ShardKey, ShardState, Stripe, TransferHeader
from memstore.core.status import CaptureReport
from memstore.errors import (
    Draining,
    InvalidArgument,
    LeaseError,
)
from memstore.faults import fault
from memstore.server.engine.admission import Admission
from memstore.server.engine.arrivals import Arrivals
from memstore.server.engine.catalog import Catalog
from memstore.server.engine.entries import Entry, Inbound, codec_problem, ensure, sender_error
from memstore.server.engine.progress import CaptureProgress
from memstore.server.engine.room import Room
from memstore.server.events import StoreEvents
from memstore.server.memory.pool import Segment, SegmentPool
from memstore.v1.integrity import MAX_CHUNKS_PER_SHARD, ChunkChecksums, chunk_count
from memstore.v1.keys import capture_problem, host_id_problem, key_problem, metrics_problem
from memstore.v1.streams import receive_chunks, shard_manifest_problem

log = logging.getLogger(__name__)


class Protection(Protocol):
    """What protects a shard once it is taken in: replication (``replication.Replicator``: R-1 copies) or erasure coding
    (``encoding.Encoder``: contributions to its group's parity), as ``--redundancy`` says."""

    def submit(self, entry: Entry) -> None:
        """Protect ``entry`` (just registered) in the background; it settles when done."""

    def announce(self, job_id: str, rank: int, nbytes: int) -> None:
        """``job_id``'s rank ``rank`` reserved ``nbytes`` ahead of its first save: tell whoever will receive its bytes."""


MAX_CAPTURE_SECONDS = 86400.0  # a client's reported time from save() to Commit (0: not reported)
MAX_WAIT_SECONDS = 10.0  # WaitCommitted blocks a server thread at most this long; clients loop


class Saver:
    """Takes shards in: shared-memory captures, gRPC streams; and reports when they are committed.

    Each shard taken in from a client goes to its ``Protection`` (the replicator, or the encoder under ec:K+M); the
    catalog holds it and its allocation lease. A shard arriving as a stream is admitted (``Admission``) before its
    memory is reserved, and ends it exactly once; while its bytes arrive, ``Arrivals`` knows it (repair does not pull it
    meanwhile) until it registers or fails.
    """

    def __init__(
        self,
        catalog: Catalog,
        arrivals: Arrivals,
        room: Room,
        admission: Admission,
        replicator: Protection,
        config: StoreConfig,
        pool: SegmentPool,
        events: StoreEvents,
        draining: threading.Event,
        retention_due: threading.Event,
        floors: Floors,
    ) -> None:
        self.catalog = catalog
        self.arrivals = arrivals  # the shards arriving as streams (repair does not pull them meanwhile)
        self.room = room  # memory for what it takes in
        self.admission = admission  # open transfers per sender (--max-streams-per-peer)
        self.floors = floors  # the restorable floors clients and peers send (memstore.core.floors)
        self.replicator = replicator
        self.config = config
        self.host_id = config.host_id
        self.pool = pool  # its shared-memory dir and the capture rings' paths
        self.events = events
        self.draining = draining  # set: no new shards are taken in
        self.retention_due = retention_due  # set when a replica arrives: the janitor looks at retention again
        self._capturing: dict[str, Entry] = {}  # lease id -> a capture pushed while its client writes it
        self._capturing_lock = threading.Lock()  # guards both
        self._capture = CaptureReport()  # what clients reported of their captures (summed over the commits taken in)

    @property
    def capture(self) -> CaptureReport:
        return self._capture

    def allocate(
        self, key: ShardKey, world_size: int, nbytes: int, preferred: str = "", ahead: bool = False, grow: bool = False,
        restorable_floor: int | None = None, floor_timeline: str = "",
    ) -> tuple[str, Segment]:  # fmt: skip
        """A lease on a segment of this rank's capture ring for ``key``'s ``nbytes``: ``preferred`` (a segment of the
        ring the client has mapped) if still free.

        ``ahead``: for the rank's next save, whose step is not known yet (``key.step`` and ``key.timeline`` are
        ignored): ``commit`` names the shard. The client maps the segment meanwhile, so its save makes no call.
        Reserving ahead never drops a held step to make room: over the capacity or the job's quota it is refused,
        and the save allocates (and makes room) when it comes. ``grow`` (with ``ahead``): a segment that joins the
        ring, never one of the ring's own (the client fills its ring so during warm-up). A segment made for it is
        faulted in here, not made sparse (``SegmentMaker.create``): pages a trainer faults in are charged to the
        trainer's memory cgroup (its pod's limit), not the store's.

        ``restorable_floor`` (of ``floor_timeline``, "": of ``key``'s; not with ``ahead``): the job's floor as this save's
        agreement found it, as with a commit; recorded before the save's segment is chosen, so that a save into its full
        ring may take its oldest kept step's (``memstore.server.engine.recycling``: only below a step every rank saved).
        """
        if ahead:
            key = ShardKey(key.job_id, 0, key.rank)
        ensure(key_problem(key.job_id, key.step, key.rank, world_size, key.timeline))
        if nbytes <= 0:
            raise InvalidArgument(f"nbytes {nbytes} is invalid: expected > 0")
        chunks = chunk_count(nbytes, self.config.chunk_bytes)
        if chunks > MAX_CHUNKS_PER_SHARD and nbytes <= self.config.capacity:  # beyond the capacity: CapacityExceeded says so
            raise InvalidArgument(
                f"a shard of {nbytes} bytes would have {chunks} chunks of --chunk-bytes {self.config.chunk_bytes}: at most "
                f"{MAX_CHUNKS_PER_SHARD} (MAX_CHUNKS_PER_SHARD) per shard; raise --chunk-bytes on store {self.host_id}"
            )
        if self.pool.directory is None:
            raise InvalidArgument(f"store {self.host_id} has no shared-memory dir (--shm-dir ''); send the shard with Put")
        self._refuse_if_draining()
        if not ahead:
            self.catalog.refuse_resave(key)
        if grow and not ahead:
            raise InvalidArgument("grow needs ahead: only a reservation for a later save may add a segment to the ring")
        if restorable_floor is not None:
            if ahead:
                raise InvalidArgument("restorable_floor comes with a save's Allocate, not with a reservation ahead (its step is not known)")
            ensure(floor_problem(restorable_floor, key.step, floor_timeline))
            self._note_floor(key, restorable_floor, floor_timeline)
        segment = self.room.acquire(key, nbytes, preferred, ring=key.rank, evict=not ahead, grow=grow)
        if ahead:  # a reservation before the rank's first save (prepare): its peers fault in what its replicas need
            self.replicator.announce(key.job_id, key.rank, nbytes)
        entry = Entry(key, world_size, nbytes, segment, self.host_id, ShardState.CAPTURED)
        return self.catalog.lease_allocation(entry, ahead), segment

    def ring_paths(self, job_id: str, rank: int) -> list[str]:
        """The segments of ``rank``'s capture ring (``AllocateResponse.ring_paths``): its client keeps them mapped."""
        return self.pool.ring_paths(job_id, rank)

    def commit(
        self,
        lease_id: str,
        metrics: dict[str, float],
        format_version: int,
        spill_codec: str = "",
        key: ShardKey | None = None,
        nbytes: int = 0,
        capture: CaptureReport | None = None,
        capture_seconds: float = 0.0,
        stripe: Stripe | None = None,
        restorable_floor: int | None = None,
        captured_bytes: int | None = None,
        checksums: ChunkChecksums | None = None,
        floor_timeline: str = "",
    ) -> ShardKey:
        """Take a client's capture in: the shard of ``lease_id`` is the store's from now on; replication starts.

        ``captured_bytes``: the client is still writing, its first ``captured_bytes`` bytes are final. The first such
        call takes the shard in and replication pushes what is final while the client copies the rest; later ones
        move the mark on; the call without it ends the capture (``memstore.server.engine.progress``).

        An ahead lease (``allocate(ahead=True)``) needs ``key``, the shard it holds (same job and rank), and
        ``nbytes`` when the shard is smaller than the lease. ``capture``: what the client's copies cost it since its
        last commit (summed into ``memstore status`` and the metrics); ``capture_seconds``: its save's time until
        this commit (the store sees an ahead lease's save start nowhere). ``stripe``: the shard is one member's
        stripe of a replica group's save (``memstore.core.model.Stripe``), kept in its manifest. ``restorable_floor``:
        a step of this shard's timeline its job's ranks all saved (``memstore.core.floors``), or of ``floor_timeline``
        when that names another (a DCP save's floor is an earlier save's version). ``checksums``: the chunk
        checksums the client computed as it copied (``ChunkChecksums``): replication hashes nothing and its peers verify
        against them; only with the Commit that ends a save in one call.
        """
        ensure(codec_problem(spill_codec) or metrics_problem(metrics))
        if capture is not None:
            ensure(capture_problem(capture.registrations, capture.fallbacks, capture.fallback_cause))
        if not (math.isfinite(capture_seconds) and 0.0 <= capture_seconds <= MAX_CAPTURE_SECONDS):
            raise InvalidArgument(f"capture_seconds {capture_seconds!r} is out of range: expected 0..{MAX_CAPTURE_SECONDS:.0f}")
        if key is not None:
            ensure(key_problem(key.job_id, key.step, key.rank, timeline=key.timeline))
        if checksums is not None:
            ensure(self._checksums_problem(lease_id, captured_bytes))
        entry = self._capturing_entry(lease_id, captured_bytes)
        if entry is None:
            entry = self.catalog.commit_lease(
                lease_id, key, nbytes, metrics, format_version, spill_codec, stripe, restorable_floor, checksums, floor_timeline
            )  # fmt: skip
            if capture is not None and (capture.registrations or capture.fallbacks):
                with self._capturing_lock:
                    self._capture = self._capture.plus(capture.registrations, capture.fallbacks, capture.fallback_cause)
            self._note_floor(entry.key, restorable_floor, floor_timeline)
            if captured_bytes is not None:  # the client goes on writing: push what is final meanwhile
                entry.progress = CaptureProgress(entry.nbytes)
                entry.progress.advance(captured_bytes)
                with self._capturing_lock:
                    self._capturing[lease_id] = entry
                self.replicator.submit(entry)
                return entry.key
        elif captured_bytes is not None:
            return entry.key
        if capture is not None and capture.fallbacks:
            log.warning(
                "rank %d of job %s copied %d captures through pageable memory (registration failed: %s)",
                entry.key.rank, entry.key.job_id, capture.fallbacks, capture.fallback_cause,
            )  # fmt: skip
        self.events.captured(capture.registrations if capture else 0, capture.fallbacks if capture else 0)
        self.events.saved("shm", capture_seconds or entry.taken_at - entry.allocated_at)
        if entry.progress is None:
            self.replicator.submit(entry)
        fault("commit.before_ack")
        return entry.key

    def close(self) -> None:
        """The store is closing: captures still being written are given up, so no push waits for their marks."""
        with self._capturing_lock:
            capturing, self._capturing = list(self._capturing.values()), {}
        for entry in capturing:
            if entry.progress is not None:
                entry.progress.abandon("the store is closing")

    def _checksums_problem(self, lease_id: str, captured_bytes: int | None) -> str | None:
        """Why a Commit of ``lease_id`` may not carry the client's chunk checksums: a capture pushed as it is copied
        (marks) is hashed by the store, chunk by chunk as it becomes final."""
        with self._capturing_lock:
            marked = lease_id in self._capturing
        if captured_bytes is not None or marked:
            return "chunk_checksums come with the one Commit of a save, never with a capture committed in marks (captured_bytes)"
        return None

    def _capturing_entry(self, lease_id: str, captured_bytes: int | None) -> Entry | None:
        """The shard of ``lease_id`` if it is a capture being pushed while its client writes it (None: the lease's first
        Commit); its mark moved to ``captured_bytes``, or (None) its capture finished. Abandoned ones are forgotten."""
        with self._capturing_lock:
            for lease, abandoned in [(k, e) for k, e in self._capturing.items() if e.progress and e.progress.abandoned]:
                del self._capturing[lease]
                if lease == lease_id:
                    assert abandoned.progress is not None
                    raise LeaseError(f"the capture of {abandoned.key} was abandoned ({abandoned.progress.abandoned}); save it again")
            entry = self._capturing.get(lease_id) if captured_bytes is not None else self._capturing.pop(lease_id, None)
        if entry is None or entry.progress is None:
            return None
        if captured_bytes is not None and captured_bytes > entry.nbytes:
            raise InvalidArgument(f"captured_bytes {captured_bytes} is beyond the shard's {entry.nbytes} bytes")
        if captured_bytes is None:
            entry.progress.finish()
        else:
            entry.progress.advance(captured_bytes)
        return entry

    def wait_committed(
        self, key: ShardKey, timeout: float, restorable_floor: int | None = None, floor_timeline: str = ""
    ) -> tuple[ShardInfo, bool]:
        """``key``'s status once it settled or ``timeout`` passed; ``restorable_floor`` (of ``floor_timeline``, "": of
        ``key``'s): its job's floor, as with a commit."""
        ensure(key_problem(key.job_id, key.step, key.rank, timeline=key.timeline))
        if restorable_floor is not None:
            ensure(floor_problem(restorable_floor, key.step, floor_timeline))
            self._note_floor(key, restorable_floor, floor_timeline)
        deadline = time.monotonic() + max(0.0, min(timeout, MAX_WAIT_SECONDS))
        return self.catalog.wait_settled(key, deadline)

    def receive(self, header: TransferHeader, chunks: Iterable[bytes]) -> Manifest:
        """Store a shard arriving as a gRPC chunk stream (remote client, replication fallback); returns its manifest as held."""
        inbound = self.begin_receive(header)
        try:
            receive_chunks(chunks, inbound.manifest, inbound.segment.view(), on_chunk=lambda _: fault("receive.after_chunk"))
        except BaseException as exc:
            self.abort_receive(inbound)
            raise sender_error(exc) from None
        return self.finish_receive(inbound)

    def _check_transfer(self, header: TransferHeader) -> None:
        """Everything a transfer's header says, checked before any memory is reserved for it."""
        m = header.manifest
        ensure(shard_manifest_problem(m, owner_required=header.origin is not PutOrigin.CLIENT))
        if header.sender_host:
            ensure(host_id_problem(header.sender_host, "sender_host"))
        if header.restorable_floor is not None:
            ensure(floor_problem(header.restorable_floor, m.key.step, header.restorable_floor_timeline))

    def _note_floor(self, key: ShardKey, floor: int | None, timeline: str = "") -> None:
        """A restorable floor (of ``timeline``, "": of ``key``'s) came with a save or a copy of ``key``: retention may
        look again without listing."""
        version = sent_floor(floor, timeline, key.timeline)
        if version is not None and self.floors.note(key.job_id, version):
            self.retention_due.set()

    def _refuse_if_draining(self) -> None:
        if self.draining.is_set():
            raise Draining(f"store {self.host_id} is draining (leaving the cluster): it takes no new shards; use another store")

    def begin_receive(self, header: TransferHeader) -> Inbound:
        """Validate an incoming shard, count it against its sender's open transfers and reserve its memory.

        Every Inbound returned ends in exactly one of ``abort_receive`` or ``finish_receive``.
        """
        self._check_transfer(header)
        m = header.manifest
        key = m.key
        # True of earlier saves whether or not this transfer completes.
        self._note_floor(key, header.restorable_floor, header.restorable_floor_timeline)
        sender = transfer_sender(header.origin, key.job_id, header.sender_host, m.owner_host)
        self._refuse_if_draining()
        if header.origin is PutOrigin.CLIENT:
            self.catalog.refuse_resave(key)  # before it counts
        self.admission.admit(sender)
        try:
            segment = self.room.acquire(key, max(1, m.nbytes))
        except BaseException:
            self.admission.end(sender)  # it got no memory: it ends before it started
            raise
        self.arrivals.mark_receiving(key)
        return Inbound(key, m, header.origin, segment, sender)

    def finish_receive(self, inbound: Inbound) -> Manifest:
        """Register a fully received and verified shard; returns its manifest as held."""
        try:
            fault("receive.before_register")
        except BaseException:
            self.abort_receive(inbound)
            raise
        return self._register_received(inbound)

    def abort_receive(self, inbound: Inbound) -> None:
        """A transfer from ``begin_receive`` failed: its memory goes back and its sender's slot is free again."""
        try:
            self.room.release(inbound.segment)
            self.arrivals.end_receiving(inbound.key)
        finally:
            self.admission.end(inbound.sender)

    def _register_received(self, inbound: Inbound) -> Manifest:
        m = inbound.manifest
        if inbound.origin is PutOrigin.CLIENT:
            manifest = replace(m, owner_host=self.host_id)
            state, owner, copies = ShardState.REPLICATING, self.host_id, 1
        else:
            manifest = m
            state, owner, copies = ShardState.REPLICA, m.owner_host, 0
        entry = Entry(
            inbound.key,
            m.world_size,
            m.nbytes,
            inbound.segment,
            owner,
            state,
            manifest=manifest,
            metrics=dict(m.metrics),
            format_version=m.format_version,
            copies=copies,
            created_unix=m.created_unix or time.time(),
            stripe=m.stripe,
            taken_at=time.monotonic(),
        )
        try:
            self.arrivals.register_inbound(inbound, entry)
        finally:
            self.admission.end(inbound.sender)  # the transfer ends as its shard is registered
        if inbound.origin is PutOrigin.CLIENT:
            self.events.saved("stream", entry.taken_at - inbound.started)
            self.replicator.submit(entry)
        else:
            self.retention_due.set()
        return manifest
