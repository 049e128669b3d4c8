"""The store engine: shards in RAM, their life cycle, replication to group peers and repair.

Life of a shard owned by this host (a trainer rank runs here):

    allocate -> trainer copies into the segment -> commit            (save() returns here)
      -> checksums computed (CAPTURED -> REPLICATING)
      -> pushed to the R-1 group peers, each verifies every chunk
      -> COMMITTED when all acknowledged, else UNDER_REPLICATED (local copy kept; repair retries)

A copy received from a peer is verified chunk by chunk before it is registered (REPLICA).
The repair loop pulls, from group peers, every recent shard this host should hold but lacks, so a
replacement host (same host id, empty RAM) returns the group to R copies by itself.

The gRPC servicer is a thin adapter over this class; the pure decisions (placement, retention,
latest restorable step) live in ``memstore.core``.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from memstore import __version__
from memstore.config import StoreConfig
from memstore.core.model import Holding, Manifest, ShardKey, ShardState
from memstore.core.placement import Placement, make_placement
from memstore.core.restorable import latest_restorable, may_supersede, sources_for, split_timelines, superseded_versions
from memstore.core.retention import newest_versions, pressure_victims, retention_victims
from memstore.errors import (
    AlreadySaved,
    CapacityExceeded,
    ChecksumMismatch,
    DataChannelUnsupported,
    InvalidArgument,
    LayoutError,
    LeaseError,
    PeerUnavailable,
    ShardNotFound,
    SpillStorageError,
    StoreError,
    StreamError,
    UnknownJob,
)
from memstore.faults import fault
from memstore.server.convert import key_from_pb, key_to_pb, manifest_from_pb, manifest_to_pb, state_from_pb, state_to_pb
from memstore.server.peers import PeerDirectory
from memstore.server.segments import Segment, SegmentPool, segment_dir
from memstore.spill.layout import SpilledManifest
from memstore.spill.port import DurableTier
from memstore.v1 import store_pb2 as pb
from memstore.v1.channel import boot_id
from memstore.v1.datachannel import TICKET_BYTES, receive_verified, send_all, send_status
from memstore.v1.integrity import SPILL_CODECS, compute_checksums, first_mismatch
from memstore.v1.keys import job_id_problem, key_problem
from memstore.v1.streams import manifest_problem, put_requests, receive_chunks

log = logging.getLogger(__name__)

ALLOCATE_LEASE_SECONDS = 600.0  # a trainer that allocated but never committed (it crashed) frees the segment after this
READ_LEASE_SECONDS = 600.0
MAX_WAIT_SECONDS = 10.0  # WaitCommitted blocks a server thread at most this long; clients loop


@dataclass
class Entry:
    key: ShardKey
    world_size: int
    nbytes: int
    segment: Segment
    owner_host: str
    state: ShardState
    manifest: Manifest | None = None  # None until checksums are computed
    error: str = ""
    copies: int = 1
    pins: int = 0
    dropped: bool = False  # removed from the catalog while pinned; segment freed at last unpin
    metrics: dict[str, float] = field(default_factory=dict)
    format_version: int = 0
    created_unix: float = field(default_factory=time.time)
    source: str = ""  # peer a pulled copy came from
    spill_codec: str = ""  # the job's choice of durable codec ("" = the store's default)

    @property
    def verified(self) -> bool:
        return self.manifest is not None and self.state is not ShardState.CAPTURED


@dataclass
class _Inbound:
    key: ShardKey
    manifest: pb.Manifest
    origin: int
    segment: Segment


@dataclass
class _Ticket:
    deadline: float
    inbound: _Inbound | None = None
    outbound: Entry | None = None


def _stream_error(exc: BaseException) -> BaseException:
    """The error the sender of a failed transfer sees: stream and channel errors are typed already."""
    if isinstance(exc, ChecksumMismatch):
        return type(exc)(f"{exc}; the copy was discarded, the sender should retry")
    return exc


@dataclass
class _Lease:
    entry: Entry
    expires: float


def _codec_problem(codec: str) -> str | None:
    if codec and codec not in SPILL_CODECS:
        return f"spill codec {codec!r} is unknown: expected one of {', '.join(SPILL_CODECS)} (or empty for the store's default)"
    return None


def _ensure(problem: str | None) -> None:
    if problem:
        raise InvalidArgument(problem)


class Store:
    def __init__(self, config: StoreConfig, advertised_address: str | None = None) -> None:
        self.config = config
        self.host_id = config.host_id
        self.started = time.monotonic()
        self.placement: Placement = make_placement(config.placement, config.host_ids, config.replicas, config.failure_domains or None)
        # A replacement started with the same --host-id and --listen finds its previous incarnation's segments here.
        self.pool = SegmentPool(segment_dir(config.shm_dir, self.host_id, config.listen), config.capacity, adopt_leftovers=True)
        self.peers = PeerDirectory(self.host_id, config.peers)
        self._lock = threading.Condition()
        self._entries: dict[ShardKey, Entry] = {}
        self._alloc_leases: dict[str, _Lease] = {}
        self._read_leases: dict[str, _Lease] = {}
        self._receiving: set[ShardKey] = set()
        self._tickets: dict[bytes, _Ticket] = {}
        self._pulls: dict[ShardKey, threading.Event] = {}  # in-flight pulls, shared by fetch and repair
        self._protected: dict[str, int] = {}  # job -> newest restorable step, protected from eviction
        self._replication = ThreadPoolExecutor(max_workers=4, thread_name_prefix="replicate")
        self._push = ThreadPoolExecutor(max_workers=max(2, 2 * (config.replicas - 1)), thread_name_prefix="push")
        self._in_flight = 0
        self._repairs_in_flight = 0
        self._stop = threading.Event()
        self._retention_due = threading.Event()
        self._threads = [
            threading.Thread(target=self._repair_loop, name="repair", daemon=True),
            threading.Thread(target=self._janitor_loop, name="janitor", daemon=True),
        ]
        self.boot_id = boot_id()
        self.advertised_address = advertised_address or config.listen
        self.last_repair_error = ""
        self.durable: DurableTier | None = None  # set by the composition root (memstore.server.app) when --spill is on
        self.data_port = 0  # set by the server once the data channel listens
        self.adopted_shards = self._adopt_segments()

    def _adopt_segments(self) -> int:
        """Take over the verified shards a previous incarnation of this host left in shared memory.

        Each settled copy has a sidecar (its ShardInfo) next to its segment; a segment is adopted only if
        the sidecar is well-formed and every chunk still matches its checksum, so a store that crashed
        serves its RAM again without a network repair (GEMINI's software-failure path). The rest is deleted.
        """

        def check(seg: Segment, meta: bytes) -> bool:
            info = pb.ShardInfo.FromString(meta)
            m = info.manifest
            problem = manifest_problem(m) or key_problem(m.key.job_id, m.key.step, m.key.rank, m.world_size, m.key.timeline)
            state = state_from_pb(info.state)
            if problem or state is None or not state.settled or m.nbytes > seg.size:
                return False
            return first_mismatch(seg.view(), m.nbytes, m.chunk_size, list(m.chunk_checksums)) is None

        adopted = self.pool.adopt(check)
        for seg, meta in adopted:
            info = pb.ShardInfo.FromString(meta)
            m = manifest_from_pb(info.manifest)
            seg.owner = m.key.job_id  # never pooled for another job
            state = state_from_pb(info.state) or ShardState.REPLICA
            self._entries[m.key] = Entry(
                m.key, m.world_size, m.nbytes, seg, m.owner_host, state, manifest=m, metrics=dict(m.metrics),
                format_version=m.format_version, copies=info.copies, created_unix=m.created_unix or time.time(), spill_codec=m.spill_codec,
            )  # fmt: skip
        if adopted:
            log.info(
                "adopted %d shards (%d bytes) left in shared memory by this host's previous incarnation; verified every chunk",
                len(adopted), sum(e.nbytes for e in self._entries.values()),
            )  # fmt: skip
        return len(adopted)

    def _describe(self, entry: Entry) -> None:
        """Record a settled copy next to its segment (caller holds the lock) so a restart can adopt it."""
        if entry.verified and entry.state.settled and not entry.dropped:
            self.pool.describe(entry.segment, self._info(entry).SerializeToString())

    # -- the durable tier's port (memstore.spill.port.ShardSource) --------------------------
    def owned_shards(self) -> list[Manifest]:
        with self._lock:
            return [
                e.manifest for e in self._entries.values() if e.owner_host == self.host_id and e.state.settled and e.manifest is not None
            ]

    def owned_ranks(self, job_id: str) -> set[int]:
        with self._lock:
            return {k.rank for k, e in self._entries.items() if k.job_id == job_id and e.owner_host == self.host_id}

    @contextlib.contextmanager
    def pinned_bytes(self, key: ShardKey) -> Iterator[memoryview | None]:
        with self._lock:
            entry = self._entries.get(key)
        if entry is None or not self._pin(entry):
            yield None
            return
        view = entry.segment.view(entry.nbytes)
        try:
            yield view
        finally:
            view.release()
            self._unpin(entry)

    def spilled(self) -> None:
        self._retention_due.set()

    # -- lifecycle --------------------------------------------------------------
    def start(self) -> None:
        for t in self._threads:
            t.start()
        if self.durable is not None:
            self.durable.start()

    def flush(self, grace: float) -> list[str]:
        """On SIGTERM: spill the newest committed step of every job within ``grace`` seconds."""
        if self.durable is None:
            return []
        return self.durable.flush(grace)

    def close(self) -> None:
        if self.durable is not None:
            self.durable.close()
        self._stop.set()
        self._retention_due.set()
        with self._lock:
            self._lock.notify_all()
        self._replication.shutdown(wait=False, cancel_futures=True)
        self._push.shutdown(wait=False, cancel_futures=True)
        self.peers.close()
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=2)
        self.pool.close()

    # -- handshake / health -------------------------------------------------------
    def hello(self) -> pb.HelloResponse:
        return pb.HelloResponse(
            host_id=self.host_id,
            version=__version__,
            replicas=self.config.replicas,
            peer_ids=[h for h, _ in self.config.peers],
            peer_addresses=[a for _, a in self.config.peers],
            shm_dir=str(self.pool.directory or ""),
            boot_id=self.boot_id,
            capacity_bytes=self.config.capacity,
            max_chunk_bytes=self.config.chunk_bytes,
            placement=self.config.placement,
            data_port=self.data_port,
        )

    def health(self) -> pb.HealthResponse:
        with self._lock:
            shards = sum(1 for e in self._entries.values() if not e.dropped)
        return pb.HealthResponse(
            serving=not self._stop.is_set(),
            host_id=self.host_id,
            used_bytes=self.pool.used_bytes,
            capacity_bytes=self.config.capacity,
            shards=shards,
            replications_in_flight=self._in_flight,
            repairs_in_flight=self._repairs_in_flight,
            uptime_seconds=time.monotonic() - self.started,
            spill_url=self.config.spill,
            spill=[
                pb.SpillStatus(
                    job_id=job,
                    last_spilled_step=st.last_spilled_step,
                    last_spill_unix=st.last_spill_time or 0.0,
                    consecutive_failures=st.consecutive_failures,
                    last_error=st.last_error,
                    bytes_written=st.bytes_written,
                )
                for job, st in sorted((self.durable.status if self.durable else {}).items())
            ],
            adopted_shards=self.adopted_shards,
            orphans=[pb.OrphanedSegments(path=o.path, host_id=o.host_id, bytes=o.bytes, files=o.files) for o in self.pool.orphans()],
        )

    # -- save, local fast path ------------------------------------------------------
    def allocate(self, key: ShardKey, world_size: int, nbytes: int) -> tuple[str, Segment]:
        _ensure(key_problem(key.job_id, key.step, key.rank, world_size, key.timeline))
        if nbytes <= 0:
            raise InvalidArgument(f"nbytes {nbytes} is invalid: expected > 0")
        if self.pool.directory is None:
            raise InvalidArgument(f"store {self.host_id} has no shared-memory dir (--shm-dir ''); send the shard with Put")
        with self._lock:
            self._refuse_resave(key)
        segment = self._acquire(key, nbytes)
        entry = Entry(key, world_size, nbytes, segment, self.host_id, ShardState.CAPTURED)
        lease_id = secrets.token_hex(16)
        with self._lock:
            self._alloc_leases[lease_id] = _Lease(entry, time.monotonic() + ALLOCATE_LEASE_SECONDS)
        return lease_id, segment

    def commit(self, lease_id: str, metrics: dict[str, float], format_version: int, spill_codec: str = "") -> ShardKey:
        _ensure(_codec_problem(spill_codec))
        with self._lock:
            lease = self._alloc_leases.pop(lease_id, None)
            if lease is None:
                raise LeaseError(f"allocation lease {lease_id!r} is unknown or expired; allocate again")
            entry = lease.entry
            try:
                self._refuse_resave(entry.key)
            except AlreadySaved:
                self.pool.release(entry.segment)
                raise
            entry.metrics = dict(metrics)
            entry.format_version = format_version
            entry.spill_codec = spill_codec
            self._register(entry)
        self._in_flight_add(1)
        self._replication.submit(self._capture_and_replicate, entry)
        fault("commit.before_ack")
        return entry.key

    def _acquire(self, key: ShardKey, nbytes: int) -> Segment:
        """A segment for ``key``. Under memory pressure, drop what ``pressure_victims`` offers, one at a time."""
        while True:
            try:
                return self.pool.acquire(nbytes, key.job_id, what=f"shard {key}")
            except CapacityExceeded:
                with self._lock:
                    held = [(e.key, e.state, e.created_unix) for e in self._entries.values() if e.key.job_id == key.job_id]
                    protected = [self._protected[key.job_id]] if key.job_id in self._protected else []
                    victims = pressure_victims(held, key, protected)
                    if not victims:
                        raise
                    victim = self._entries[victims[0]]
                    log.warning("memory pressure: dropping %s (%s) to fit %s", victim.key, victim.state.value, key)
                    self._drop(victim, reason=f"dropped under memory pressure for step {key.step}")

    def _refuse_resave(self, key: ShardKey) -> None:
        """A client capture of a shard already held on the same timeline (caller holds the lock): refused.

        Two captures of one (job, step, rank, timeline) would make that step a mix of two saves. Clients
        move to a new timeline themselves when they save a step again; this catches a reused run id.
        """
        held = self._entries.get(key)
        if held is not None and not held.dropped:
            raise AlreadySaved(
                f"shard {key} is already saved on store {self.host_id}: saving a step again needs a new timeline "
                "(the client starts one when it saves a step at or below one it saved; a restarted job needs a new run id)"
            )

    def _register(self, entry: Entry) -> None:
        """Put ``entry`` in the catalog (caller holds the lock), replacing an older copy of the same shard.

        The same shard means the same (job, step, rank, timeline): a re-save of a step on another timeline
        is another shard, and the old version stays until retention finds it superseded
        (``memstore.core.restorable``): re-saves are atomic and never mix with the old version.
        """
        old = self._entries.get(entry.key)
        if old is not None and old is not entry:
            self._drop(old, reason="replaced by a newer copy of the same shard")
        self._entries[entry.key] = entry
        self._describe(entry)
        self._lock.notify_all()

    def _drop(self, entry: Entry, reason: str) -> None:
        """Remove from the catalog (caller holds the lock); free the segment once nobody reads it."""
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
        if not entry.error and not entry.state.settled:
            entry.error = reason
        entry.dropped = True
        if entry.pins == 0:
            self.pool.release(entry.segment)
        self._lock.notify_all()

    # -- capture, replication ----------------------------------------------------------
    def foreground_busy(self) -> bool:
        """A trainer is copying a save in (an open allocation) or a shard is being checksummed/replicated."""
        return bool(self._alloc_leases) or self._in_flight > 0

    def _in_flight_add(self, n: int) -> None:
        with self._lock:
            self._in_flight += n

    def _capture_and_replicate(self, entry: Entry) -> None:
        try:
            if entry.manifest is None:
                checksums = compute_checksums(entry.segment.view(), entry.nbytes, self.config.chunk_bytes)
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
        peers = self.placement.peers_of(self.host_id)
        if not peers:
            self._settle(entry, copies=1, errors=[])
            return
        assert entry.manifest is not None
        header_manifest = manifest_to_pb(entry.manifest)
        deadline = 10.0 + entry.nbytes / self.config.transfer_min_rate

        def push(peer_id: str) -> str | None:
            if entry.dropped:
                return f"{entry.key} was dropped before it reached {peer_id}: {entry.error}"
            newer = self._newer_capture(entry)
            if newer is not None:
                return f"superseded by step {newer} before it was sent to {peer_id}"
            header = pb.PutHeader(manifest=header_manifest, origin=pb.PUT_ORIGIN_REPLICA, sender_host=self.host_id)
            pinned = self._pin(entry)
            if not pinned:
                return f"{entry.key} was dropped before it reached {peer_id}"
            try:
                fault("replicate.before_send")
                self._push_to(peer_id, header, entry.segment.view(entry.nbytes), deadline)
                fault("replicate.after_ack")
                return None
            except StoreError as exc:
                return str(exc)
            finally:
                self._unpin(entry)

        futures: list[Future[str | None]] = [self._push.submit(push, p) for p in peers]
        errors = [e for e in (f.result() for f in futures) if e]
        self._settle(entry, copies=1 + len(peers) - len(errors), errors=errors)

    def _push_to(self, peer_id: str, header: pb.PutHeader, view: memoryview, deadline: float) -> None:
        peer = self.peers[peer_id]
        if self.config.data_plane == "tcp":
            try:
                peer.push_data(header, view, deadline, self.config.peer_timeout)
                return
            except DataChannelUnsupported:
                log.info("peer %s has no data channel; falling back to gRPC streams", peer_id)
        peer.push(lambda: put_requests(header, view), timeout=deadline)

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
        self._retention_due.set()

    def wait_committed(self, key: ShardKey, timeout: float) -> tuple[pb.ShardInfo, bool]:
        _ensure(key_problem(key.job_id, key.step, key.rank, timeline=key.timeline))
        deadline = time.monotonic() + max(0.0, min(timeout, MAX_WAIT_SECONDS))
        with self._lock:
            while True:
                entry = self._entries.get(key)
                if entry is None:
                    raise ShardNotFound(f"shard {key} is not held by store {self.host_id}")
                if entry.state.settled:
                    return self._info(entry), True
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stop.is_set():
                    return self._info(entry), False
                self._lock.wait(remaining)

    # -- save over the wire (remote client, replication, repair) ------------------------
    def receive(self, header: pb.PutHeader, chunks: Iterable[bytes]) -> pb.PutResponse:
        """Store a shard arriving as a gRPC chunk stream (remote client, replication fallback)."""
        inbound = self._begin_receive(header)
        try:
            receive_chunks(chunks, inbound.manifest, inbound.segment.view(), on_chunk=lambda _: fault("receive.after_chunk"))
        except BaseException as exc:
            self._abort_receive(inbound)
            raise _stream_error(exc) from None
        return self._finish_receive(inbound)

    def _begin_receive(self, header: pb.PutHeader) -> _Inbound:
        """Validate an incoming shard and reserve its memory."""
        m = header.manifest
        _ensure(key_problem(m.key.job_id, m.key.step, m.key.rank, m.world_size, m.key.timeline))
        _ensure(manifest_problem(m))
        _ensure(_codec_problem(m.spill_codec))
        if header.origin == pb.PUT_ORIGIN_UNSPECIFIED:
            raise InvalidArgument("PutHeader.origin is unspecified: expected CLIENT, REPLICA or REPAIR")
        key = key_from_pb(m.key)
        if header.origin == pb.PUT_ORIGIN_CLIENT:
            with self._lock:
                self._refuse_resave(key)
        segment = self._acquire(key, max(1, m.nbytes))
        with self._lock:
            self._receiving.add(key)
        return _Inbound(key, m, header.origin, segment)

    def _abort_receive(self, inbound: _Inbound) -> None:
        self.pool.release(inbound.segment)
        with self._lock:
            self._receiving.discard(inbound.key)

    def _finish_receive(self, inbound: _Inbound) -> pb.PutResponse:
        """Register a fully received and verified shard."""
        m = inbound.manifest
        manifest = manifest_from_pb(m)
        if inbound.origin == pb.PUT_ORIGIN_CLIENT:
            manifest = replace(manifest, owner_host=self.host_id)
            state, owner, copies = ShardState.REPLICATING, self.host_id, 1
        else:
            state, owner, copies = ShardState.REPLICA, manifest.owner_host, 0
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
        )
        with self._lock:
            self._receiving.discard(inbound.key)
            self._register(entry)
        if inbound.origin == pb.PUT_ORIGIN_CLIENT:
            self._in_flight_add(1)
            self._replication.submit(self._capture_and_replicate, entry)
        else:
            self._retention_due.set()
        return pb.PutResponse(key=m.key, bytes_received=m.nbytes)

    # -- bulk data channel ------------------------------------------------------------------
    def prepare_receive(self, header: pb.PutHeader) -> bytes:
        """Reserve memory for a shard that will arrive on the data channel; returns its one-time ticket."""
        inbound = self._begin_receive(header)
        ticket = secrets.token_bytes(TICKET_BYTES)
        deadline = time.monotonic() + 10.0 + inbound.manifest.nbytes / self.config.transfer_min_rate
        with self._lock:
            self._tickets[ticket] = _Ticket(deadline, inbound=inbound)
        return ticket

    def prepare_send(self, key: ShardKey) -> tuple[pb.Manifest, bytes]:
        """Pin a verified copy to be read from the data channel; returns (manifest, ticket)."""
        entry = self._readable(key)
        if not self._pin(entry):
            raise ShardNotFound(f"shard {key} was evicted while preparing to send it")
        assert entry.manifest is not None
        ticket = secrets.token_bytes(TICKET_BYTES)
        with self._lock:
            self._tickets[ticket] = _Ticket(time.monotonic() + 10.0 + entry.nbytes / self.config.transfer_min_rate, outbound=entry)
        return manifest_to_pb(entry.manifest), ticket

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
            err = _stream_error(exc)
            with contextlib.suppress(OSError):
                send_status(sock, f"{getattr(err, 'status', 'UNAVAILABLE')}: {err}")
            return
        fault("receive.before_register")
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

    # -- reads ---------------------------------------------------------------------------
    def _pin(self, entry: Entry) -> bool:
        with self._lock:
            if entry.dropped:
                return False
            entry.pins += 1
            return True

    def _unpin(self, entry: Entry) -> None:
        with self._lock:
            entry.pins -= 1
            if entry.pins == 0 and entry.dropped:
                self.pool.release(entry.segment)

    def _readable(self, key: ShardKey, wait: float = 30.0) -> Entry:
        """The verified local copy of ``key`` (waits briefly while its checksums are computed)."""
        _ensure(key_problem(key.job_id, key.step, key.rank, timeline=key.timeline))
        deadline = time.monotonic() + wait
        with self._lock:
            while True:
                entry = self._entries.get(key)
                if entry is None:
                    if not any(k.job_id == key.job_id for k in self._entries):
                        raise UnknownJob(f"job {key.job_id!r} is unknown to store {self.host_id}")
                    raise ShardNotFound(f"shard {key} is not held by store {self.host_id}")
                if entry.verified:
                    return entry
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ShardNotFound(f"shard {key} on store {self.host_id} is still being captured")
                self._lock.wait(remaining)

    def open(self, key: ShardKey) -> tuple[str, Entry]:
        entry = self._readable(key)
        if entry.segment.path is None:
            raise InvalidArgument(f"store {self.host_id} has no shared-memory dir; read the shard with Get")
        if not self._pin(entry):
            raise ShardNotFound(f"shard {key} was evicted while opening it")
        entry.segment.exported = True
        lease_id = secrets.token_hex(16)
        with self._lock:
            self._read_leases[lease_id] = _Lease(entry, time.monotonic() + READ_LEASE_SECONDS)
        return lease_id, entry

    def release(self, lease_id: str) -> None:
        with self._lock:
            lease = self._read_leases.pop(lease_id, None)
            alloc = self._alloc_leases.pop(lease_id, None)
        if lease is not None:
            self._unpin(lease.entry)
        elif alloc is not None:
            self.pool.release(alloc.entry.segment)

    def read(self, key: ShardKey) -> Iterator[tuple[pb.Manifest, memoryview]]:
        """Context-style generator: yields (manifest, view) once with the entry pinned."""
        entry = self._readable(key)
        if not self._pin(entry):
            raise ShardNotFound(f"shard {key} was evicted while reading it")
        try:
            assert entry.manifest is not None
            yield manifest_to_pb(entry.manifest), entry.segment.view(entry.nbytes)
        finally:
            self._unpin(entry)

    def fetch(self, key: ShardKey, discard_local: bool) -> tuple[pb.Manifest, str]:
        """Make sure this store holds a verified copy of ``key``, pulling it from a peer if needed."""
        _ensure(key_problem(key.job_id, key.step, key.rank, timeline=key.timeline))
        with self._lock:
            local = self._entries.get(key)
        if local is not None and discard_local:
            if (
                local.manifest is not None
                and first_mismatch(local.segment.view(), local.nbytes, local.manifest.chunk_size, local.manifest.checksums) is None
            ):
                log.warning("client reported %s corrupt but the local copy verifies; keeping it", key)
            else:
                log.warning("discarding corrupt local copy of %s", key)
                with self._lock:
                    self._drop(local, reason="local copy failed verification")
                local = None
        if local is not None:
            entry = self._readable(key)
            assert entry.manifest is not None
            return manifest_to_pb(entry.manifest), entry.source  # "" unless repair pulled it from a peer
        source = self._pull(key, origin_note="fetch")
        entry = self._readable(key)
        assert entry.manifest is not None
        return manifest_to_pb(entry.manifest), source

    def _pull(self, key: ShardKey, origin_note: str, candidates: list[str] | None = None) -> str:
        """Copy ``key`` from the first peer that has a verified copy. Returns that peer's id."""
        if candidates is None:
            listings = self.peers.list_all(key.job_id, self.config.peer_timeout)
            holdings = [h for host, resp in listings.items() if not isinstance(resp, StoreError) for h in _holdings(host, resp)]
            candidates = sources_for(holdings, key, prefer=self.placement.hosts)
            unreachable = [h for h, r in listings.items() if isinstance(r, StoreError)]
            durable = self._durable_holdings(key.job_id, unreachable)
            if any(h.key == key for h in durable):
                candidates.append("durable")  # the most expensive tier comes last
            holdings += durable
            if not candidates:
                if not any(h.key.job_id == key.job_id for h in holdings) and not unreachable:
                    raise UnknownJob(f"job {key.job_id!r} is unknown to every store")
                extra = f" ({len(unreachable)} unreachable: {', '.join(unreachable)})" if unreachable else ""
                raise ShardNotFound(f"no reachable store holds a verified copy of {key}{extra}")
        with self._lock:
            pending = self._pulls.get(key)
            if pending is None:
                self._pulls[key] = threading.Event()
        if pending is not None:
            # Another path (fetch or repair) is already pulling this shard: wait for it instead of pulling twice.
            pending.wait(timeout=self.config.peer_timeout + 600)
            with self._lock:
                entry = self._entries.get(key)
            if entry is not None and entry.verified:
                return entry.source
            raise PeerUnavailable(f"a concurrent pull of {key} did not produce a verified copy")
        try:
            return self._pull_candidates(key, candidates, origin_note)
        finally:
            with self._lock:
                done = self._pulls.pop(key)
            done.set()

    def _pull_candidates(self, key: ShardKey, candidates: list[str], origin_note: str) -> str:
        errors: list[StoreError] = []
        for host in candidates:
            try:
                if host == "durable":
                    self._pull_from_durable(key)
                else:
                    self._pull_from(host, key)
                log.info("%s: pulled %s from %s", origin_note, key, host)
                return host
            except StoreError as exc:
                errors.append(exc)
        if errors and all(isinstance(e, ChecksumMismatch) for e in errors):
            raise ChecksumMismatch(f"every copy of {key} failed verification: " + "; ".join(map(str, errors)))
        raise PeerUnavailable(f"could not pull {key}: " + "; ".join(map(str, errors)))

    def _pull_from(self, host: str, key: ShardKey) -> None:
        peer = self.peers[host]
        timeout = self.config.peer_timeout + 600
        segments: list[Segment] = []

        def into(manifest: pb.Manifest) -> memoryview:
            problem = manifest_problem(manifest)
            if problem or key_from_pb(manifest.key) != key:
                raise PeerUnavailable(f"peer {host} sent an invalid manifest for {key}: {problem or 'wrong key'}")
            segments.append(self._acquire(key, max(1, manifest.nbytes)))
            return segments[-1].view()

        try:
            manifest = None
            if self.config.data_plane == "tcp":
                try:
                    manifest = peer.pull_data(key_to_pb(key), into, timeout, self.config.peer_timeout)
                except DataChannelUnsupported:
                    log.info("peer %s has no data channel; falling back to gRPC streams", host)
            if manifest is None:
                manifest, chunks, call = peer.get(key_to_pb(key), timeout=timeout)
                try:
                    receive_chunks(chunks, manifest, into(manifest))
                except StreamError as exc:
                    raise (ChecksumMismatch if isinstance(exc, ChecksumMismatch) else PeerUnavailable)(f"copy from {host}: {exc}") from None
                finally:
                    call.cancel()
        except BaseException:
            for seg in segments:
                self.pool.release(seg)
            raise
        (segment,) = segments
        self._register_pulled(key, segment, manifest_from_pb(manifest), host)

    def _pull_from_durable(self, key: ShardKey) -> None:
        assert self.durable is not None
        segments: list[Segment] = []

        def allocate(m: SpilledManifest) -> memoryview:
            segments.append(self._acquire(key, max(1, m.nbytes)))
            return segments[-1].view()

        try:
            sm = self.durable.read_into(key, allocate)
        except (SpillStorageError, LayoutError) as exc:
            for seg in segments:
                self.pool.release(seg)
            if isinstance(exc, ChecksumMismatch):
                raise ChecksumMismatch(f"durable copy of {key}: {exc}") from None
            raise PeerUnavailable(f"durable copy of {key}: {exc}") from None
        except BaseException:
            for seg in segments:
                self.pool.release(seg)
            raise
        manifest = Manifest(
            key,
            sm.world_size,
            sm.nbytes,
            sm.chunk_size,
            tuple(sm.checksums),
            sm.owner_host,
            sm.format_version,
            dict(sm.metrics),
            sm.created_unix,
        )
        self._register_pulled(key, segments[0], manifest, "durable")

    def _register_pulled(self, key: ShardKey, segment: Segment, m: Manifest, source: str) -> None:
        entry = Entry(
            key,
            m.world_size,
            m.nbytes,
            segment,
            m.owner_host,
            ShardState.REPLICA,
            manifest=m,
            metrics=dict(m.metrics),
            format_version=m.format_version,
            copies=0,
            source=source,
            created_unix=m.created_unix or time.time(),
        )
        with self._lock:
            current = self._entries.get(key)
            if current is not None and current.verified:
                self.pool.release(segment)  # somebody else brought it in meanwhile
                return
            self._register(entry)
        self._retention_due.set()

    # -- listing, deletion, restorable step -------------------------------------------------
    def _info(self, entry: Entry) -> pb.ShardInfo:
        m = entry.manifest
        manifest = (
            manifest_to_pb(m)
            if m is not None
            else pb.Manifest(key=key_to_pb(entry.key), world_size=entry.world_size, nbytes=entry.nbytes, owner_host=entry.owner_host)
        )
        return pb.ShardInfo(
            manifest=manifest, state=state_to_pb(entry.state), verified=entry.verified, error=entry.error, copies=entry.copies
        )

    def list_shards(self, job_id: str) -> pb.ListResponse:
        if job_id:
            _ensure(job_id_problem(job_id))
        with self._lock:
            infos = [self._info(e) for k, e in sorted(self._entries.items()) if not job_id or k.job_id == job_id]
        return pb.ListResponse(host_id=self.host_id, shards=infos)

    def delete(self, job_id: str, step: int, rank: int) -> int:
        _ensure(job_id_problem(job_id))
        with self._lock:
            victims = [e for k, e in self._entries.items() if k.job_id == job_id and step in (-1, k.step) and rank in (-1, k.rank)]
            if not victims and not any(k.job_id == job_id for k in self._entries):
                raise UnknownJob(f"job {job_id!r} is unknown to store {self.host_id}")
            for e in victims:
                self._drop(e, reason="deleted")
        return len(victims)

    def cluster_holdings(self, job_id: str) -> tuple[list[Holding], list[str]]:
        """What every reachable store (this one included) holds of ``job_id``, and who did not answer."""
        mine = _holdings(self.host_id, self.list_shards(job_id))
        listings = self.peers.list_all(job_id, self.config.peer_timeout)
        unreachable = sorted(h for h, r in listings.items() if isinstance(r, StoreError))
        theirs = [h for host, r in listings.items() if not isinstance(r, StoreError) for h in _holdings(host, r)]
        return mine + theirs + self._durable_holdings(job_id, unreachable), unreachable

    def _durable_holdings(self, job_id: str, unreachable: list[str]) -> list[Holding]:
        if self.durable is None:
            return []
        try:
            return self.durable.holdings(job_id)
        except (SpillStorageError, LayoutError) as exc:
            log.warning("durable tier unreadable for %s: %s", job_id, exc)
            unreachable.append("durable")
            return []

    def latest_step(self, job_id: str, step: int | None = None) -> pb.LatestStepResponse:
        """The version to restore: of the newest restorable step, or of exactly ``step``."""
        _ensure(job_id_problem(job_id))
        if step is not None and step < 0:
            raise InvalidArgument(f"step {step} is invalid: expected an int >= 0")
        holdings, unreachable = self.cluster_holdings(job_id)
        if not holdings and not unreachable:
            raise UnknownJob(f"job {job_id!r} is unknown to every store")
        found = latest_restorable(holdings, job_id, step)
        if found is None:
            split = split_timelines(holdings, job_id)
            note = (
                f"every rank saved step {split[0]} but under {len(split[1])} different timelines ({', '.join(split[1][:4])}): "
                "ranks that share no process group must share a run id (CheckpointClient(run_id=...) or MEMSTORE_RUN_ID)"
                if split
                else ""
            )
            return pb.LatestStepResponse(found=False, unreachable_hosts=unreachable, note=note)
        return pb.LatestStepResponse(
            found=True, step=found.step, world_size=found.world_size, timeline=found.timeline, unreachable_hosts=unreachable
        )

    # -- background: retention + lease expiry ------------------------------------------------
    def _janitor_loop(self) -> None:
        while not self._stop.is_set():
            self._retention_due.wait(timeout=1.0)
            if self._stop.is_set():
                return
            self._retention_due.clear()
            try:
                self._expire_leases()
                self._expire_tickets()
                self._apply_retention()
            except Exception:
                log.exception("janitor pass failed")
            self._stop.wait(0.05)  # debounce bursts of settles into one pass

    def _expire_leases(self) -> None:
        now = time.monotonic()
        with self._lock:
            stale_alloc = [k for k, lease in self._alloc_leases.items() if lease.expires < now]
            stale_read = [k for k, lease in self._read_leases.items() if lease.expires < now]
        for lease_id in stale_alloc + stale_read:
            log.warning("lease %s expired; releasing it", lease_id)
            self.release(lease_id)

    def _apply_retention(self) -> None:
        with self._lock:
            jobs = {k.job_id for k in self._entries}
        for job in sorted(jobs):
            with self._lock:
                held = [(e.key, e.state, e.created_unix) for e in self._entries.values() if e.key.job_id == job]
            crowded = len({k.version for k, _, _ in held}) > self.config.keep and retention_victims(held, self.config.keep)
            if not crowded and not may_supersede((k, created) for k, _, created in held):
                continue
            # Something would go, or a re-save may have superseded another timeline: learn the cluster's view.
            holdings, _ = self.cluster_holdings(job)
            dead = superseded_versions(holdings, job)
            latest = latest_restorable(holdings, job)
            protected = [latest.step] if latest else []
            if self.durable is not None:
                protected += sorted(self.durable.protected_steps(job))  # due for spilling: keep until spilled
            with self._lock:
                if latest:
                    self._protected[job] = latest.step
                for dead_entry in [e for e in self._entries.values() if e.key.job_id == job and e.key.version in dead and e.state.settled]:
                    log.info("dropping %s: a newer timeline re-saved step %d or earlier", dead_entry.key, dead_entry.key.step)
                    self._drop(dead_entry, reason="superseded: the job went back and saved this step again on a newer timeline")
                held = [(e.key, e.state, e.created_unix) for e in self._entries.values() if e.key.job_id == job]
                for key in retention_victims(held, self.config.keep, protected):
                    entry = self._entries.get(key)
                    if entry is not None:
                        log.debug("retention: evicting %s", key)
                        self._drop(entry, reason="evicted by retention")

    # -- background: repair ---------------------------------------------------------------------
    def _repair_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.repair_once()
            except Exception as exc:
                self.last_repair_error = str(exc)
                log.exception("repair pass failed")
            self._stop.wait(self.config.repair_interval)

    def repair_once(self) -> int:
        """Pull every recent shard this host should hold but lacks. Returns how many were pulled."""
        owners = set(self.placement.owners_held_by(self.host_id))
        sources = sorted({h for o in owners for h in self.placement.holders(o)} - {self.host_id})
        if not sources:
            return 0
        listings = self.peers.list_all("", self.config.peer_timeout, hosts=sources)
        wanted: dict[ShardKey, list[str]] = {}
        copies: dict[str, list[tuple[ShardKey, float]]] = {}
        for host, resp in listings.items():
            if isinstance(resp, StoreError):
                continue
            for info in resp.shards:
                state = state_from_pb(info.state)
                if not info.verified or state is None or not state.settled or info.manifest.owner_host not in owners:
                    continue
                key = key_from_pb(info.manifest.key)
                wanted.setdefault(key, []).append(host)
                copies.setdefault(key.job_id, []).append((key, info.manifest.created_unix))
        recent = {job: newest_versions(held, self.config.keep) for job, held in copies.items()}  # the abandoned run's steps rank lower
        pulled = 0
        for key in sorted(wanted, key=lambda k: (-k.step, k.job_id, k.rank, k.timeline)):
            if self._stop.is_set() or key.version not in recent[key.job_id]:
                continue
            with self._lock:
                if key in self._entries or key in self._receiving or key in self._pulls:
                    continue
            with self._lock:
                self._repairs_in_flight += 1
            try:
                self._pull(key, origin_note="repair", candidates=wanted[key])
                pulled += 1
                fault("repair.after_pull")
            except StoreError as exc:
                log.warning("repair of %s failed: %s", key, exc)
            finally:
                with self._lock:
                    self._repairs_in_flight -= 1
        return pulled


def _holdings(host: str, resp: pb.ListResponse) -> list[Holding]:
    return [Holding(host, key_from_pb(i.manifest.key), i.manifest.world_size, i.verified, i.manifest.created_unix) for i in resp.shards]
