"""Recovery and repair: pulling verified copies from peers or the durable tier, and what the cluster holds."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, TypeVar

from memstore.config import StoreConfig
from memstore.core.agreement import Seen, seen_versions
from memstore.core.model import Holding, Manifest, ShardInfo, ShardKey, ShardState
from memstore.core.rebuildable import REBUILD, with_rebuilt
from memstore.core.restorable import RestoreAnswer, latest_restorable, sources_for, split_timelines
from memstore.core.retention import newest_versions, ranked_versions, repair_waves
from memstore.core.slots import SlotTable
from memstore.errors import (
    ChecksumMismatch,
    DataChannelUnsupported,
    InvalidArgument,
    LayoutError,
    PeerUnavailable,
    ShardNotFound,
    SpillStorageError,
    StoreError,
    StreamError,
    UnknownJob,
)
from memstore.faults import fault
from memstore.server.engine.arrivals import Arrivals
from memstore.server.engine.catalog import Catalog
from memstore.server.engine.entries import Entry, ensure, holdings_of
from memstore.server.engine.eviction import Eviction
from memstore.server.engine.room import Room
from memstore.server.events import StoreEvents, pull_source
from memstore.server.membership import ClusterView, Membership
from memstore.server.memory.pool import Segment
from memstore.server.peers import PeerDirectory
from memstore.spill.layout import SpilledManifest
from memstore.spill.port import DURABLE_HOST, DurableTier
from memstore.v1.integrity import first_mismatch
from memstore.v1.keys import job_id_problem, key_problem
from memstore.v1.streams import receive_chunks, shard_manifest_problem

log = logging.getLogger(__name__)
EXPECT_TIMEOUT = 2.0  # how long a starting store waits for its group's listings to learn what it will pull
T = TypeVar("T")

RESTORE_FIRST_WAIT = 60.0  # the longest repair defers to restores in flight before it pulls anyway
REPAIR_STREAMS = 4  # shards one repair pass pulls at once, spread over the holders
REPAIR_BYTES_IN_FLIGHT = 256 << 20  # beyond this, a pass's pulls wait their turn (RepairGate)


class RepairGate:
    """Lets a repair pass's pulls start in their order, several at once while their bytes in flight stay within
    ``budget`` (a pull larger than it goes alone). Small shards fill the wire together; a large one already does
    with its own streams, and pulling two at once would only split the bandwidth, and the faulting of fresh memory,
    between the step a restarted trainer waits for and an older one."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._turn = 0  # the index of the next pull allowed to start
        self._in_flight = 0
        self._cond = threading.Condition()

    def run(self, index: int, nbytes: int, pull: Callable[[], T]) -> T:
        """Run ``pull`` (the pass's pull number ``index``, of ``nbytes``) once every earlier one started and there is room."""
        with self._cond:
            self._cond.wait_for(lambda: self._turn == index and (self._in_flight == 0 or self._in_flight + nbytes <= self.budget))
            self._turn += 1
            self._in_flight += nbytes
            self._cond.notify_all()
        try:
            return pull()
        finally:
            with self._cond:
                self._in_flight -= nbytes
                self._cond.notify_all()


class ErasureRepair(Protocol):
    """What ``Recovery`` asks of erasure coding's rebuilds (``memstore.server.engine.rebuild.Rebuilder``)."""

    def rebuild(self, key: ShardKey) -> str:
        """Rebuild ``key`` from its group and register it; returns its source's name ("rebuild")."""

    def repair_once(self) -> bool:
        """One repair pass: this store's lost shards and parity back; True if nothing failed."""


class Recovery:
    """Fetches missing shards (for a restore or for repair), and answers what is restorable across the cluster.

    Runs the repair loop (``repair_loop``, on the store's ``repair`` thread) and reports its last pass.
    """

    def __init__(
        self,
        catalog: Catalog,
        arrivals: Arrivals,
        eviction: Eviction,
        room: Room,
        config: StoreConfig,
        membership: Membership,
        peers: PeerDirectory,
        events: StoreEvents,
        draining: threading.Event,
        stop: threading.Event,
        retention_due: threading.Event,
    ) -> None:
        self.catalog = catalog
        self.arrivals = arrivals  # its pulls claimed, restores and repairs in flight (one pull per shard at a time)
        self.eviction = eviction  # what was deleted lately: repair does not pull it back
        self.room = room  # memory for what it pulls
        self.config = config
        self.host_id = config.host_id
        self.membership = membership
        self.peers = peers
        self.events = events
        self.draining = draining  # set: repair pulls nothing more
        self._stop = stop
        self.retention_due = retention_due  # set when a copy is pulled in: the janitor looks at retention again
        self.durable: DurableTier | None = None  # set by the store when --spill is on
        # Set by the store when it has a --shm-dir: adopts dead segment dirs on this machine that hold some of the
        # given shards (ShmSweeper.adopt_holders), so repair does not pull over the network what this machine holds.
        self.adopt_local: Callable[[set[ShardKey]], int] | None = None
        self.last_repair_error = ""
        self.under_replicated = 0  # from the last repair pass: recent shards of this store's slots with fewer than R copies
        self.unreachable_sources: tuple[str, ...] = ()  # from the last repair pass: holders of this store's slots that did not answer
        self.repaired_table: SlotTable | None = None  # the table of the last repair pass that left nothing missing (readiness)
        # Set by the store under --redundancy ec:K+M (memstore.server.engine.rebuild.Rebuilder): what a lost shard is
        # rebuilt with (a restore's source "rebuild"), the pass that replaces replication's repair, and what this store's
        # parity covers (its listing's PARITY entries, beside its copies).
        self.rebuilder: ErasureRepair | None = None
        self.parity_listing: Callable[[str], list[ShardInfo]] = lambda job_id: []

    def fetch(self, key: ShardKey, discard_local: bool, durable_known: bool = False, cached: bool = False) -> tuple[Manifest, str]:
        """Make sure this store holds a verified copy of ``key``, pulling it from a peer if needed (``durable_known``:
        a durable copy is known to exist; see :meth:`_sources`; ``cached``: a pulled copy is a cached one, as the
        assembler's: another member's stripe, not one of the R)."""
        ensure(key_problem(key.job_id, key.step, key.rank, timeline=key.timeline))
        started = time.monotonic()
        local = self.catalog.get(key)
        if local is not None and discard_local:
            if (
                local.manifest is not None
                and first_mismatch(local.segment.view(), local.nbytes, local.manifest.chunk_size, local.manifest.checksums) is None
            ):
                log.warning("client reported %s corrupt but the local copy verifies; keeping it", key)
            else:
                log.warning("discarding corrupt local copy of %s", key)
                self.catalog.drop(local, reason="local copy failed verification")
                local = None
        if local is not None:
            entry = self.catalog.readable(key)
            assert entry.manifest is not None
            self.events.fetched("local", time.monotonic() - started)
            return entry.manifest, entry.source  # "" unless repair pulled it from a peer
        self.arrivals.fetch_started()  # restores first: repair starts no new pull while a trainer waits for one
        try:
            fault("fetch.before_pull")
            source = self._pull(key, origin_note="fetch", durable_known=durable_known, cached=cached)
        except ShardNotFound:
            # ec:K+M: a repair pass rebuilt and registered it here while this fetch listed the stores, so none lists a copy
            # to pull and its parity no longer counts (this store holds it): serve that one.
            held = self.catalog.get(key)
            if held is None or not held.verified:
                raise
            source = held.source
        finally:
            self.arrivals.fetch_ended()
        entry = self.catalog.readable(key)
        assert entry.manifest is not None
        self.events.fetched(pull_source(source), time.monotonic() - started)
        return entry.manifest, source

    def _sources(self, key: ShardKey, durable_known: bool) -> list[str]:
        """Where to pull ``key`` from: this host's placement group first (a few calls); only when no member holds
        it, every store and the durable tier (``durable_known``: the caller knows a durable copy exists, so it is
        read without listing anything)."""
        view = self.membership.view
        group = view.repair_sources(view.owned_slots())
        listings = self.peers.list_all(key.job_id, self.config.peer_timeout, hosts=group)
        holdings, unreachable = _answers(listings)
        candidates = sources_for(holdings, key, prefer=group) + self._rebuildable(holdings, key)
        if candidates or (durable_known and self.durable is not None):
            return candidates or [DURABLE_HOST]
        listings = self.peers.list_all(key.job_id, self.config.peer_timeout, hosts=[h for h in view.table.members() if h not in group])
        rest, more_unreachable = _answers(listings)
        holdings += rest
        unreachable += more_unreachable
        candidates = sources_for(holdings, key, prefer=tuple(view.table.members())) + self._rebuildable(holdings, key)
        durable = durable_holdings(self.durable, key.job_id, unreachable)
        if any(h.key == key for h in durable):
            candidates.append(DURABLE_HOST)  # the most expensive tier comes last
        holdings += durable
        if not candidates:
            if not any(h.key.job_id == key.job_id for h in holdings) and not unreachable:
                raise UnknownJob(f"job {key.job_id!r} is unknown to every store")
            extra = f" ({len(unreachable)} unreachable: {', '.join(unreachable)})" if unreachable else ""
            raise ShardNotFound(f"no reachable store holds a verified copy of {key}{extra}")
        return candidates

    def _rebuildable(self, holdings: list[Holding], key: ShardKey) -> list[str]:
        """``[REBUILD]`` when no copy of ``key`` is listed and the parity listed (and this store's) rebuilds it with the
        copies listed and held here (ec:K+M), else []."""
        if self.rebuilder is None or any(h.key == key and h.verified for h in holdings):
            return []
        here = holdings_of(self.host_id, self.catalog.list_shards(key.job_id) + self.parity_listing(key.job_id))
        return [REBUILD] if any(h.key == key and h.host == REBUILD for h in with_rebuilt(holdings + here, key.job_id)) else []

    def pull_ahead(self, key: ShardKey) -> str:
        """Pull ``key`` from a peer into spare room as a cached copy (``memstore.server.engine.assembler``): never from the durable
        tier, never evicting anything for it. Returns the peer's id; ShardNotFound while no peer holds it yet."""
        candidates = [host for host in self._sources(key, durable_known=False) if host not in (DURABLE_HOST, REBUILD)]
        if not candidates:
            raise ShardNotFound(f"no peer holds a verified copy of {key} yet")
        return self._pull(key, origin_note="assemble", candidates=candidates, cached=True, evict=False)

    def _pull(
        self, key: ShardKey, origin_note: str, candidates: list[str] | None = None, durable_known: bool = False,
        cached: bool = False, evict: bool = True,
    ) -> str:  # fmt: skip
        """Copy ``key`` from the first peer that has a verified copy. Returns that peer's id. ``cached``: keep it as a cached
        copy; ``evict``: older copies may be dropped under pressure to make room for it."""
        if candidates is None:
            candidates = self._sources(key, durable_known)
        pending = self.arrivals.claim_pull(key)
        if pending is not None:
            # Another path (fetch or repair) is already pulling this shard: wait for it instead of pulling twice.
            pending.wait(timeout=self.config.peer_timeout + 600)
            entry = self.catalog.get(key)
            if entry is not None and entry.verified:
                return entry.source
            raise PeerUnavailable(f"a concurrent pull of {key} did not produce a verified copy")
        try:
            return self._pull_candidates(key, candidates, origin_note, cached, evict)
        finally:
            self.arrivals.end_pull(key)

    def _pull_candidates(self, key: ShardKey, candidates: list[str], origin_note: str, cached: bool, evict: bool) -> str:
        errors: list[StoreError] = []
        for host in candidates:
            try:
                if host == DURABLE_HOST:
                    self._pull_from_durable(key, cached)
                elif host == REBUILD and self.rebuilder is not None:
                    self.rebuilder.rebuild(key)
                else:
                    self._pull_from(host, key, cached, evict)
                log.info("%s: pulled %s from %s", origin_note, key, host)
                return host
            except StoreError as exc:
                errors.append(exc)
        if errors and all(isinstance(e, ChecksumMismatch) for e in errors):
            raise ChecksumMismatch(f"every copy of {key} failed verification: " + "; ".join(map(str, errors)))
        raise PeerUnavailable(f"could not pull {key}: " + "; ".join(map(str, errors)))

    def _pull_from(self, host: str, key: ShardKey, cached: bool, evict: bool) -> None:
        peer = self.peers[host]
        timeout = self.config.peer_timeout + 600
        segments: list[Segment] = []

        def into(manifest: Manifest) -> memoryview:
            problem = shard_manifest_problem(manifest)
            if problem or manifest.key != key:
                raise PeerUnavailable(f"peer {host} sent an invalid manifest for {key}: {problem or 'wrong key'}")
            segments.append(self.room.acquire(key, max(1, manifest.nbytes), evict=evict))
            return segments[-1].view()

        try:
            manifest = None
            if self.config.data_plane == "tcp":
                try:
                    manifest = peer.pull_data(key, into, timeout, self.config.peer_timeout, self.config.transfer_streams,
                                              fresh=lambda: bool(segments) and segments[-1].fresh)  # fmt: skip
                except DataChannelUnsupported:
                    log.info("peer %s has no data channel; falling back to gRPC streams", host)
            if manifest is None:
                manifest, chunks, call = peer.get(key, timeout=timeout)
                try:
                    receive_chunks(chunks, manifest, into(manifest))
                except StreamError as exc:
                    raise (ChecksumMismatch if isinstance(exc, ChecksumMismatch) else PeerUnavailable)(f"copy from {host}: {exc}") from None
                finally:
                    call.cancel()
        except BaseException:
            for seg in segments:
                self.room.release(seg)
            raise
        (segment,) = segments
        self._register_pulled(key, segment, manifest, host, cached=cached)

    def _pull_from_durable(self, key: ShardKey, cached: bool = False) -> None:
        assert self.durable is not None
        segments: list[Segment] = []

        def allocate(m: SpilledManifest) -> memoryview:
            segments.append(self.room.acquire(key, max(1, m.nbytes)))
            return segments[-1].view()

        try:
            sm = self.durable.read_into(key, allocate)
        except (SpillStorageError, LayoutError) as exc:
            for seg in segments:
                self.room.release(seg)
            if isinstance(exc, ChecksumMismatch):
                raise ChecksumMismatch(f"durable copy of {key}: {exc}") from None
            raise PeerUnavailable(f"durable copy of {key}: {exc}") from None
        except BaseException:
            for seg in segments:
                self.room.release(seg)
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
            stripe=sm.stripe,
        )
        self._register_pulled(key, segments[0], manifest, DURABLE_HOST, cached=cached)

    def _register_pulled(self, key: ShardKey, segment: Segment, m: Manifest, source: str, cached: bool = False) -> None:
        self.events.pulled(pull_source(source), m.nbytes)
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
            stripe=m.stripe,
            cached=cached,
            arrived_verified=time.monotonic(),  # every chunk was verified as it landed (peer or durable tier)
        )
        if self.catalog.register_pulled(entry):
            self.retention_due.set()

    def cluster_holdings(self, job_id: str) -> tuple[list[Holding], list[str]]:
        """What every reachable store (this one included) holds of ``job_id``, and who did not answer."""
        mine = holdings_of(self.host_id, self.catalog.list_shards(job_id) + self.parity_listing(job_id))
        theirs, unreachable = _answers(self.peers.list_all(job_id, self.config.peer_timeout))
        return mine + theirs + durable_holdings(self.durable, job_id, unreachable), unreachable

    def latest_step(self, job_id: str, step: int | None = None) -> RestoreAnswer:
        """The version to restore: of the newest restorable step, or of exactly ``step``."""
        ensure(job_id_problem(job_id))
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
            return RestoreAnswer(None, tuple(unreachable), note)
        return RestoreAnswer(found, tuple(unreachable))

    def scoped_versions(self, job_id: str, ranks: list[int], include_durable: bool) -> tuple[list[Seen], list[str]]:
        """The scoped LatestStep (``memstore.core.agreement``): per version of ``job_id``, which of ``ranks`` have a
        verified copy here or on this host's placement group; with ``include_durable``, also the versions complete
        on the durable tier (one listing: only one rank of a job asks for it). Returns them and who did not answer."""
        ensure(job_id_problem(job_id))
        if not ranks or any(r < 0 for r in ranks) or len(set(ranks)) != len(ranks):
            raise InvalidArgument(f"ranks {ranks[:8]} are invalid: expected distinct ints >= 0")
        view = self.membership.view
        group = view.repair_sources(view.owned_slots())  # the hosts holding copies of what this host holds
        theirs, unreachable = _answers(self.peers.list_all(job_id, self.config.peer_timeout, hosts=group))
        holdings = holdings_of(self.host_id, self.catalog.list_shards(job_id) + self.parity_listing(job_id)) + theirs
        durable = durable_holdings(self.durable, job_id, unreachable) if include_durable else []
        return seen_versions(holdings, job_id, ranks, durable), unreachable

    def repair_loop(self) -> None:
        """The ``repair`` thread: a pass every --repair-interval seconds until the store stops."""
        while not self._stop.is_set():
            try:
                self.repair_once()
            except Exception as exc:
                self.last_repair_error = str(exc)
                log.exception("repair pass failed")
            self._stop.wait(self.config.repair_interval)

    def _repair_one(self, key: ShardKey, candidates: list[str]) -> bool | None:
        """Pull one shard this host lacks: True pulled, False failed, None not needed (here, arriving, or stopping)."""
        if self._stop.is_set():
            return None
        if not self.arrivals.begin_repair(key, restore_first=RESTORE_FIRST_WAIT):
            return None
        try:
            started = time.monotonic()
            source = self._pull(key, origin_note="repair", candidates=candidates)
            self.events.repaired(pull_source(source), time.monotonic() - started)
            fault("repair.after_pull")
            return True
        except StoreError as exc:
            log.warning("repair of %s failed: %s", key, exc)
            return False
        finally:
            self.arrivals.end_repair()

    def expected_pulls(self) -> list[int]:
        """Bytes of each shard of the newest step of every job that the first repair pass will pull here (a replacement's
        own and its group's), from one listing of the group; [] when nothing is to pull or a peer does not answer. The
        automatic reserve faults that much in before the store serves (``ReservePolicy.expect``)."""
        if self.rebuilder is not None:
            return []  # ec:K+M: its shards are rebuilt, not pulled whole
        plan = self._plan(min(self.config.peer_timeout, EXPECT_TIMEOUT), retrying=False)  # peers may not serve yet
        if not plan.sources or not plan.complete or not plan.waves:
            return []
        return [plan.sizes[k] for k in plan.waves[0] if self.catalog.get(k) is None]

    def _plan(self, timeout: float | None = None, retrying: bool = True) -> RepairPlan:
        """One listing of the group and what to pull from it (nothing listed when no other host holds this host's slots'
        shards: ``sources`` empty)."""
        view = self.membership.view  # one table for the whole pass
        owners = view.owned_slots()
        sources = view.repair_sources(owners)
        if not sources:
            return RepairPlan(view, owners, sources, {}, {}, {}, [])
        listings = self.peers.list_all("", self.config.peer_timeout if timeout is None else timeout, hosts=sources, retrying=retrying)
        wanted, copies, sizes = _wanted(listings, view, owners)
        recent = {job: ranked_versions(held, self.config.keep) for job, held in copies.items()}  # the abandoned run's steps rank lower
        todo = [
            k for k in sorted(wanted, key=lambda k: (-k.step, k.job_id, k.rank, k.timeline))
            if k.version in recent[k.job_id] and not self.eviction.recently_deleted(k)
        ]  # fmt: skip
        return RepairPlan(view, owners, sources, listings, wanted, sizes, repair_waves(todo, recent))

    def repair_once(self) -> int:
        """Pull every recent shard this host should hold but lacks. Returns how many were pulled."""
        fault("repair.before_pass")
        if self.draining.is_set():
            return 0
        if self.rebuilder is not None:  # ec:K+M: rebuild lost shards and parity instead of pulling copies
            view = self.membership.view
            if self.rebuilder.repair_once() and not self._stop.is_set():
                self.repaired_table = view.table
            self.unreachable_sources = ()
            self.under_replicated = self.catalog.own_under_replicated()
            return 0
        plan = self._plan()
        if not plan.sources:
            self.repaired_table = plan.view.table  # nobody else holds our slots' shards: nothing to confirm
            self.unreachable_sources = ()
            self.under_replicated = self.catalog.own_under_replicated()
            return 0
        view, owners, listings, wanted, sizes = plan.view, plan.owners, plan.listings, plan.wanted, plan.sizes
        complete = plan.complete
        self.unreachable_sources = tuple(sorted(h for h, r in listings.items() if isinstance(r, StoreError)))
        order = [key for wave in plan.waves for key in wave]  # every job's newest step first: what a restarted trainer restores
        if order and self.adopt_local is not None and self.adopt_local(set(order)):
            order = [k for k in order if self.catalog.get(k) is None]
        # Several pulls at once, each starting at a different holder (a replacement fills up from its whole group), small
        # ones together, large ones in turn (RepairGate).
        spread = [(key, wanted[key][i % len(wanted[key]) :] + wanted[key][: i % len(wanted[key])]) for i, key in enumerate(order)]
        gate = RepairGate(REPAIR_BYTES_IN_FLIGHT)
        results: list[bool | None] = []
        if spread:
            with ThreadPoolExecutor(max_workers=min(REPAIR_STREAMS, len(spread)), thread_name_prefix="memstore-repair") as pool:

                def pull(i: int) -> bool | None:
                    return gate.run(i, sizes[spread[i][0]], lambda: self._repair_one(*spread[i]))

                results = list(pool.map(pull, range(len(spread))))
        pulled = results.count(True)
        complete = complete and False not in results
        if complete and not self._stop.is_set():
            self.repaired_table = view.table  # every source answered and every shard we lacked is here: readiness
        here = self.catalog.verified_copies()
        self.under_replicated = count_under_replicated(
            listings, here, view.slot_name_of_owner, owners, self.host_id, self.config.replicas, self.config.keep
        )
        return pulled


@dataclass(frozen=True)
class RepairPlan:
    """One listing of a host's group and what a repair pass pulls from it (``Recovery._plan``)."""

    view: ClusterView
    owners: set[str]  # the slots whose shards this host holds
    sources: Collection[str]  # the hosts that may hold copies of them (none: nothing to list)
    listings: dict[str, list[ShardInfo] | StoreError]
    wanted: dict[ShardKey, list[str]]  # key -> the hosts holding a verified copy
    sizes: dict[ShardKey, int]
    waves: list[list[ShardKey]]  # the recent keys to hold, every job's newest step first (``repair_waves``)

    @property
    def complete(self) -> bool:
        """Every source answered."""
        return not any(isinstance(shards, StoreError) for shards in self.listings.values())


def durable_holdings(durable: DurableTier | None, job_id: str, unreachable: list[str]) -> list[Holding]:
    """What the durable tier holds of ``job_id`` (nothing without one); an unreadable tier joins ``unreachable``."""
    if durable is None:
        return []
    try:
        return durable.holdings(job_id)
    except (SpillStorageError, LayoutError) as exc:
        log.warning("durable tier unreadable for %s: %s", job_id, exc)
        unreachable.append(DURABLE_HOST)
        return []


def _answers(listings: dict[str, list[ShardInfo] | StoreError]) -> tuple[list[Holding], list[str]]:
    """The holdings in peers' listings, and (sorted) the peers that did not answer."""
    held = [h for host, r in listings.items() if not isinstance(r, StoreError) for h in holdings_of(host, r)]
    return held, sorted(h for h, r in listings.items() if isinstance(r, StoreError))


def count_under_replicated(
    listings: dict[str, list[ShardInfo] | StoreError],
    here: list[tuple[ShardKey, str, float, bool]],
    owner_slot: Callable[[str], str],
    owners: set[str],
    me: str,
    replicas: int,
    keep: int,
) -> int:
    """How many shards of this store's slots, of the ``keep`` newest versions of each job, have fewer than
    ``replicas`` reachable verified copies.

    ``listings``: what the other holders of those slots listed (a holder that did not answer holds nothing:
    a group peer down leaves the group's recent shards under-replicated); ``here``: (key, owner host,
    capture time, settled) of the verified copies this store holds; ``owner_slot``: owner host -> its slot's
    name. A shard counts once some copy of it is settled (a save still replicating is not
    under-replicated yet).
    """
    holders: dict[ShardKey, set[str]] = {}
    created: dict[ShardKey, float] = {}
    settled: set[ShardKey] = set()
    for host, shards in listings.items():
        if isinstance(shards, StoreError):
            continue
        for info in shards:
            k = info.manifest.key
            if not info.verified or info.cached or owner_slot(info.manifest.owner_host) not in owners:
                continue  # a cached copy (pulled ahead of a restore) is not one of the R
            holders.setdefault(k, set()).add(host)
            created.setdefault(k, info.manifest.created_unix)
            if info.state is not None and info.state.settled:
                settled.add(k)
    for k, owner, when, done in here:
        if owner_slot(owner) not in owners:
            continue
        holders.setdefault(k, set()).add(me)
        created[k] = when
        if done:
            settled.add(k)
    by_job: dict[str, list[tuple[ShardKey, float]]] = {}
    for k in settled:
        by_job.setdefault(k.job_id, []).append((k, created[k]))
    recent = {job: newest_versions(pairs, keep) for job, pairs in by_job.items()}
    return sum(1 for k in settled if k.version in recent[k.job_id] and len(holders[k]) < replicas)


def _wanted(
    listings: dict[str, list[ShardInfo] | StoreError], view: ClusterView, owners: set[str]
) -> tuple[dict[ShardKey, list[str]], dict[str, list[tuple[ShardKey, float]]], dict[ShardKey, int]]:
    """From the peers' listings: every settled, verified copy of a shard whose owner slot is one of ``owners``
    (key -> the hosts that hold it), per job the (key, created) pairs that rank its recent steps, and each shard's size."""
    wanted: dict[ShardKey, list[str]] = {}
    sizes: dict[ShardKey, int] = {}
    copies: dict[str, list[tuple[ShardKey, float]]] = {}
    for host, shards in listings.items():
        if isinstance(shards, StoreError):
            continue
        for info in shards:
            if not info.verified or info.state is None or not info.state.settled:
                continue
            k = info.manifest.key
            problem = key_problem(k.job_id, k.step, k.rank, info.manifest.world_size, k.timeline)
            if problem:
                log.warning("repair: ignoring a copy peer %s lists: %s", host, problem)
                continue
            if view.slot_name_of_owner(info.manifest.owner_host) not in owners:
                continue
            wanted.setdefault(k, []).append(host)
            sizes[k] = info.manifest.nbytes
            copies.setdefault(k.job_id, []).append((k, info.manifest.created_unix))
    return wanted, copies, sizes
