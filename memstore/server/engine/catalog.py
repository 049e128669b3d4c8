"""The catalog of the store engine: the shards held, their leases, and the engine's one condition.

``Catalog`` owns the entries (and how this store's own shards that were dropped lately ended), the allocation and
read leases, the pins, the keys arriving or being pulled, the restore/repair/replication counters, and the one
``threading.Condition`` that guards them and that saves, reads, restores and repairs wait on. Every other part of
the engine (``memstore.server.store`` builds them) gets the catalog in its constructor and changes what it holds only
through its methods, each of which takes the lock itself. It speaks the core's plain types; the segment pool is its
port: a dropped entry's segment goes back there once nobody reads it. It serves the durable tier's reads
(``memstore.spill.port.ShardSource``, through the ``Store``).

What lives elsewhere, each with its own lock or none: the data channel's one-time tickets (``tickets.Tickets``,
owned by ``DataPath``), per-sender admission of inbound transfers (``admission.Admission``), crash adoption and the
sidecars' encoding (``leftovers.Adoption``, ``leftovers.Sidecars``, which the catalog calls to describe a settled
copy), and finding room for a shard under pressure (``room.Room``, which asks the catalog to drop what it may).
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from dataclasses import replace

from memstore.config import StoreConfig
from memstore.core.floors import floor_problem
from memstore.core.limits import room_by_dropping
from memstore.core.model import Manifest, ShardInfo, ShardKey, ShardState, Stripe
from memstore.core.retention import pressure_victims, retention_victims
from memstore.errors import AlreadySaved, CapacityExceeded, LeaseError, QuotaExceeded, ShardNotFound, UnknownJob
from memstore.server.engine.entries import (
    ALLOCATE_LEASE_SECONDS,
    GONE_REMEMBERED,
    READ_LEASE_SECONDS,
    Entry,
    Inbound,
    Lease,
    bind_problem,
    ensure,
)
from memstore.server.memory.leftovers import Sidecars
from memstore.server.memory.pool import SegmentPool
from memstore.v1.integrity import ChunkChecksums
from memstore.v1.keys import job_id_problem, key_problem
from memstore.v1.streams import stripe_problem

log = logging.getLogger(__name__)
DELETED_SECONDS = 60.0  # how long repair leaves a deleted shard alone (see Catalog.recently_deleted)


class Catalog:
    """The shards this store holds and their leases, under the engine's one lock.

    Every change goes through one of its methods, each of which takes the lock itself; methods ending in ``_locked``
    expect the caller (this class) to hold it. ``sidecars`` describes a settled copy next to its segment, under the
    lock (so never after the entry was dropped): the lock order is this lock, then the pool's.
    """

    def __init__(self, host_id: str, config: StoreConfig, pool: SegmentPool, stop: threading.Event, sidecars: Sidecars) -> None:
        """``stop``: set when the store closes; waits on the lock give up then (``wake`` wakes them)."""
        self.host_id = host_id
        self.config = config
        self.pool = pool
        self._sidecars = sidecars
        self._stop = stop
        self._lock = threading.Condition()
        self._entries: dict[ShardKey, Entry] = {}
        self._gone: dict[ShardKey, ShardInfo] = {}  # this store's own shards dropped lately, as they ended (WaitCommitted)
        self._alloc_leases: dict[str, Lease] = {}
        self._read_leases: dict[str, Lease] = {}
        self._receiving: set[ShardKey] = set()  # memory reserved, bytes arriving (Saver.begin_receive)
        self._pulls: dict[ShardKey, threading.Event] = {}  # in-flight pulls, shared by fetch and repair
        self._protected: dict[str, int] = {}  # job -> newest restorable step, protected from eviction
        self._floor: dict[str, tuple[int, str]] = {}  # job -> its restorable floor: nothing at or above it is evicted
        self._deleted: dict[tuple[str, int, int], float] = {}  # (job, step, rank) deleted (-1: every) -> when
        self._in_flight = 0  # shards being checksummed or replicated
        self.stripes_settled = 0  # stripes settled or pulled in (not cached) so far: the assembler rescans when it moves
        self._repairs_in_flight = 0
        self._fetching = 0  # restores pulling a shard now (repair waits for them: memstore.server.engine.recovery)
        self._saves_superseded = 0  # saves dropped before replication because a newer save of the same rank came

    # ---- counters and snapshots (read-only views for the store's reports)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def repairs_in_flight(self) -> int:
        return self._repairs_in_flight

    @property
    def saves_superseded(self) -> int:
        return self._saves_superseded

    def get(self, key: ShardKey) -> Entry | None:
        with self._lock:
            return self._entries.get(key)

    def census_copies(self) -> list[tuple[ShardKey, int, ShardState]]:
        with self._lock:
            return [(k, e.nbytes, e.state) for k, e in self._entries.items() if not e.dropped]

    def alive(self, timeout: float) -> bool:
        """The lock can be taken within ``timeout`` seconds (a deadlocked store says False)."""
        if not self._lock.acquire(timeout=timeout):
            return False
        self._lock.release()
        return True

    def wake(self) -> None:
        """Wake every wait on the lock (the store is closing: ``stop`` is set)."""
        with self._lock:
            self._lock.notify_all()

    def busy(self) -> bool:
        """A trainer is copying a save in (an open allocation), a shard is being checksummed or replicated, or pulled for
        a restore or a repair: the catalog's part of what background work yields to (``Store.foreground_busy``). Takes
        no lock: the pool's reserve asks it while it may hold its own."""
        return (
            any(not lease.ahead for lease in list(self._alloc_leases.values()))
            or self._in_flight > 0
            or self._repairs_in_flight > 0
            or self._fetching > 0
        )

    # ---- memory pressure (memstore.server.engine.room asks)

    def drop_cached(self, key: ShardKey, quota: bool) -> bool:
        """Drop the oldest copy pulled ahead of a restore (of ``key``'s job only when its quota is the limit); False if none."""
        with self._lock:
            cached = [e for e in self._entries.values() if e.cached and (not quota or e.key.job_id == key.job_id)]
            if not cached:
                return False
            victim = min(cached, key=lambda e: e.created_unix)
            log.info("dropping %s, pulled ahead of a restore, to fit %s", victim.key, key)
            self._drop_locked(victim, reason=f"cached copy dropped to fit step {key.step}")
            return True

    def make_room(self, key: ShardKey, short: CapacityExceeded) -> bool:
        """Drop the fewest of what ``pressure_victims`` offers (``key``'s job's own older copies, never its newest settled
        version nor its protected steps) that make the room ``short`` lacks; False, nothing dropped, when even all of
        them would not (``memstore.core.limits.room_by_dropping``). ``QuotaExceeded``: its numbers are the job's."""
        with self._lock:
            job = [e for e in self._entries.values() if e.key.job_id == key.job_id]
            held = [(e.key, e.state, e.created_unix) for e in job]
            protected = [self._protected[key.job_id]] if key.job_id in self._protected else []
            sizes = {e.key: e.segment.size for e in job}
            candidates = [(k, sizes[k]) for k in pressure_victims(held, key, protected, self._floor.get(key.job_id))]
            victims = room_by_dropping(candidates, short.used, short.needed, short.capacity)
            what = "the job's quota" if isinstance(short, QuotaExceeded) else "memory"
            for victim in (self._entries[k] for k in victims):
                log.warning("pressure on %s: dropping %s (%s) to fit %s", what, victim.key, victim.state.value, key)
                self._drop_locked(victim, reason=f"dropped under pressure on {what} for step {key.step}")
            return bool(victims)

    def stripes_wanted(self) -> list[tuple[ShardKey, int]]:
        """The other stripes of the newest save of every replica-group member that saves here, which this store neither
        holds nor is bringing in, with the size of the member's own stripe (theirs are about as large)."""
        with self._lock:
            newest: dict[tuple[str, int], Entry] = {}
            for e in self._entries.values():
                if e.owner_host != self.host_id or e.cached or not e.state.settled or e.manifest is None or e.manifest.stripe is None:
                    continue
                mine = newest.get((e.key.job_id, e.key.rank))
                if mine is None or e.created_unix > mine.created_unix:
                    newest[(e.key.job_id, e.key.rank)] = e
            wanted = []
            for e in newest.values():
                stripe = e.manifest.stripe if e.manifest is not None else None
                for rank in stripe.group if stripe is not None else ():
                    k = replace(e.key, rank=rank)
                    if rank != e.key.rank and k not in self._entries and k not in self._pulls and k not in self._receiving:
                        wanted.append((k, e.nbytes))
            return sorted(wanted)

    # ---- entries: registration, drop, pins

    def refuse_resave(self, key: ShardKey) -> None:
        """A client capture of a shard already held on the same timeline: refused.

        Two captures of one (job, step, rank, timeline) would make that step a mix of two saves. Clients
        move to a new timeline themselves when they save a step again; this catches a reused run id.
        """
        with self._lock:
            self._refuse_resave_locked(key)

    def _refuse_resave_locked(self, key: ShardKey) -> None:
        held = self._entries.get(key)
        if held is not None and not held.dropped:
            raise AlreadySaved(
                f"shard {key} is already saved on store {self.host_id}: saving a step again needs a new timeline "
                "(the client starts one when it saves a step at or below one it saved; a restarted job needs a new run id)"
            )

    def _register_locked(self, entry: Entry) -> None:
        """Put ``entry`` in the catalog, replacing an older copy of the same shard.

        The same shard means the same (job, step, rank, timeline): a re-save of a step on another timeline
        is another shard, and the old version stays until retention finds it superseded
        (``memstore.core.restorable``): re-saves are atomic and never mix with the old version.
        """
        old = self._entries.get(entry.key)
        if old is not None and old is not entry:
            self._drop_locked(old, reason="replaced by a newer copy of the same shard")
        self._entries[entry.key] = entry
        self._describe_locked(entry)
        self._lock.notify_all()

    def _describe_locked(self, entry: Entry) -> None:
        """Record a settled copy next to its segment so a restart can adopt it (``leftovers.Sidecars``)."""
        if entry.verified and entry.state.settled and not entry.dropped:
            self._sidecars.describe(entry.segment, entry.info())

    def register_adopted(self, entries: list[Entry]) -> tuple[list[Entry], int]:
        """Register copies adopted from shared memory (``leftovers.Adoption``; described already), but for those whose
        shard is held already (pulled or saved meanwhile, or twice among ``entries``): returns them, and the bytes held."""
        with self._lock:
            twice = []
            for entry in entries:
                if entry.key in self._entries:
                    twice.append(entry)
                else:
                    self._entries[entry.key] = entry
            return twice, sum(e.nbytes for e in self._entries.values())

    def drop(self, entry: Entry, reason: str) -> None:
        """Remove from the catalog; free the segment once nobody reads it."""
        with self._lock:
            self._drop_locked(entry, reason)

    def _drop_locked(self, entry: Entry, reason: str) -> None:
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
            if entry.owner_host == self.host_id and entry.state is not ShardState.REPLICA:
                self._gone[entry.key] = entry.info()  # a client's wait() on it still learns how it ended
                while len(self._gone) > GONE_REMEMBERED:
                    del self._gone[next(iter(self._gone))]
        if not entry.error and not entry.state.settled:
            entry.error = reason
        entry.dropped = True
        if entry.pins == 0:
            self.pool.release(entry.segment)
        self._lock.notify_all()

    def pin(self, entry: Entry) -> bool:
        """Keep ``entry``'s segment from being freed or reused (False: it was dropped already)."""
        with self._lock:
            if entry.dropped:
                return False
            entry.pins += 1
            return True

    def unpin(self, entry: Entry) -> None:
        with self._lock:
            entry.pins -= 1
            if entry.pins == 0 and entry.dropped:
                self.pool.release(entry.segment)

    def readable(self, key: ShardKey, wait: float = 30.0) -> Entry:
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

    def wait_settled(self, key: ShardKey, deadline: float) -> tuple[ShardInfo, bool]:
        """``key``'s info once it settled, or as it is at ``deadline`` (or when the store stops); True if it settled."""
        with self._lock:
            while True:
                entry = self._entries.get(key)
                if entry is None and key in self._gone:  # dropped since (superseded, or evicted after it settled)
                    return self._gone[key], True
                if entry is None:
                    raise ShardNotFound(f"shard {key} is not held by store {self.host_id}")
                if entry.state.settled:
                    return entry.info(), True
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stop.is_set():
                    return entry.info(), False
                self._lock.wait(remaining)

    def list_shards(self, job_id: str) -> list[ShardInfo]:
        """Every copy this store holds (of ``job_id``, or of every job when it is ""), in key order."""
        if job_id:
            ensure(job_id_problem(job_id))
        with self._lock:
            return [e.info() for k, e in sorted(self._entries.items()) if not job_id or k.job_id == job_id]

    def delete(self, job_id: str, step: int, rank: int) -> int:
        """Drop the copies of ``job_id`` at ``step`` and ``rank`` (-1: every step, every rank; checked by ``Store.delete``);
        returns how many."""
        with self._lock:
            victims = [e for k, e in self._entries.items() if k.job_id == job_id and step in (-1, k.step) and rank in (-1, k.rank)]
            if not victims and not any(k.job_id == job_id for k in self._entries):
                raise UnknownJob(f"job {job_id!r} is unknown to store {self.host_id}")
            for e in victims:
                self._drop_locked(e, reason="deleted")
            self._deleted[(job_id, step, rank)] = time.monotonic()  # repair pulls none of these back for a while
        return len(victims)

    def recently_deleted(self, key: ShardKey) -> bool:
        """Whether ``key`` was deleted here (``delete``) within ``DELETED_SECONDS``: a delete runs store by store, and
        a repair pass in between must not pull back a copy another store has not deleted yet."""
        since = time.monotonic() - DELETED_SECONDS
        with self._lock:
            return any(self._deleted.get((key.job_id, s, r), -math.inf) > since for s in (key.step, -1) for r in (key.rank, -1))

    # ---- saves: allocation leases, commit, newest wins

    def lease_allocation(self, entry: Entry, ahead: bool) -> str:
        """An allocation lease on ``entry`` (not in the catalog until committed); returns its id."""
        lease_id = secrets.token_hex(16)
        with self._lock:
            self._alloc_leases[lease_id] = Lease(entry, time.monotonic() + ALLOCATE_LEASE_SECONDS, ahead=ahead)
        return lease_id

    def commit_lease(
        self, lease_id: str, key: ShardKey | None, nbytes: int, metrics: dict[str, float], format_version: int, spill_codec: str,
        stripe: Stripe | None = None, floor: int | None = None, checksums: ChunkChecksums | None = None,
    ) -> Entry:  # fmt: skip
        """Register the shard of allocation lease ``lease_id`` (see ``Saver.commit``); older captures of its rank that
        replication has not taken up yet are superseded (newest wins). Returns its entry.

        A wrong key, size, ``stripe``, restorable ``floor`` or client ``checksums`` (checked against the shard the lease
        holds) is refused and the lease kept."""
        with self._lock:
            lease = self._alloc_leases.get(lease_id)
            if lease is None:
                raise LeaseError(f"allocation lease {lease_id!r} is unknown or expired; allocate again")
            entry = lease.entry
            ensure(bind_problem(lease, key, nbytes))
            ensure(None if floor is None else floor_problem(floor, (key or entry.key).step))
            if stripe is not None:
                rank = entry.key.rank  # an ahead lease's commit may name another step, never another rank
                ensure(stripe_problem(stripe, rank, entry.world_size, nbytes or entry.nbytes))
            if checksums is not None:
                ensure(checksums.problem(nbytes or entry.nbytes, self.config.chunk_bytes))
            del self._alloc_leases[lease_id]
            entry.segment.sparse = False  # its client faulted every page in before it wrote the first byte
            if lease.ahead:
                assert key is not None
                entry.key = key
                entry.nbytes = nbytes or entry.nbytes
            try:
                self._refuse_resave_locked(entry.key)
            except AlreadySaved:
                self.pool.release(entry.segment)
                raise
            entry.metrics = dict(metrics)
            entry.format_version = format_version
            entry.spill_codec = spill_codec
            entry.stripe = stripe
            entry.client_checksums = None if checksums is None else checksums.values
            entry.taken_at = time.monotonic()
            self._register_locked(entry)
            self._supersede_older_locked(entry)
        return entry

    def _supersede_older_locked(self, entry: Entry) -> None:
        """Newest wins: older captures of the same rank that replication has not taken up yet are dropped, so saves
        that come faster than the store can checksum and push them never pile up in RAM.

        Only captures not yet checksummed go: none of them is verified, so none can be a restorable step.
        """
        key = entry.key
        older = [
            e for k, e in self._entries.items()
            if k.job_id == key.job_id and k.rank == key.rank and e is not entry and e.state is ShardState.CAPTURED
            and not e.checksumming and e.pins == 0 and e.allocated_at <= entry.allocated_at
        ]  # fmt: skip
        for old in older:
            old.superseded = True
            old.state = ShardState.UNDER_REPLICATED  # ended: no copy anywhere
            old.copies = 0
            old.error = f"superseded by step {key.step} before it was replicated (newest wins)"
            self._saves_superseded += 1
            self._drop_locked(old, reason=old.error)
            log.info("%s superseded by step %d before replication took it up (newest wins)", old.key, key.step)

    # ---- reads: read leases

    def lease_reader(self, entry: Entry) -> str:
        """A read lease on a pinned ``entry``; returns its id (``release_lease`` unpins it)."""
        lease_id = secrets.token_hex(16)
        with self._lock:
            self._read_leases[lease_id] = Lease(entry, time.monotonic() + READ_LEASE_SECONDS)
        return lease_id

    def release_lease(self, lease_id: str) -> None:
        """End a read lease (unpin) or an allocation lease that was never committed (free its segment)."""
        with self._lock:
            lease = self._read_leases.pop(lease_id, None)
            alloc = self._alloc_leases.pop(lease_id, None)
        if lease is not None:
            self.unpin(lease.entry)
        elif alloc is not None:
            self.pool.release(alloc.entry.segment)

    def stale_leases(self, now: float) -> list[str]:
        """The ids of the allocation leases, then the read leases, that expired before ``now``."""
        with self._lock:
            stale_alloc = [k for k, lease in self._alloc_leases.items() if lease.expires < now]
            stale_read = [k for k, lease in self._read_leases.items() if lease.expires < now]
        return stale_alloc + stale_read

    # ---- inbound transfers (Saver.begin_receive: admitted, memory reserved)

    def mark_receiving(self, key: ShardKey) -> None:
        """Memory is reserved for ``key`` and its bytes are arriving (repair does not pull it meanwhile)."""
        with self._lock:
            self._receiving.add(key)

    def abort_inbound(self, inbound: Inbound) -> None:
        """A transfer failed: its memory goes back and ``inbound.key`` is no longer arriving."""
        self.pool.release(inbound.segment)
        with self._lock:
            self._receiving.discard(inbound.key)

    def register_inbound(self, inbound: Inbound, entry: Entry) -> None:
        """A fully received and verified shard: ``entry`` joins the catalog in the same step as it stops arriving."""
        with self._lock:
            self._receiving.discard(inbound.key)
            self._register_locked(entry)

    # ---- replication's steps

    def add_in_flight(self, n: int) -> None:
        with self._lock:
            self._in_flight += n

    def take_up(self, entry: Entry) -> bool:
        """Replication takes ``entry`` up: from now on no newer save supersedes it. False: it was superseded already."""
        with self._lock:
            entry.checksumming = True
            return not entry.dropped

    def checksummed(self, entry: Entry, manifest: Manifest) -> None:
        with self._lock:
            entry.manifest = manifest
            entry.state = ShardState.REPLICATING
            self._lock.notify_all()

    def mark_superseded(self, entry: Entry) -> None:
        """Every push of ``entry`` was skipped for a newer capture (newest wins): the client's wait() says so."""
        with self._lock:
            entry.superseded = True
            self._saves_superseded += 1

    def settle(self, entry: Entry, copies: int, errors: list[str]) -> ShardState:
        """``entry`` reached ``copies`` copies: COMMITTED with R of them, else UNDER_REPLICATED (``errors`` say why)."""
        replicas = self.config.replicas
        with self._lock:
            entry.copies = copies
            if copies >= replicas:
                entry.state = ShardState.COMMITTED
                entry.error = ""
            else:
                entry.state = ShardState.UNDER_REPLICATED
                entry.error = f"{copies} of {replicas} copies: " + "; ".join(errors)
                log.warning("shard %s under-replicated: %s", entry.key, entry.error)
            if entry.manifest is not None and entry.manifest.stripe is not None:
                self.stripes_settled += 1  # the assembler looks at what is wanted again
            self._describe_locked(entry)
            self._lock.notify_all()
            return entry.state

    # ---- recovery's steps: restores, pulls, repairs

    def fetch_started(self) -> None:
        """A restore pulls a shard now: repair starts no new pull meanwhile."""
        with self._lock:
            self._fetching += 1

    def fetch_ended(self) -> None:
        with self._lock:
            self._fetching -= 1
            self._lock.notify_all()

    def claim_pull(self, key: ShardKey) -> threading.Event | None:
        """Claim the pull of ``key`` (None: ``end_pull`` must follow), or the event of the pull already under way."""
        with self._lock:
            pending = self._pulls.get(key)
            if pending is None:
                self._pulls[key] = threading.Event()
            return pending

    def end_pull(self, key: ShardKey) -> None:
        with self._lock:
            done = self._pulls.pop(key)
        done.set()

    def register_pulled(self, entry: Entry) -> bool:
        """Register a copy pulled in; False (its segment freed) when a verified copy arrived meanwhile."""
        with self._lock:
            current = self._entries.get(entry.key)
            if current is not None and current.verified:
                self.pool.release(entry.segment)  # somebody else brought it in meanwhile
                return False
            self._register_locked(entry)
            if not entry.cached and entry.manifest is not None and entry.manifest.stripe is not None:
                self.stripes_settled += 1  # a replacement's own stripe, repaired: its group may be assembled here now
            return True

    def begin_repair(self, key: ShardKey, restore_first: float) -> bool:
        """Start repairing ``key``: first wait (at most ``restore_first`` seconds) for restores in flight, then False when
        it is not needed (here, arriving, being pulled, or the store stops). True: ``end_repair`` must follow."""
        with self._lock:
            # Restores first: a trainer waiting for a shard gets the links and the memory before repair does.
            self._lock.wait_for(lambda: not self._fetching or self._stop.is_set(), timeout=restore_first)
            if key in self._entries or key in self._receiving or key in self._pulls or self._stop.is_set():
                return False
            self._repairs_in_flight += 1
            return True

    def end_repair(self) -> None:
        with self._lock:
            self._repairs_in_flight -= 1

    def own_under_replicated(self) -> int:
        """This store's own shards that settled with fewer than R copies."""
        with self._lock:
            return sum(1 for e in self._entries.values() if e.owner_host == self.host_id and e.state is ShardState.UNDER_REPLICATED)

    def verified_copies(self) -> list[tuple[ShardKey, str, float, bool]]:
        """(key, owner host, capture time, settled) of every verified copy held, but cached ones (not one of the R)."""
        with self._lock:
            return [(k, e.owner_host, e.created_unix, e.state.settled) for k, e in self._entries.items() if e.verified and not e.cached]

    def settled_copies(self) -> list[Entry]:
        """The settled, verified copies held (what a drain may have to give away)."""
        with self._lock:
            return [e for e in self._entries.values() if e.verified and e.state.settled and not e.dropped]

    # ---- retention

    def jobs(self) -> set[str]:
        with self._lock:
            return {k.job_id for k in self._entries}

    def held(self, job_id: str) -> list[tuple[ShardKey, ShardState, float]]:
        """(key, state, capture time) of every copy of ``job_id`` held: what retention decides on."""
        with self._lock:
            return [(e.key, e.state, e.created_unix) for e in self._entries.values() if e.key.job_id == job_id]

    def retire(
        self, job_id: str, dead: set[tuple[int, str]], latest: int | None, protected: list[int], floor: tuple[int, str] | None = None
    ) -> None:
        """Drop the settled copies of ``job_id``'s superseded versions ``dead``, then what keep-K retention evicts
        (never ``protected`` steps, nothing at or above the restorable ``floor``); ``latest``, the newest restorable
        step, and the floor are protected from pressure too."""
        with self._lock:
            if latest is not None:
                self._protected[job_id] = latest
            if floor is not None:
                self._floor[job_id] = floor
            for dead_entry in [e for e in self._entries.values() if e.key.job_id == job_id and e.key.version in dead and e.state.settled]:
                log.info("dropping %s: a newer timeline re-saved step %d or earlier", dead_entry.key, dead_entry.key.step)
                self._drop_locked(dead_entry, reason="superseded: the job went back and saved this step again on a newer timeline")
            held = [(e.key, e.state, e.created_unix) for e in self._entries.values() if e.key.job_id == job_id]
            for key in retention_victims(held, self.config.keep, protected, floor):
                entry = self._entries.get(key)
                if entry is not None:
                    log.debug("retention: evicting %s", key)
                    self._drop_locked(entry, reason="evicted by retention")
