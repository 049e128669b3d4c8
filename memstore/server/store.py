"""The store engine: shards in RAM, their life cycle, replication to group peers and repair.

Life of a shard owned by this host (a trainer rank runs here):

    allocate -> trainer copies into the segment -> commit            (save() returns here)
      -> checksums computed (CAPTURED -> REPLICATING)
      -> pushed to the R-1 group peers, each verifies every chunk
      -> COMMITTED when all acknowledged, else UNDER_REPLICATED (local copy kept; repair retries)

A copy received from a peer is verified chunk by chunk before it is registered (REPLICA).
The repair loop pulls, from group peers, every recent shard this host should hold but lacks, so a
replacement host (the same host id, or a new one that took a lost host's slot) returns the group to R
copies by itself. Placement is over slots (``memstore.core.slots``); ``membership`` says who holds which.

The engine is a few collaborating objects, each built here with only what it uses: the ``Catalog`` (the
entries, leases and pins, under the engine's one lock), ``Arrivals`` (the pulls and transfers on their way in) and
``Eviction`` (what retention, pressure and deletes drop), both under the catalog's lock too, ``Room`` (memory for a
shard, made under pressure; its ``Recycler`` under ec:K+M, keep >= 2, gives a save its oldest kept step's segment),
``Admission`` (open transfers per sender), ``Sidecars`` and ``Adoption`` (what a crashed store left, taken over), the
``Replicator``, the ``Saver``, the ``DataPath`` (with its one-time ``Tickets``), the ``Reader``, ``Recovery`` (fetch,
repair, cluster view), the ``Janitor`` (retention, expiry) and the ``Drainer``.
``Store`` builds them and exposes what the servicer, the data channel and the composition root call
(docs/architecture.md draws them).
The engine takes and returns the core's plain types (``memstore.core``), where the pure decisions (placement,
retention, latest restorable step) live too; the gRPC servicer is a thin adapter over it and the only part that
converts to and from protobuf (``memstore.server.convert``), besides the client of the peers
(``memstore.server.peers``) and the sidecars' bytes (``memstore.server.memory.leftovers``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from memstore import __version__
from memstore.config import StoreConfig
from memstore.core.erasure_layout import BLOCK
from memstore.core.floors import Floor, Floors
from memstore.core.model import ErasurePlace, Manifest, ShardInfo, ShardKey
from memstore.core.reserve_policy import ReservePolicy
from memstore.core.sizes import format_size
from memstore.core.spill_policy import spill_duty
from memstore.core.status import CaptureReport, DiscoveryReport, HealthReport, HelloReport, JobCensus, JobMemory, SpillReport, job_census
from memstore.erasure.heap import tune_heap
from memstore.errors import InvalidArgument, ShardNotFound
from memstore.server.engine.admission import Admission
from memstore.server.engine.arrivals import Arrivals
from memstore.server.engine.assembler import Assembler
from memstore.server.engine.catalog import Catalog
from memstore.server.engine.datapath import DataPath
from memstore.server.engine.drain import Drainer
from memstore.server.engine.encoding import Encoder
from memstore.server.engine.entries import ensure
from memstore.server.engine.eviction import Eviction
from memstore.server.engine.janitor import Janitor
from memstore.server.engine.local_reads import Reader
from memstore.server.engine.parity import ParityKeeper
from memstore.server.engine.rebuild import Rebuilder, read_pieces
from memstore.server.engine.recovery import Recovery
from memstore.server.engine.recycling import Recycler
from memstore.server.engine.replication import Replicator
from memstore.server.engine.room import Room
from memstore.server.engine.saving import Protection, Saver
from memstore.server.engine.scrub import Scrubber
from memstore.server.events import StoreEvents
from memstore.server.membership import ClusterView, Membership
from memstore.server.memory.leftovers import Adoption, Sidecars
from memstore.server.memory.pool import SegmentPool
from memstore.server.memory.rings import reserves_at_save, ring_limit, saves_recycle
from memstore.server.memory.shm_dirs import segment_dir
from memstore.server.memory.shm_pages import shm_pages
from memstore.server.memory.shm_sweep import ShmSweeper
from memstore.server.peers import PeerDirectory
from memstore.spill.port import DurableTier
from memstore.v1.channel import boot_id
from memstore.v1.keys import job_id_problem
from memstore.v1.security import Credentials

log = logging.getLogger(__name__)


class Store:
    """One host's store engine: builds the parts above and exposes what its callers use."""

    parity: ParityKeeper  # the parity fragments this store keeps for its group (ec:K+M; empty under replicas)
    encoder: Encoder | None  # ec:K+M: sends this store's shards' contributions (``_protection``)
    recycler: Recycler | None  # ec:K+M with keep >= 2: a save's segment from its rank's oldest kept step (``_recycling``)
    heap_tuned: bool  # ec:K+M with M >= 2: glibc keeps freed blocks for pyeclib's next call (``memstore.erasure.heap``)

    def __init__(
        self,
        config: StoreConfig,
        advertised_address: str | None = None,
        credentials: Credentials | None = None,
        events: StoreEvents | None = None,
    ) -> None:
        """``credentials``: what this store presents to its peers (the cluster token, its TLS identity); ``events``:
        where it reports saves, replication, fetches, repairs and RPCs (``memstore.server.metrics``; default: nowhere)."""
        self.config = config
        self.events = events or StoreEvents()
        self.host_id = config.host_id
        self.started = time.monotonic()
        # A replacement started with the same --host-id and --listen finds its previous incarnation's segments here.
        self.pool = SegmentPool(
            segment_dir(config.shm_dir, self.host_id, config.listen),
            config.capacity,
            adopt_leftovers=True,
            reserve=ReservePolicy(config.prefault, config.prefault_unit, config.keep),
            ring_limit=ring_limit(config.keep, at_save := reserves_at_save(config.redundancy.erasure_coded)),
            pool_past_limit=not at_save,  # an ec:K+M ring keeps no spare: what it grew by goes back to the kernel
        )
        self.peers = PeerDirectory(self.host_id, credentials=credentials)
        # Who holds which slot: fed by the discovery watcher and gossip (memstore.server.app); moves the peer directory along.
        self.membership = Membership(self.host_id, config.placement, config.redundancy, on_change=self._cluster_changed)
        self.discovery: DiscoveryReport | None = None  # set by the discovery watcher
        self.draining = threading.Event()  # set: no new shards, no repair pulls (drain, SIGTERM)
        self._stop = threading.Event()  # set by close(): the loops end, waits give up
        self._retention_due = threading.Event()  # set by whatever changes what retention would keep: wakes the janitor
        self.boot_id = boot_id()
        self.advertised_address = advertised_address or config.listen
        self.data_port = 0  # set by the server once the data channel listens
        self.control_socket = ""  # set by the server once the same-host control channel listens
        self._durable: DurableTier | None = None

        # The parts, each with only what it uses.
        self.catalog = Catalog(self.host_id, config, self.pool, self._stop, Sidecars(self.pool))
        self.arrivals = Arrivals(self.catalog, self._stop)  # under the catalog's lock: what is on its way in
        self.eviction = Eviction(self.catalog)  # under the catalog's lock: what retention, pressure and deletes drop
        self.adoption = Adoption(self.host_id, self.catalog, self.pool)
        self.floors = Floors()  # per job, the restorable floor its clients and peers sent: retention's bound without listing
        self.room = Room(self.eviction, self.pool, config, self._recycling())
        self.admission = Admission(self.host_id, config.max_streams_per_peer)
        self.replicator = Replicator(self.catalog, config, self.membership, self.peers, self.events, self._retention_due, self.floors)
        self.saver = Saver(
            self.catalog, self.arrivals, self.room, self.admission, self._protection(), config, self.pool, self.events, self.draining,
            self._retention_due, self.floors,
        )  # fmt: skip
        self.datapath = DataPath(self.catalog, self.saver, config)
        self.reader = Reader(self.catalog)
        self.recovery = Recovery(
            self.catalog, self.arrivals, self.eviction, self.room, config, self.membership, self.peers, self.events, self.draining,
            self._stop, self._retention_due,
        )  # fmt: skip
        self.janitor = Janitor(
            self.catalog, self.eviction, config, self.recovery.cluster_holdings, self.datapath.expire_tickets, self._stop,
            self._retention_due, self.floors,
        )  # fmt: skip
        self.scrubber = Scrubber(self.catalog, self.foreground_busy, config.scrub_rate, config.scrub_interval, self._stop)
        self.rebuilder = self._erasure_repair() if config.redundancy.erasure_coded else None
        self.drainer = Drainer(self.catalog, config, self.membership, self.peers, self.draining)
        self.assembler = Assembler(self.catalog, self.arrivals, self.pool, self.recovery.pull_ahead, self._stop, self.draining)

        # What the servicer calls (memstore.server.servicer), by the part that answers it.
        self.allocate = self.saver.allocate
        self.ring_paths = self.saver.ring_paths
        self.commit = self.saver.commit
        self.wait_committed = self.saver.wait_committed
        self.receive = self.saver.receive
        self.prepare_receive = self.datapath.prepare_receive
        self.prepare_send = self.datapath.prepare_send
        self.serve_ticket = self.datapath.serve_ticket  # the data channel's connections (memstore.server.dataserver)
        self.open = self.reader.open
        self.open_many = self.reader.open_many
        self.release = self.reader.release
        self.read = self.reader.read
        self.latest_step = self.recovery.latest_step
        self.scoped_versions = self.recovery.scoped_versions
        self.drain = self.drainer.drain  # the composition root's shutdown path (memstore.server.app)

        # What the durable tier reads (memstore.spill.port.ShardSource), with foreground_busy, spill_shards and spills_for below.
        self.pinned_bytes = self.reader.pinned_bytes

        self._threads = [
            threading.Thread(target=self.recovery.repair_loop, name="repair", daemon=True),
            threading.Thread(target=self.janitor.loop, name="janitor", daemon=True),
            threading.Thread(target=self.assembler.loop, name="assembler", daemon=True),
            threading.Thread(target=self.scrubber.loop, name="scrub", daemon=True),
        ]
        # Dead stores' segment dirs on this machine: a predecessor's adopted, the rest reclaimed after a grace period.
        self.sweeper: ShmSweeper | None = None
        self._started = False
        if self.pool.directory is not None:
            self.sweeper = ShmSweeper(
                self.pool.directory, self._predecessors, self._adopt_predecessor, config.shm_reclaim_after, self._stop
            )
            self._threads.append(threading.Thread(target=self.sweeper.loop, name="shm-sweep", daemon=True))
            self.recovery.adopt_local = self.sweeper.adopt_holders  # what repair would pull, held by a dead dir here
        if config.peers:  # a fixed --peers list: the table is known before serving
            self.membership.apply({h: (a, config.failure_domains.get(h, "")) for h, a in config.peers})
        self.adopted_shards = self.adoption.adopt()

    def _recycling(self) -> Recycler | None:
        """What gives a save into its rank's full capture ring the segment of the rank's oldest kept step, under ec:K+M
        with keep >= 2 (``memstore.server.engine.recycling``); None otherwise (the ring grows)."""
        recycle = saves_recycle(self.config.keep, self.config.redundancy.erasure_coded)
        self.recycler = Recycler(self.catalog, self.eviction, self.pool, self.floors) if recycle else None
        return self.recycler

    @property
    def rings_recycle(self) -> bool:
        """ec:K+M with keep >= 2: a save into its rank's full capture ring takes its oldest kept step's segment
        (``memstore.server.engine.recycling``)."""
        return self.recycler is not None

    @property
    def reserve_at_save(self) -> bool:
        """ec:K+M (every keep): a rank's capture ring keeps no spare, and its client reserves nothing ahead; each save
        takes its segment when it comes (``AllocateResponse.reserve_at_save``; ``memstore.server.memory.rings``)."""
        return reserves_at_save(self.config.redundancy.erasure_coded)

    def _protection(self) -> Protection:
        """What protects this store's own shards: the replicator, or under --redundancy ec:K+M the encoder (its parity
        sent to the group; the parity this store keeps for the group in ``parity``; lost shards back: ``rebuilder``)."""
        self.parity = ParityKeeper(self.host_id, self.room, self.pool, self._my_slot)
        self.encoder = None
        # Reed-Solomon (M >= 2) allocates its output per call: freed blocks stay in the C heap (memstore.erasure.heap).
        self.heap_tuned = tune_heap(self.config.redundancy)
        if self.config.redundancy.erasure_coded:
            self.encoder = Encoder(self.catalog, self.config, self.membership, self.peers, self.events, self._retention_due)
        return self.encoder or self.replicator

    def contribute(self, manifest: Manifest, place: ErasurePlace, row: int, first: int, blocks: int, data: memoryview, sent: int) -> bool:
        """A data host's contribution to this store's parity of ``row`` (``Contribute``; ``ParityKeeper.add``)."""
        return self.parity.add(manifest, place, row, first, blocks, data, sent)

    def read_parity(self, version: tuple[str, int, str], row: int, first: int, blocks: int) -> tuple[list[ShardInfo], bytes]:
        """Blocks of this store's parity of ``row`` of ``version`` (``ReadParity``; ``ParityKeeper.read``)."""
        return self.parity.read(version, row, first, blocks)

    def _erasure_repair(self) -> Rebuilder:
        """Under ec:K+M: the rebuilder, and the parts that learn of parity (restores, repair and retention)."""
        rebuilder = Rebuilder(
            self.catalog, self.parity, self.room, self.config, self.membership, self.peers, self.events, self._stop, self._retention_due
        )  # fmt: skip
        self.recovery.rebuilder = rebuilder
        self.recovery.parity_listing = self.parity.listing
        self.janitor.parity = self.parity
        self.scrubber.parity = self.parity
        return rebuilder

    def _my_slot(self) -> str | None:
        slot = self.membership.view.my_slot
        return slot.name if slot is not None else None

    def list_shards(self, job_id: str) -> list[ShardInfo]:
        """Every copy this store holds (of ``job_id``, every job: ""), then what its parity covers (ec:K+M: PARITY)."""
        return self.catalog.list_shards(job_id) + self.parity.listing(job_id)

    def read_range(self, key: ShardKey, offset: int, length: int, stride: int, count: int) -> Iterator[bytes | memoryview]:
        """``count`` pieces of ``length`` bytes of the verified copy of ``key``, piece i at ``offset + i * stride``,
        zero-padded past its end (``ReadRange``: a rebuild's reads; a parity fragment's refill)."""
        if not (0 < length <= BLOCK and count > 0 and count * length <= self.config.capacity and stride >= 0 and offset >= 0):
            raise InvalidArgument(f"ReadRange of {count} piece(s) of {length} bytes is invalid: pieces of 1..{BLOCK} bytes, at least one")
        entry = self.catalog.readable(key, wait=0.0)
        if not self.catalog.pin(entry):
            raise ShardNotFound(f"shard {key} was evicted while it was read")
        try:
            yield from read_pieces(entry.segment.view(entry.nbytes), offset, length, stride, count)
        finally:
            self.catalog.unpin(entry)

    @property
    def durable(self) -> DurableTier | None:
        """The durable tier (``--spill``), set by the composition root (``memstore.server.app``) once built."""
        return self._durable

    @durable.setter
    def durable(self, tier: DurableTier | None) -> None:
        self._durable = tier
        self.recovery.durable = tier
        self.janitor.durable = tier
        if self.recycler is not None:
            self.recycler.durable = tier
        self.drainer.durable = tier

    def foreground_busy(self) -> bool:
        """A trainer is copying a save in, a shard is being checksummed or replicated, received from a peer or a client
        (an inbound transfer open), or pulled for a restore or a repair: what background work (the spill tier, the
        reserve's faulting, the scrub) yields to. Takes no lock but the admission's, a leaf."""
        return self.catalog.busy() or self.arrivals.busy() or self.admission.busy()

    def spill_shards(self) -> list[Manifest]:
        """The settled copies held here whose spill duty is this store's (``ShardSource``; ``spill_duty``)."""
        view = self.membership.view  # one table for the whole answer
        duty: dict[str, str] = {}
        out = []
        for e in self.catalog.settled_copies():
            if e.cached or e.manifest is None:
                continue  # pulled ahead of a restore: not one of the R copies
            if e.owner_host not in duty:
                duty[e.owner_host] = spill_duty(e.owner_host, view.table, view.placement)
            if duty[e.owner_host] == self.host_id:
                out.append(e.manifest)
        return out

    def spills_for(self, owner_host: str) -> bool:
        """Whether this store spills the shards ``owner_host`` captured (``ShardSource``; ``spill_duty``)."""
        view = self.membership.view
        return spill_duty(owner_host, view.table, view.placement) == self.host_id

    def spilled(self) -> None:
        """A step was published (``ShardSource``): steps kept in RAM only until spilled may go now."""
        self._retention_due.set()

    # What the last repair pass found, the drain's progress and the catalog's counters (Health, metrics, readiness).

    @property
    def last_repair_error(self) -> str:
        return self.recovery.last_repair_error

    @property
    def under_replicated(self) -> int:
        return self.recovery.under_replicated

    @property
    def unreachable_sources(self) -> tuple[str, ...]:
        return self.recovery.unreachable_sources

    @property
    def drain_progress(self) -> str:
        return self.drainer.progress

    @property
    def capture(self) -> CaptureReport:
        return self.saver.capture

    @property
    def saves_superseded(self) -> int:
        return self.catalog.saves_superseded

    def _cluster_changed(self, view: ClusterView) -> None:
        self.peers.set_members(view.table.members())
        self._retention_due.set()  # repair and retention look again under the new placement
        if self.sweeper is not None and self._started:
            # Before the view is in force (Membership calls this first): a slot taken over has its former holder's
            # dead segment dir adopted before the repair pass could pull the same shards.
            try:
                self.sweeper.sweep(self._predecessors(view))
            except Exception:
                log.exception("sweeping %s failed; the next sweep tries again", self.sweeper.shm_dir)

    def _predecessors(self, view: ClusterView | None = None) -> set[str]:
        """Host ids whose dead segment dirs on this machine this store adopts: its own (another port) and the
        former holders of its slot (in ``view``, default the current one)."""
        slot = (view or self.membership.view).my_slot
        return {self.host_id, *(slot.former if slot is not None else ())}

    def _adopt_predecessor(self, directory: Path) -> int:
        adopted = self.adoption.adopt(directory)
        self.adopted_shards += adopted
        return adopted

    def prepare(self) -> None:
        """Before the store serves (the slot table is known: joined): adopt what predecessors left here, then fault in
        the part of the reserve wanted before serving (``--prefault``), so what was adopted is not faulted in twice."""
        self._started = True  # from now on a change of the slot table sweeps too (after this store's own leftovers)
        if self.pool.directory is not None:
            log.info("segments in %s: %s", self.pool.directory, shm_pages(str(self.pool.directory)).describe())
        if self.sweeper is not None:
            self.sweeper.sweep()  # adopt before the first repair pass looks
        t0 = time.monotonic()
        if self.config.prefault != 0:  # a replacement: what its group holds for it, so its first pulls land in ready memory
            expected = self.recovery.expected_pulls()
            if expected:
                self.pool.expect(expected)
                log.info("the group holds %d shard(s) of %s for this host's newest steps", len(expected), format_size(sum(expected)))
        ready = self.pool.prefault_now()
        if ready:
            log.info("faulted in %s of the --prefault reserve before serving in %.2fs", format_size(ready), time.monotonic() - t0)

    def start(self) -> None:
        if not self._started:
            self.prepare()
        for t in self._threads:
            t.start()
        self.pool.start_reserve(busy=self.foreground_busy)  # the reserve yields to saves, pushes, receives, pulls
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
        if self.sweeper is not None:
            self.sweeper.due.set()
        self.catalog.wake()
        self.saver.close()  # before the replicator: its pushes waiting on a capture's marks end now
        self.replicator.close()
        if self.encoder is not None:
            self.encoder.close()
        if self.rebuilder is not None:
            self.rebuilder.close()
        self.peers.close()
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=2)
        self.parity.close()
        self.pool.close()

    def hello(self) -> HelloReport:
        view = self.membership.view
        return HelloReport(
            host_id=self.host_id,
            version=__version__,
            replicas=self.config.replicas,
            peer_ids=tuple(view.table.members()),
            peer_addresses=tuple(view.table.members().values()),
            shm_dir=str(self.pool.directory or ""),
            boot_id=self.boot_id,
            capacity_bytes=self.config.capacity,
            max_chunk_bytes=self.config.chunk_bytes,
            placement=self.config.placement,
            data_port=self.data_port,
            slots=view.table,
            draining=self.draining.is_set(),
            failure_domain=self.config.failure_domain,
            control_socket=self.control_socket,
            marked_captures=True,
            redundancy=str(self.config.redundancy),
        )

    def readiness(self) -> str:
        """Why this store is not ready to take saves ("" = ready): Kubernetes' readiness (``--health-listen``)
        and ``memstore status``. Ready means serving, not draining, holding a slot, and a repair pass under the
        current slot assignment found every shard the slot should hold here (so the next store may go)."""
        if self._stop.is_set():
            return "stopping"
        if self.draining.is_set():
            return "draining"
        view = self.membership.view
        if view.my_slot is None:
            return "holds no slot yet (discovery does not list it, or no slot is free)"
        held = len(view.table.members())
        scheme = self.config.redundancy
        if scheme.erasure_coded and held < scheme.group_size:
            return f"the slot table holds {held} store(s), fewer than K+M={scheme.group_size} ({scheme}): no group keeps parity"
        if held < self.config.replicas:
            return f"the slot table holds {held} store(s), fewer than R={self.config.replicas}: saves cannot reach R copies"
        repaired = self.recovery.repaired_table
        if repaired is None or view.table.layout != repaired.layout:
            return f"repairing: copies for slot {view.my_slot.index} are not all here yet"
        return ""

    def expect_stream(self, job_id: str, rank: int, nbytes: int) -> None:
        """A peer says replicas of ``job_id``'s rank ``rank``, ``nbytes`` each, will land here (``Expect``): the
        automatic reserve learns the stream now and faults in its cycle off the save's path."""
        ensure(job_id_problem(job_id))
        if not 0 < nbytes <= self.config.capacity:
            raise InvalidArgument(f"nbytes {nbytes} is invalid: expected > 0 and at most --capacity ({self.config.capacity} bytes)")
        self.pool.announce(nbytes, (job_id, rank))

    def alive(self, timeout: float) -> bool:
        """Liveness: the engine's lock can be taken within ``timeout`` seconds (a deadlocked store says False)."""
        return self.catalog.alive(timeout)

    def fetch(self, key: ShardKey, discard_local: bool, durable_known: bool = False, cached: bool = False) -> tuple[Manifest, str]:
        """A restore's Fetch (``Recovery.fetch``): first the job's floor falls to the version restored, if it was above."""
        self.floors.restoring(key.job_id, Floor(key.step, key.timeline))
        return self.recovery.fetch(key, discard_local, durable_known, cached)

    def delete(self, job_id: str, step: int, rank: int) -> int:
        """Drop copies (``Eviction.delete``; -1: every step, every rank); a whole job deleted forgets its restorable floor
        too: a later run under the same id starts without one."""
        ensure(job_id_problem(job_id))
        for name, value in (("step", step), ("rank", rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < -1:
                raise InvalidArgument(f"{name} {value!r} is invalid: expected an int >= 0, or -1 for every {name}")
        if rank == -1:  # a whole step (or job): its parity goes too (one rank's shard leaves the others' parity in place)
            self.parity.delete(job_id, step)
        deleted = self.eviction.delete(job_id, step, rank)
        if step == -1 and rank == -1:
            self.floors.forget(job_id)
        return deleted

    def census(self) -> list[JobCensus]:
        """What this store holds in RAM, per job (the metrics read it at each scrape)."""
        copies = self.catalog.census_copies()
        floors = {job: floor.step for job in {key.job_id for key, _, _ in copies} if (floor := self.floors.get(job)) is not None}
        return job_census(copies, floors)

    def health(self) -> HealthReport:
        shards = len(self.catalog.census_copies())
        return HealthReport(
            serving=not self._stop.is_set() and not self.draining.is_set(),  # readiness: a draining store takes no saves
            host_id=self.host_id,
            used_bytes=self.pool.used_bytes,
            pooled_bytes=self.pool.pooled_bytes,
            reserve_bytes=self.pool.reserve_bytes,
            reserve_filling=self.pool.reserve_filling,
            capacity_bytes=self.config.capacity,
            shards=shards,
            replications_in_flight=self.catalog.in_flight,
            repairs_in_flight=self.arrivals.repairs_in_flight,
            uptime_seconds=time.monotonic() - self.started,
            spill_url=self.config.spill,
            spill=tuple(
                SpillReport(
                    job_id=job,
                    last_spilled_step=st.last_spilled_step,
                    last_spill_unix=st.last_spill_time or 0.0,
                    consecutive_failures=st.consecutive_failures,
                    last_error=st.last_error,
                    bytes_written=st.bytes_written,
                )
                for job, st in sorted((self.durable.status if self.durable else {}).items())
            ),
            orphans=tuple(self.pool.orphans()),
            adopted_shards=self.adopted_shards,
            draining=self.draining.is_set(),
            drain_progress=self.drain_progress,
            slots=self.membership.view.table,
            discovery=self.discovery,
            not_ready=self.readiness(),
            capture=self.capture,
            saves_superseded=self.saves_superseded,
            jobs_memory=tuple(JobMemory(job, used, pooled) for job, (used, pooled) in sorted(self.pool.jobs_memory().items()) if job),
            ring_overflows=self.pool.ring_overflows,
            ring_limit=self.pool.ring_limit,
            scrubbed_bytes=self.scrubber.scrubbed_bytes,
            scrub_corrupt=self.scrubber.corrupt,
        )
