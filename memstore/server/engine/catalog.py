"""The catalog of the store engine: the shards held, their leases, and the engine's one condition.

``Catalog`` owns the entries (and how this store's own shards that were dropped lately ended), the allocation and
read leases, the pins, the replication counters, and the one ``threading.Condition`` (``cond``, over an ``RLock``)
that guards them and that saves, reads, restores and repairs wait on. Every other part of the engine
(``memstore.server.store`` builds them) gets the catalog in its constructor and changes what it holds only through
its methods. It speaks the core's plain types; the segment pool is its port: a dropped entry's segment goes back
there once nobody reads it. It serves the durable tier's reads (``memstore.spill.port.ShardSource``, through the
``Store``).

Two parts keep their own state under this same condition, because it must agree with the entries at the same
instant: ``arrivals.Arrivals`` (the pulls claimed, restores and repairs in flight, the transfers arriving) and
``eviction.Eviction`` (what retention, pressure and deletes drop, and what they protect or remember). Holding
``cond``, they call the catalog's ``*_locked`` methods (``get_locked``, ``entries_locked``, ``register_locked``,
``drop_locked``, ``stripes_missing_locked``), which take no lock and must be called with it held. The catalog never
calls them back: whichever part begins a step takes the one lock, and under it only the pool's is ever taken.

What lives elsewhere, each with its own lock or none: the data channel's one-time tickets (``tickets.Tickets``,
owned by ``DataPath``), per-sender admission of inbound transfers (``admission.Admission``), crash adoption and the
sidecars' encoding (``leftovers.Adoption``, ``leftovers.Sidecars``, which the catalog calls to describe a settled
copy), and finding room for a shard under pressure (``room.Room``, which asks ``Eviction`` to drop what it may).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from memstore.config import StoreConfig
from memstore.core.floors import floor_problem
from memstore.core.model import ErasurePlace, Manifest, ShardInfo, ShardKey, ShardState, Stripe
from memstore.errors import AlreadySaved, LeaseError, ShardNotFound, UnknownJob
from memstore.server.engine.entries import (
    ALLOCATE_LEASE_SECONDS,
    GONE_REMEMBERED,
    READ_LEASE_SECONDS,
    Entry,
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


class Catalog:
    """The shards this store holds and their leases, under the engine's one lock (``cond``).

    Every change goes through one of its methods. Those not ending in ``_locked`` take the lock themselves; those
    ending in ``_locked`` take none and expect the caller to hold ``cond`` (this class, ``Arrivals``, ``Eviction``).
    ``sidecars`` describes a settled copy next to its segment, under the lock (so never after the entry was dropped):
    the lock order is this lock, then the pool's.
    """

    def __init__(self, host_id: str, config: StoreConfig, pool: SegmentPool, stop: threading.Event, sidecars: Sidecars) -> None:
        """``stop``: set when the store closes; waits on the lock give up then (``wake`` wakes them)."""
        self.host_id = host_id
        self.config = config
        self.pool = pool
        self._sidecars = sidecars
        self._stop = stop
        self.cond = threading.Condition()  # over an RLock: a part holding it may call the methods that take it
        self._entries: dict[ShardKey, Entry] = {}
        self._gone: dict[ShardKey, ShardInfo] = {}  # this store's own shards dropped lately, as they ended (WaitCommitted)
        self._alloc_leases: dict[str, Lease] = {}
        self._read_leases: dict[str, Lease] = {}
        self._in_flight = 0  # shards being checksummed or replicated
        self.stripes_settled = 0  # stripes settled or pulled in (not cached) so far: the assembler rescans when it moves
        self._saves_superseded = 0  # saves dropped before replication because a newer save of the same rank came

    # ---- counters and snapshots (read-only views for the store's reports)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def saves_superseded(self) -> int:
        return self._saves_superseded

    def get(self, key: ShardKey) -> Entry | None:
        with self.cond:
            return self._entries.get(key)

    def census_copies(self) -> list[tuple[ShardKey, int, ShardState]]:
        with self.cond:
            return [(k, e.nbytes, e.state) for k, e in self._entries.items() if not e.dropped]

    def alive(self, timeout: float) -> bool:
        """The lock can be taken within ``timeout`` seconds (a deadlocked store says False)."""
        if not self.cond.acquire(timeout=timeout):
            return False
        self.cond.release()
        return True

    def wake(self) -> None:
        """Wake every wait on the lock (the store is closing: ``stop`` is set)."""
        with self.cond:
            self.cond.notify_all()

    def busy(self) -> bool:
        """A trainer is copying a save in (an open allocation), or a shard is being checksummed or replicated: the
        catalog's part of what background work yields to (``Store.foreground_busy``; pulls: ``Arrivals.busy``). Takes
        no lock: the pool's reserve asks it while it may hold its own."""
        return any(not lease.ahead for lease in list(self._alloc_leases.values())) or self._in_flight > 0

    # ---- what the parts under this lock ask (the caller holds ``cond``)

    def get_locked(self, key: ShardKey) -> Entry | None:
        return self._entries.get(key)

    def entries_locked(self) -> list[Entry]:
        """The entries held (a new list: the caller may drop some while it walks it)."""
        return list(self._entries.values())

    def stripes_missing_locked(self) -> list[tuple[ShardKey, int]]:
        """The other stripes of the newest save of every replica-group member that saves here, which this store does not
        hold, with the size of the member's own stripe (theirs are about as large), in key order (``Arrivals``)."""
        newest: dict[tuple[str, int], Entry] = {}
        for e in self._entries.values():
            if e.owner_host != self.host_id or e.cached or not e.state.settled or e.manifest is None or e.manifest.stripe is None:
                continue
            mine = newest.get((e.key.job_id, e.key.rank))
            if mine is None or e.created_unix > mine.created_unix:
                newest[(e.key.job_id, e.key.rank)] = e
        missing = []
        for e in newest.values():
            stripe = e.manifest.stripe if e.manifest is not None else None
            for rank in stripe.group if stripe is not None else ():
                k = replace(e.key, rank=rank)
                if rank != e.key.rank and k not in self._entries:
                    missing.append((k, e.nbytes))
        return sorted(missing)

    # ---- entries: registration, drop, pins

    def refuse_resave(self, key: ShardKey) -> None:
        """A client capture of a shard already held on the same timeline: refused.

        Two captures of one (job, step, rank, timeline) would make that step a mix of two saves. Clients
        move to a new timeline themselves when they save a step again; this catches a reused run id.
        """
        with self.cond:
            self._refuse_resave_locked(key)

    def _refuse_resave_locked(self, key: ShardKey) -> None:
        held = self._entries.get(key)
        if held is not None and not held.dropped:
            raise AlreadySaved(
                f"shard {key} is already saved on store {self.host_id}: saving a step again needs a new timeline "
                "(the client starts one when it saves a step at or below one it saved; a restarted job needs a new run id)"
            )

    def register_locked(self, entry: Entry) -> None:
        """Put ``entry`` in the catalog, replacing an older copy of the same shard.

        The same shard means the same (job, step, rank, timeline): a re-save of a step on another timeline
        is another shard, and the old version stays until retention finds it superseded
        (``memstore.core.restorable``): re-saves are atomic and never mix with the old version.
        """
        old = self._entries.get(entry.key)
        if old is not None and old is not entry:
            self.drop_locked(old, reason="replaced by a newer copy of the same shard")
        self._entries[entry.key] = entry
        self._describe_locked(entry)
        self.cond.notify_all()

    def _describe_locked(self, entry: Entry) -> None:
        """Record a settled copy next to its segment so a restart can adopt it (``leftovers.Sidecars``)."""
        if entry.verified and entry.state.settled and not entry.dropped:
            self._sidecars.describe(entry.segment, entry.info())

    def register_adopted(self, entries: list[Entry]) -> tuple[list[Entry], int]:
        """Register copies adopted from shared memory (``leftovers.Adoption``; described already), but for those whose
        shard is held already (pulled or saved meanwhile, or twice among ``entries``): returns them, and the bytes held."""
        with self.cond:
            twice = []
            for entry in entries:
                if entry.key in self._entries:
                    twice.append(entry)
                else:
                    self._entries[entry.key] = entry
            return twice, sum(e.nbytes for e in self._entries.values())

    def drop(self, entry: Entry, reason: str) -> None:
        """Remove from the catalog; free the segment once nobody reads it."""
        with self.cond:
            self.drop_locked(entry, reason)

    def drop_locked(self, entry: Entry, reason: str) -> None:
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
            self.pool.release(entry.segment, written=entry.state.settled)
        self.cond.notify_all()

    def pin(self, entry: Entry) -> bool:
        """Keep ``entry``'s segment from being freed or reused (False: it was dropped already)."""
        with self.cond:
            if entry.dropped:
                return False
            entry.pins += 1
            return True

    def unpin(self, entry: Entry) -> None:
        with self.cond:
            entry.pins -= 1
            if entry.pins == 0 and entry.dropped:
                self.pool.release(entry.segment, written=entry.state.settled)

    def readable(self, key: ShardKey, wait: float = 30.0) -> Entry:
        """The verified local copy of ``key`` (waits briefly while its checksums are computed)."""
        ensure(key_problem(key.job_id, key.step, key.rank, timeline=key.timeline))
        deadline = time.monotonic() + wait
        with self.cond:
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
                self.cond.wait(remaining)

    def wait_settled(self, key: ShardKey, deadline: float) -> tuple[ShardInfo, bool]:
        """``key``'s info once it settled, or as it is at ``deadline`` (or when the store stops); True if it settled."""
        with self.cond:
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
                self.cond.wait(remaining)

    def list_shards(self, job_id: str) -> list[ShardInfo]:
        """Every copy this store holds (of ``job_id``, or of every job when it is ""), in key order."""
        if job_id:
            ensure(job_id_problem(job_id))
        with self.cond:
            return [e.info() for k, e in sorted(self._entries.items()) if not job_id or k.job_id == job_id]

    # ---- saves: allocation leases, commit, newest wins

    def lease_allocation(self, entry: Entry, ahead: bool) -> str:
        """An allocation lease on ``entry`` (not in the catalog until committed); returns its id."""
        lease_id = secrets.token_hex(16)
        with self.cond:
            self._alloc_leases[lease_id] = Lease(entry, time.monotonic() + ALLOCATE_LEASE_SECONDS, ahead=ahead)
        return lease_id

    def commit_lease(
        self, lease_id: str, key: ShardKey | None, nbytes: int, metrics: dict[str, float], format_version: int, spill_codec: str,
        stripe: Stripe | None = None, floor: int | None = None, checksums: ChunkChecksums | None = None, floor_timeline: str = "",
    ) -> Entry:  # fmt: skip
        """Register the shard of allocation lease ``lease_id`` (see ``Saver.commit``); older captures of its rank that
        replication has not taken up yet are superseded (newest wins). Returns its entry.

        A wrong key, size, ``stripe``, restorable ``floor`` or client ``checksums`` (checked against the shard the lease
        holds) is refused and the lease kept. ``floor_timeline``: the floor's, when it is not the shard's
        (``memstore.core.floors.floor_problem``)."""
        with self.cond:
            lease = self._alloc_leases.get(lease_id)
            if lease is None:
                raise LeaseError(f"allocation lease {lease_id!r} is unknown or expired; allocate again")
            entry = lease.entry
            ensure(bind_problem(lease, key, nbytes))
            ensure(None if floor is None else floor_problem(floor, (key or entry.key).step, floor_timeline))
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
            self.register_locked(entry)
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
            self.drop_locked(old, reason=old.error)
            log.info("%s superseded by step %d before replication took it up (newest wins)", old.key, key.step)

    # ---- reads: read leases

    def lease_reader(self, entry: Entry) -> str:
        """A read lease on a pinned ``entry``; returns its id (``release_lease`` unpins it)."""
        lease_id = secrets.token_hex(16)
        with self.cond:
            self._read_leases[lease_id] = Lease(entry, time.monotonic() + READ_LEASE_SECONDS)
        return lease_id

    def release_lease(self, lease_id: str) -> None:
        """End a read lease (unpin) or an allocation lease that was never committed (free its segment)."""
        with self.cond:
            lease = self._read_leases.pop(lease_id, None)
            alloc = self._alloc_leases.pop(lease_id, None)
        if lease is not None:
            self.unpin(lease.entry)
        elif alloc is not None:
            self.pool.release(alloc.entry.segment)  # (not written: expired, its client may still be writing into it)

    def stale_leases(self, now: float) -> list[str]:
        """The ids of the allocation leases, then the read leases, that expired before ``now``."""
        with self.cond:
            stale_alloc = [k for k, lease in self._alloc_leases.items() if lease.expires < now]
            stale_read = [k for k, lease in self._read_leases.items() if lease.expires < now]
        return stale_alloc + stale_read

    # ---- replication's steps

    def add_in_flight(self, n: int) -> None:
        with self.cond:
            self._in_flight += n

    def take_up(self, entry: Entry) -> bool:
        """Replication takes ``entry`` up: from now on no newer save supersedes it. False: it was superseded already."""
        with self.cond:
            entry.checksumming = True
            return not entry.dropped

    def checksummed(self, entry: Entry, manifest: Manifest) -> None:
        with self.cond:
            entry.manifest = manifest
            entry.state = ShardState.REPLICATING
            self.cond.notify_all()

    def mark_superseded(self, entry: Entry) -> None:
        """Every push of ``entry`` was skipped for a newer capture (newest wins): the client's wait() says so."""
        with self.cond:
            entry.superseded = True
            self._saves_superseded += 1

    def settle(self, entry: Entry, copies: int, errors: list[str]) -> ShardState:
        """``entry`` reached ``copies`` copies: COMMITTED with R of them, else UNDER_REPLICATED (``errors`` say why)."""
        replicas = self.config.replicas
        with self.cond:
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
            self.cond.notify_all()
            return entry.state

    # ---- erasure coding's steps (memstore.server.engine.encoding)

    def place_in_part(self, entry: Entry, place: Callable[[list[tuple[int, int]]], ErasurePlace]) -> ErasurePlace:
        """Give ``entry`` its place in this store's part of its version: ``place`` gets the (offset, nbytes) of the shards
        placed there already (this store's own, of the same job, step and timeline) and answers the new one's."""
        with self.cond:
            version = (entry.key.job_id, entry.key.step, entry.key.timeline)
            placed = [
                (e.erasure.offset, e.nbytes) for e in self._entries.values()
                if e.erasure is not None and e.owner_host == self.host_id and (e.key.job_id, e.key.step, e.key.timeline) == version
            ]  # fmt: skip
            entry.erasure = place(placed)
            return entry.erasure

    def settle_parity(self, entry: Entry, errors: list[str]) -> ShardState:
        """``entry``'s contributions were sent: COMMITTED when every parity host of its rows acknowledged one, else
        UNDER_REPLICATED (``errors`` say which did not; a parity host's repair pass may fill its fragment later)."""
        with self.cond:
            entry.copies = 1  # the owner's: parity is no copy
            if errors:
                entry.state = ShardState.UNDER_REPLICATED
                entry.error = "parity incomplete: " + "; ".join(errors)
                log.warning("shard %s: %s", entry.key, entry.error)
            else:
                entry.state = ShardState.COMMITTED
                entry.error = ""
            self._describe_locked(entry)
            self.cond.notify_all()
            return entry.state

    def waiting_for(self, entry: Entry, what: str) -> None:
        """What ``entry``, not settled yet, waits for (its ``ShardInfo.error`` says so until it settles: ``handle.wait()``)."""
        with self.cond:
            if not entry.state.settled:
                entry.error = what

    # ---- recovery's registration and the views of what is held (repair, drain, scrub, the durable tier)

    def register_pulled(self, entry: Entry) -> bool:
        """Register a copy pulled in; False (its segment freed) when a verified copy arrived meanwhile."""
        with self.cond:
            current = self._entries.get(entry.key)
            if current is not None and current.verified:
                self.pool.release(entry.segment)  # somebody else brought it in meanwhile
                return False
            self.register_locked(entry)
            if not entry.cached and entry.manifest is not None and entry.manifest.stripe is not None:
                self.stripes_settled += 1  # a replacement's own stripe, repaired: its group may be assembled here now
            return True

    def own_under_replicated(self) -> int:
        """This store's own shards that settled with fewer than R copies."""
        with self.cond:
            return sum(1 for e in self._entries.values() if e.owner_host == self.host_id and e.state is ShardState.UNDER_REPLICATED)

    def verified_copies(self) -> list[tuple[ShardKey, str, float, bool]]:
        """(key, owner host, capture time, settled) of every verified copy held, but cached ones (not one of the R)."""
        with self.cond:
            return [(k, e.owner_host, e.created_unix, e.state.settled) for k, e in self._entries.items() if e.verified and not e.cached]

    def settled_copies(self) -> list[Entry]:
        """The settled, verified copies held (what a drain may have to give away)."""
        with self.cond:
            return [e for e in self._entries.values() if e.verified and e.state.settled and not e.dropped]

    # ---- what retention decides on (the Janitor; ``Eviction`` drops)

    def jobs(self) -> set[str]:
        with self.cond:
            return {k.job_id for k in self._entries}

    def held(self, job_id: str) -> list[tuple[ShardKey, ShardState, float]]:
        """(key, state, capture time) of every copy of ``job_id`` held: what retention decides on."""
        with self.cond:
            return [(e.key, e.state, e.created_unix) for e in self._entries.values() if e.key.job_id == job_id]
