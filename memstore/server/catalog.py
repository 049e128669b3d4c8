"""The catalog of the store engine: entries and their pins, segments, adoption after a crash, listings.

Every other part of the engine (``memstore.server.store`` puts them together) works on the state
declared here, under ``_lock``. It also implements the durable tier's port (``memstore.spill.port.ShardSource``).
A settled copy's sidecar holds its ShardInfo, encoded and decoded by ``memstore.server.convert``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from memstore.config import StoreConfig
from memstore.core.limits import admits, room_by_dropping
from memstore.core.model import Holding, Manifest, PutOrigin, ShardInfo, ShardKey, ShardState
from memstore.core.retention import pressure_victims
from memstore.core.status import CaptureReport
from memstore.errors import (
    AlreadySaved,
    CapacityExceeded,
    ChecksumMismatch,
    InvalidArgument,
    QuotaExceeded,
    ShardNotFound,
    TooManyStreams,
    UnknownJob,
)
from memstore.server.convert import sidecar_bytes, sidecar_info
from memstore.server.events import StoreEvents
from memstore.server.membership import Membership
from memstore.server.peers import PeerDirectory
from memstore.server.segments import NO_RING, Segment, SegmentPool
from memstore.spill.port import DurableTier
from memstore.v1.integrity import SPILL_CODECS, first_mismatch
from memstore.v1.keys import job_id_problem, key_problem
from memstore.v1.streams import manifest_problem

log = logging.getLogger(__name__)

ALLOCATE_LEASE_SECONDS = 600.0  # a trainer that allocated but never committed (it crashed) frees the segment after this
READ_LEASE_SECONDS = 600.0
GONE_REMEMBERED = 4096  # own shards dropped lately whose outcome WaitCommitted still reports


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
    checksumming: bool = False  # replication took it up (its checksums are being computed): no longer supersedable
    superseded: bool = False  # dropped before replication: a newer save of its rank came first (newest wins)
    allocated_at: float = field(default_factory=time.monotonic)  # when this entry was made (Allocate, or registration)
    taken_at: float = 0.0  # when the store took a client's save in (Commit, or its stream's end): replication starts

    @property
    def verified(self) -> bool:
        return self.manifest is not None and self.state is not ShardState.CAPTURED


@dataclass
class Inbound:
    key: ShardKey
    manifest: Manifest
    origin: PutOrigin
    segment: Segment
    sender: str = ""  # whom the transfer counts against (memstore.core.limits.transfer_sender)
    started: float = field(default_factory=time.monotonic)  # when its header was accepted


@dataclass
class Ticket:
    deadline: float
    inbound: Inbound | None = None
    outbound: Entry | None = None


def sender_error(exc: BaseException) -> BaseException:
    """The error the sender of a failed transfer sees: stream and channel errors are typed already."""
    if isinstance(exc, ChecksumMismatch):
        return type(exc)(f"{exc}; the copy was discarded, the sender should retry")
    return exc


@dataclass
class Lease:
    entry: Entry
    expires: float
    ahead: bool = False  # an allocation for a rank's next save, whose step is named at commit


def codec_problem(codec: str) -> str | None:
    if codec and codec not in SPILL_CODECS:
        return f"spill codec {codec!r} is unknown: expected one of {', '.join(SPILL_CODECS)} (or empty for the store's default)"
    return None


def ensure(problem: str | None) -> None:
    if problem:
        raise InvalidArgument(problem)


def holdings_of(host: str, shards: Iterable[ShardInfo]) -> list[Holding]:
    return [Holding(host, i.manifest.key, i.manifest.world_size, i.verified, i.manifest.created_unix) for i in shards]


class Catalog:
    """Entries, pins and segments of the shards this store holds."""

    # The engine's state, set by ``Store.__init__``; every part of the engine reads it through here.
    config: StoreConfig
    host_id: str
    membership: Membership
    draining: threading.Event
    pool: SegmentPool
    peers: PeerDirectory
    durable: DurableTier | None
    data_port: int
    last_repair_error: str
    events: StoreEvents  # the metrics' event points (a no-op without --metrics-port)
    capture: CaptureReport  # what clients reported of their captures (summed over commits)
    saves_superseded: int  # saves dropped before replication because a newer save of the same rank came (newest wins)
    _gone: dict[ShardKey, ShardInfo]  # this store's own shards dropped lately, as they ended (WaitCommitted reports them)
    under_replicated: int  # from the last repair pass: recent shards of this store's slots with fewer than R reachable copies
    unreachable_sources: tuple[str, ...]  # from the last repair pass: holders of this store's slots that did not answer
    _lock: threading.Condition
    _entries: dict[ShardKey, Entry]
    _alloc_leases: dict[str, Lease]
    _read_leases: dict[str, Lease]
    _receiving: set[ShardKey]
    _streams: dict[str, int]  # sender -> inbound transfers open (Put streams, receive tickets); see _admit_stream
    _tickets: dict[bytes, Ticket]
    _pulls: dict[ShardKey, threading.Event]  # in-flight pulls, shared by fetch and repair
    _protected: dict[str, int]  # job -> newest restorable step, protected from eviction
    _replication: ThreadPoolExecutor
    _push: ThreadPoolExecutor
    _in_flight: int
    _repairs_in_flight: int
    _fetching: int
    _stop: threading.Event
    _retention_due: threading.Event

    def _adopt_segments(self) -> int:
        """Take over the verified shards a previous incarnation of this host left in shared memory.

        Each settled copy has a sidecar (its ShardInfo) next to its segment; a segment is adopted only if
        the sidecar is well-formed and every chunk still matches its checksum, so a store that crashed
        serves its RAM again without a network repair (GEMINI's software-failure path). The rest is deleted.
        """

        def check(seg: Segment, meta: bytes) -> bool:
            info = sidecar_info(meta)
            m = info.manifest
            problem = manifest_problem(m) or key_problem(m.key.job_id, m.key.step, m.key.rank, m.world_size, m.key.timeline)
            if problem or info.state is None or not info.state.settled or m.nbytes > seg.size:
                return False
            return first_mismatch(seg.view(), m.nbytes, m.chunk_size, m.checksums) is None

        adopted = self.pool.adopt(check)
        for seg, meta in adopted:
            info = sidecar_info(meta)
            m = info.manifest
            seg.owner = m.key.job_id  # never pooled for another job
            state = info.state or ShardState.REPLICA
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
            self.pool.describe(entry.segment, sidecar_bytes(self._info(entry)))

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

    def _acquire(
        self, key: ShardKey, nbytes: int, preferred: str = "", ring: int = NO_RING, evict: bool = True, grow: bool = False
    ) -> Segment:
        """A segment for ``key``, within the store's capacity and the job's quota (``--job-quota``).

        Over either limit, drop the fewest of what ``pressure_victims`` offers (the job's own older copies,
        never its newest settled version nor its protected steps) that make room, and try again; when even
        all of them would not, refuse at once and drop nothing (``memstore.core.limits.room_by_dropping``).
        ``evict=False`` (memory reserved ahead of a save, which may never come): refuse rather than drop anything.
        """
        while True:
            try:
                return self.pool.acquire(
                    nbytes, key.job_id, what=f"shard {key}", quota=self.config.job_quota, preferred=preferred, ring=ring, grow=grow
                )
            except CapacityExceeded as exc:  # QuotaExceeded included: its numbers are the job's
                if not evict:
                    raise
                with self._lock:
                    job = [e for e in self._entries.values() if e.key.job_id == key.job_id]
                    held = [(e.key, e.state, e.created_unix) for e in job]
                    protected = [self._protected[key.job_id]] if key.job_id in self._protected else []
                    sizes = {e.key: e.segment.size for e in job}
                    candidates = [(k, sizes[k]) for k in pressure_victims(held, key, protected)]
                    victims = room_by_dropping(candidates, exc.used, exc.needed, exc.capacity)
                    if not victims:
                        raise
                    what = "the job's quota" if isinstance(exc, QuotaExceeded) else "memory"
                    for victim in (self._entries[k] for k in victims):
                        log.warning("pressure on %s: dropping %s (%s) to fit %s", what, victim.key, victim.state.value, key)
                        self._drop(victim, reason=f"dropped under pressure on {what} for step {key.step}")

    def _admit_stream(self, sender: str) -> None:
        """Count one more open inbound transfer of ``sender`` (caller holds the lock); refused beyond --max-streams-per-peer."""
        active = self._streams.get(sender, 0)
        limit = self.config.max_streams_per_peer
        if not admits(active, limit):
            kind, _, who = sender.partition(":")
            whom = f"the clients of job {who!r}" if kind == "job" else f"peer {who!r}"
            raise TooManyStreams(
                f"{whom} already have {active} transfers open to store {self.host_id}, the most allowed "
                f"(--max-streams-per-peer {limit}); retry once one has finished, or raise --max-streams-per-peer",
                sender=sender,
                active=active,
                max_streams=limit,
            )
        self._streams[sender] = active + 1

    def _end_stream(self, sender: str) -> None:
        """An inbound transfer of ``sender`` ended, stored or not (caller holds the lock)."""
        left = self._streams.get(sender, 0) - 1
        if left > 0:
            self._streams[sender] = left
        else:
            self._streams.pop(sender, None)

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
            if entry.owner_host == self.host_id and entry.state is not ShardState.REPLICA:
                self._gone[entry.key] = self._info(entry)  # a client's wait() on it still learns how it ended
                while len(self._gone) > GONE_REMEMBERED:
                    del self._gone[next(iter(self._gone))]
        if not entry.error and not entry.state.settled:
            entry.error = reason
        entry.dropped = True
        if entry.pins == 0:
            self.pool.release(entry.segment)
        self._lock.notify_all()

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
        ensure(key_problem(key.job_id, key.step, key.rank, timeline=key.timeline))
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

    def _info(self, entry: Entry) -> ShardInfo:
        m = entry.manifest
        if m is None:  # not checksummed yet: what is known of it
            m = Manifest(entry.key, entry.world_size, entry.nbytes, chunk_size=0, checksums=(), owner_host=entry.owner_host)
        return ShardInfo(m, entry.state, entry.verified, entry.error, entry.copies, entry.superseded)

    def list_shards(self, job_id: str) -> list[ShardInfo]:
        """Every copy this store holds (of ``job_id``, or of every job when it is ""), in key order."""
        if job_id:
            ensure(job_id_problem(job_id))
        with self._lock:
            return [self._info(e) for k, e in sorted(self._entries.items()) if not job_id or k.job_id == job_id]

    def delete(self, job_id: str, step: int, rank: int) -> int:
        """Drop the copies of ``job_id`` at ``step`` and ``rank`` (-1: every step, every rank); returns how many."""
        ensure(job_id_problem(job_id))
        for name, value in (("step", step), ("rank", rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < -1:
                raise InvalidArgument(f"{name} {value!r} is invalid: expected an int >= 0, or -1 for every {name}")
        with self._lock:
            victims = [e for k, e in self._entries.items() if k.job_id == job_id and step in (-1, k.step) and rank in (-1, k.rank)]
            if not victims and not any(k.job_id == job_id for k in self._entries):
                raise UnknownJob(f"job {job_id!r} is unknown to store {self.host_id}")
            for e in victims:
                self._drop(e, reason="deleted")
        return len(victims)
