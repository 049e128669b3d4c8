"""A client's capture ring: the store segments its saves land in, mapped once and registered once.

The store hands every save of one rank a segment of that rank's *capture ring* (``memstore.server.memory.pool``:
a pooled segment goes back to the rank that used it, replicas and pulls never take it) and lists the ring in
each ``AllocateResponse.ring_paths``. :class:`CaptureRing` keeps each ring segment mapped at exactly the size
the store allocated (a mapping never reaches past its file's end, and the store never resizes a ring
segment), registers it for DMA (``cudaHostRegister``, through ``trainer_client.capture.cuda``) the first time a
save with CUDA tensors lands in it, and unregisters and unmaps what left the ring. After warm-up every save
lands in memory registered before: no registration, no mapping, no page fault.

The ring holds each save's lease from its start to its end: :meth:`CaptureRing.take` (the lease reserved ahead, or one
allocated now), then :meth:`CaptureRing.commit` (the ``Commit``: the store owns the bytes from then on; a
:class:`Handover` says what it tells the store besides the lease), :meth:`CaptureRing.mark` (the first bytes of a large
copy are final: the store starts pushing them) or :meth:`CaptureRing.abort` (the lease given back). The save path
(``trainer_client.transport.shared_memory_path``) takes the lease and hands the capture its commit and abort as plain
callables. After each commit the ring reserves the next save's segment ahead (``AllocateRequest.ahead``) on its own
thread, maps and registers it there: ``save()`` then makes no call to the store at all. ``prepare`` does the
same before the first save. Unless the store says that this rank's saves take their segment when they come
(``AllocateResponse.reserve_at_save``: ``--redundancy ec:K+M``, whose rings keep no spare: with ``--keep`` 2 or more
a save takes the segment of its rank's oldest kept step, which must stay restorable until then): the ring then only
fills itself to its size after a commit, and each save costs one ``Allocate`` round trip, answered with a segment of
the ring, which is mapped (and registered) already. At ``--keep 1`` under ec:K+M the ring is one segment, the kept
step's: a save's ``Allocate`` is answered with a fresh segment, mapped (and registered) then, in the save's path, and
the kept step's segment leaves the ring (the store frees its pages once retention drops that step; this client unmaps
it at its next ``Allocate``).

A registration that fails is retried once after re-mapping the segment; if it fails again the save copies
through pageable memory (synchronously) and the failure is counted (``CaptureStats``, sent with the next
commit: the store's metrics and ``memstore status`` show it) and logged with its cause.
``MEMSTORE_STRICT_PINNING=1`` (:func:`trainer_client.knobs.strict_pinning`) turns such a fallback into a
:class:`~trainer_client.errors.CaptureError` (the GPU tests run so).

No device copy outlives its destination: a save holds its segment's mapping (:meth:`CaptureRing.hold`) from before
its copies are queued until they are synchronized or the save is aborted. The hold counts as a capture in flight on
the mapping and keeps a ``memoryview`` of it exported, from which the save's target tensor is built: closing the
mapping under it raises ``BufferError`` instead of unmapping it. While a capture (or a restore, or a registration)
uses a mapping, nothing unregisters, re-maps or unmaps it: pruning skips it, and a mapping replaced, or dropped by
:meth:`CaptureRing.close`, is unregistered and unmapped when the last one is done.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field

from memstore.v1 import store_pb2 as pb
from memstore.v1.integrity import CHECKSUM_ALGO
from memstore.v1.manifests import set_floor
from memstore.v1.pagefaults import address_of, populate_supported, populate_writable
from trainer_client import knobs
from trainer_client.capture import cuda
from trainer_client.errors import CapacityExceededError, CaptureError, RingBusyError
from trainer_client.serialization import ChunkSums

log = logging.getLogger(__name__)

ANSWER_WAIT_SECONDS = 0.02  # a save waits this long for the store's answer to the reservation under way (a call in flight)
# How long a reservation ahead asks again while the store answers that the rank's ring is full (``ring_busy``: the
# newest save has not settled yet, so retention has not freed the oldest kept step's segment); ``close()`` stops it.
AHEAD_WAIT_SECONDS = 10.0
_RENEW_MARGIN = 60.0  # an ahead lease this close to its expiry is given back and the save allocates anew


@dataclass(frozen=True)
class CaptureStats:
    """What this client's captures cost: ``registrations`` (cudaHostRegister calls that succeeded; 0 more after
    warm-up), ``fallbacks`` (saves copied through pageable memory because registration failed; should be 0) and
    the last fallback's cause."""

    registrations: int = 0
    fallbacks: int = 0
    last_fallback: str = ""


@dataclass
class Slot:
    """One lease on a ring segment: where a save writes."""

    lease_id: str
    path: str
    size: int  # the segment's bytes: the mapping's length
    nbytes: int  # the bytes asked for
    mm: mmap.mmap
    ahead: bool  # allocated before its step was known: the commit names the shard
    expires: float  # time.monotonic() when the store lets the lease go
    pinned: bool = False
    hold: Hold | None = None  # CaptureRing.hold(): the save's hold on the mapping, ended by committed() or give_back()
    marked: bool = False  # CaptureRing.mark(): the store took the shard in at a first mark (an abort leaves it to the store)


@dataclass(frozen=True)
class Handover:
    """What the ``Commit`` of a save tells the store besides its lease (:meth:`CaptureRing.commit`, :meth:`CaptureRing.mark`).

    Attributes:
        key: the shard's key (named by the commit when its lease was reserved ahead, before its step was known).
        world_size: the job's (the next save's lease is reserved with it).
        request: the fields known before the copy: the shard's metrics, format version, codec, stripe.
        started: ``time.perf_counter()`` when ``save()`` was called: the commit reports the capture's seconds since.
        floor: reads the job's restorable floor when the commit is sent: (step, its timeline; "" = the shard's);
            None when there is no agreement.
        sums: the checksums the copy made (None, or no values: the store hashes the shard).
    """

    key: pb.ShardKey
    world_size: int
    request: pb.CommitRequest
    started: float
    floor: Callable[[], tuple[int, str] | None] | None = None
    sums: ChunkSums | None = None


@dataclass
class _Mapped:
    mm: mmap.mmap
    inode: int
    pinned: bool = False
    failed: str = ""  # registration failed twice: the cause (copies into it fall back)
    busy: int = 0  # restores reading it, a registration or an adoption under way: not unmapped until they are done
    captures: int = 0  # saves holding it (Hold): copies queued into it or about to be; never unmapped nor re-mapped meanwhile
    retired: bool = False  # left the ring while in use: unregistered and unmapped when the last user is done
    pinning: threading.Lock = field(default_factory=threading.Lock)  # one registration at a time

    @property
    def in_use(self) -> bool:
        return bool(self.busy or self.captures)


def map_segment(path: str, size: int) -> mmap.mmap:
    """Map a store segment read-write at exactly ``size`` bytes and fault its pages in, on all cores at once
    (``populate_writable``): a fresh segment the store made sparse gets its pages allocated here, one it had faulted in
    only its page tables. A page the tmpfs cannot hold raises CapacityExceededError now, never a SIGBUS mid-copy."""
    # (without the call the store makes no sparse segment either: a populating mapping does it)
    flags = mmap.MAP_SHARED if populate_supported() else mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, size, flags=flags)
    finally:
        os.close(fd)
    if populate_supported() and not populate_writable(address_of(mm), size):
        mm.close()
        raise CapacityExceededError(
            f"the store's shared memory {path} could not be faulted in ({size} bytes): its tmpfs is full; enlarge it "
            "(/dev/shm) or lower the store's --capacity"
        )
    return mm


def _unmap(mapped: _Mapped) -> None:
    """Unregister (if registered) and unmap: a registration must not outlive the pages it pinned. Only for a mapping
    nothing uses (``_Mapped.in_use``): see :meth:`CaptureRing._retire`."""
    if mapped.pinned:
        cuda.unregister(address_of(mapped.mm))
        mapped.pinned = False
    _close(mapped.mm)


def _close(mm: mmap.mmap) -> None:
    """Unmap ``mm``; a view of it that nobody counted still exported is an error, logged (the pages stay until it goes)."""
    try:
        mm.close()
    except BufferError:
        log.error("a capture-ring mapping of %d bytes is unmapped while a view of it is exported: it stays until that view goes", len(mm))


class Hold:
    """A save's hold on its segment's mapping (:meth:`CaptureRing.hold`): ``view`` (a ``memoryview`` of the mapping,
    exported until :meth:`release`) is what the save's target tensor is built from; the mapping stays mapped and
    registered until :meth:`release`, which the save calls once its copies are synchronized or it is aborted."""

    def __init__(self, ring: CaptureRing, mapped: _Mapped) -> None:
        self._ring = ring
        self._mapped: _Mapped | None = mapped
        self.view = memoryview(mapped.mm)

    def release(self) -> None:
        """End the hold (again: no-op). The view must have no export left (torch.frombuffer takes none)."""
        mapped, self._mapped = self._mapped, None
        if mapped is not None:
            self.view.release()
            self._ring._put(mapped, capture=True)


class CaptureRing:
    """The ring segments of one client (job, rank), their mappings and registrations, and the next save's lease.

    Args:
        allocate: sends an ``AllocateRequest`` to the store (the client's control path: a save allocating now).
        release: gives a lease back (``Release``).
        allocate_ahead: sends an ``AllocateRequest`` from the ring's thread (default ``allocate``); the client
            passes its gRPC channel, so the ring's calls never queue behind the save's on the one-call-at-a-time
            Unix socket (nor the save's behind the ring's).
        commit: sends a ``CommitRequest`` (the control path), with what to name in an error (:meth:`commit`,
            :meth:`mark`); None: the ring's leases are only taken and given back (tests of the ring alone).
    """

    def __init__(
        self,
        allocate: Callable[[pb.AllocateRequest], pb.AllocateResponse],
        release: Callable[[str], None],
        allocate_ahead: Callable[[pb.AllocateRequest], pb.AllocateResponse] | None = None,
        commit: Callable[[pb.CommitRequest, str], object] | None = None,
    ) -> None:
        self._allocate = allocate
        self._allocate_ahead = allocate_ahead or allocate
        self._release = release
        self._commit = commit
        self._lock = threading.RLock()
        self._maps: dict[str, _Mapped] = {}
        self._ahead: Future[Slot] | None = None
        self._answered = threading.Event()  # the store answered the reservation under way (it is being mapped)
        self._thread: ThreadPoolExecutor | None = None  # reserves the next save's lease
        self._grower: ThreadPoolExecutor | None = None  # fills the ring during warm-up (never ahead of a reservation)
        self._growing: Future[None] | None = None
        self._closing = threading.Event()
        self.pinning = False  # register ring segments: once a save held CUDA tensors (or the runtime pins host states)
        self._registrations = 0
        self._fallbacks = 0
        self._last_fallback = ""
        self._reported = CaptureStats()
        self._limit = 1  # segments the ring holds once warm, as the store said (AllocateResponse.ring_limit)
        self._at_save = False  # the store takes this rank's segments when its saves come (AllocateResponse.reserve_at_save)
        self._ring_size = 0  # segments in the ring, as the store last listed them
        self._leased: set[str] = set()  # segments this client holds a lease on (reserved, or a save writing into it)
        self._seq = 0  # Allocate requests sent
        self._pruned_at = 0  # the request whose answer last pruned the mappings

    # -- stats ---------------------------------------------------------------------------
    @property
    def stats(self) -> CaptureStats:
        with self._lock:
            return CaptureStats(self._registrations, self._fallbacks, self._last_fallback)

    def report(self) -> pb.CaptureStats:
        """The counts since the last report (sent with each commit), and mark them reported."""
        with self._lock:
            now, before = self.stats, self._reported
            self._reported = now
        return pb.CaptureStats(
            registrations=now.registrations - before.registrations,
            fallbacks=now.fallbacks - before.fallbacks,
            fallback_cause=now.last_fallback if now.fallbacks > before.fallbacks else "",
        )

    def ahead_path(self) -> str:
        """The segment reserved for the next save ("" if none): waits for a reservation under way."""
        with self._lock:
            future = self._ahead
        try:
            return future.result().path if future is not None else ""
        except Exception:
            return ""

    @property
    def mapped_paths(self) -> list[str]:
        with self._lock:
            return sorted(self._maps)

    # -- slots ---------------------------------------------------------------------------
    def slot(self, key: pb.ShardKey, world_size: int, nbytes: int, floor: Callable[[], tuple[int, str] | None] | None = None) -> Slot:
        """Where the save of ``key`` writes its ``nbytes``: the lease reserved ahead when it fits (no call), else a
        fresh allocation of ``key`` now. Pinned when ``pinning`` (a fallback is counted, or raised when strict). A save
        then holds its mapping (:meth:`hold`). ``floor``: reads the job's restorable floor for the ``Allocate`` when the
        store takes this rank's segments at save time (``reserve_at_save``): it may retire the rank's oldest kept step
        for this save only below a step every rank saved (``PlannedShard.allocate_floor``: this save's agreement). Not
        read for a ring of one segment (``--keep 1`` under ec:K+M: no kept step is retired for a save, it takes a fresh
        segment)."""
        slot = self._take_ahead(nbytes)
        if slot is None:
            self._await_fill()
            request = pb.AllocateRequest(key=key, world_size=world_size, nbytes=nbytes)
            with self._lock:
                # the store may retire the oldest kept step for this save: not from a ring of one (--keep 1 under ec:K+M)
                recycles = self._at_save and self._limit >= 2
            agreed = floor() if recycles and floor is not None else None  # may wait (bounded) for this save's agreement
            if agreed is not None:
                set_floor(request, *agreed)
            seq = self._next_seq()
            slot = self._adopt(self._allocate(request), nbytes, ahead=False, seq=seq)
        if self.pinning and not slot.pinned:
            slot.pinned = self._pin(slot.path)
            with self._lock:
                slot.mm = self._maps[slot.path].mm  # re-mapped if the first registration failed
            if not slot.pinned:
                self._fell_back(slot)
        return slot

    def take(
        self, key: pb.ShardKey, world_size: int, nbytes: int, pin: bool = False,
        floor: Callable[[], tuple[int, str] | None] | None = None,
    ) -> Slot:  # fmt: skip
        """:meth:`slot`, then :meth:`hold` of it (``slot.hold.view``: the save's target): where a save writes, held for it
        until :meth:`commit`, :meth:`abort` (or :meth:`committed`, :meth:`give_back`). ``pin``: the save needs memory
        registered for DMA: from now on every ring segment is registered (this one now, the rest as used). ``floor``: see
        :meth:`slot`."""
        if pin:
            self.pinning = True
        slot = self.slot(key, world_size, nbytes, floor)
        try:
            self.hold(slot)
        except BaseException:
            self.give_back(slot)
            raise
        return slot

    def _take_ahead(self, nbytes: int) -> Slot | None:
        """The lease reserved ahead, if it fits (waiting for a reservation the store has answered: mapping a segment
        while the ring is warming up). A reservation the store has not answered within ``ANSWER_WAIT_SECONDS`` (a call
        in flight takes a few ms) waits there for retention to free a segment of the full ring (saves outran retention):
        the save does not wait for it but allocates now, and the reservation stays for the next save. While the ring is
        still warming up (fewer segments than it holds once warm) the store never waits for retention: a reservation
        under way is making this save's segment (or waiting for the one the ring's fill is making), and the save waits
        for it rather than make another beside it (twice the memory, and each made at half the speed)."""
        with self._lock:
            future = self._ahead
            warming = self._ring_size < self._limit
        if future is not None and not future.done() and not self._answered.wait(ANSWER_WAIT_SECONDS):
            if not warming:
                return None
            future.exception()  # bounded: the reservation asks for at most AHEAD_WAIT_SECONDS
        with self._lock:
            if self._ahead is not future:  # (one save at a time per client: nothing else takes it)
                return None
            self._ahead = None
        if future is None:
            return None
        try:
            slot = future.result()
        except Exception as exc:  # the save allocates itself, and raises what the store says then
            log.info("reserving the next save's memory ahead failed (%s); allocating now", exc)
            return None
        if nbytes <= slot.size and slot.expires - time.monotonic() > _RENEW_MARGIN:
            slot.nbytes = nbytes
            return slot
        self.give_back(slot)  # too small for this state, or about to expire: the store takes it back into the ring
        return None

    def _await_fill(self) -> None:
        """When the store takes this rank's segments at save time (``reserve_at_save``), wait for the ring's fill under way
        (``_grow``): the save then takes the segment it made, mapped, instead of making another beside it."""
        with self._lock:
            growing = self._growing if self._at_save else None
        if growing is not None:
            with contextlib.suppress(Exception):
                growing.result(timeout=AHEAD_WAIT_SECONDS)

    def reserve_ahead(self, key: pb.ShardKey, world_size: int, nbytes: int, grow: bool = True) -> None:
        """Reserve, map (and register) the next save's segment on the ring's thread (no-op if one is reserved, or when the
        store takes this rank's segments at save time: ``reserve_at_save``); then, with ``grow``, add segments to the ring
        there until it is warm (``_grow``)."""
        with self._lock:
            if self._at_save:
                if grow:
                    self._fill(pb.ShardKey(job_id=key.job_id, rank=key.rank), world_size, nbytes)
                return
            if self._ahead is not None:
                return
            if self._thread is None:
                self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memstore-ring")
            ahead = pb.ShardKey(job_id=key.job_id, rank=key.rank)
            self._answered.clear()
            self._ahead = self._thread.submit(self._reserve, ahead, world_size, nbytes)
            if grow:
                self._fill(ahead, world_size, nbytes)

    def _fill(self, key: pb.ShardKey, world_size: int, nbytes: int) -> None:
        """Start ``_grow`` on the ring's fill thread unless the ring is warm or a fill is under way (lock held)."""
        if self._ring_size < self._limit and (self._growing is None or self._growing.done()) and not self._closing.is_set():
            if self._grower is None:
                self._grower = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memstore-ring-fill")
            self._growing = self._grower.submit(self._grow, key, world_size, nbytes)

    def prepare(self, key: pb.ShardKey, world_size: int, nbytes: int) -> None:
        """Fill the ring now: as many segments as it holds once warm (``AllocateResponse.ring_limit``), each mapped
        (and registered when ``pinning``), all but one given back to the ring's pool; the one kept is the next save's.
        Without it the ring fills over the first saves, on the ring's thread (see ``_grow``). When the store takes this
        rank's segments at save time (``reserve_at_save``, learnt from an earlier answer) nothing is kept reserved: the
        ring is only filled."""
        self.reserve_ahead(key, world_size, nbytes, grow=False)
        with self._lock:
            future = self._ahead
        if future is not None:
            future.result()  # raises what the store said (capacity, quota, ...)
        self._grow(pb.ShardKey(job_id=key.job_id, rank=key.rank), world_size, nbytes)

    def wait_ahead(self, timeout: float | None = None) -> None:
        """Wait until the next save's lease is reserved and mapped (or, when the store takes this rank's segments at save
        time, the ring's fill is done), at most ``timeout`` seconds (tests and benchmarks that want the steady state)."""
        self._wait_reservation(timeout)
        with self._lock:
            growing = self._growing if self._at_save else None
        if growing is not None:
            with contextlib.suppress(FutureTimeoutError):
                growing.exception(timeout)

    def _wait_reservation(self, timeout: float | None = None) -> None:
        with self._lock:
            future = self._ahead
        if future is not None:
            with contextlib.suppress(FutureTimeoutError):
                future.exception(timeout)

    def _grow(self, key: pb.ShardKey, world_size: int, nbytes: int) -> None:
        """Add segments to the ring until it holds what it will once warm: each one reserved as a new member
        (``AllocateRequest.grow``), mapped, registered and given back at once.

        Run on a thread of its own after a reservation, so neither a save nor the next reservation waits for a new
        segment to be made; it starts once that reservation is mapped, so the next save's segment never shares the
        cores with the ring's later ones (in a job's first saves both are fresh memory)."""
        try:
            self._wait_reservation()
            size = self._ring_size
            for _ in range(self._limit):
                if size >= self._limit or self._closing.is_set():
                    return
                slot = self._reserve(key, world_size, nbytes, grow=True)
                grown, size = self._ring_size > size, self._ring_size
                self.give_back(slot)  # pooled at once: the next save may take it
                if not grown:  # the last one given back was not kept (the store's pool is full): stop there
                    log.info("the capture ring stays at %d segments: the store keeps no more pooled for it", size)
                    return
        except Exception as exc:  # capacity, quota: the ring stays smaller; saves still find their lease
            log.info("growing the capture ring stopped: %s", exc)

    def _reserve(self, key: pb.ShardKey, world_size: int, nbytes: int, grow: bool = False) -> Slot:
        request = pb.AllocateRequest(key=key, world_size=world_size, nbytes=nbytes, ahead=True, grow=grow)
        deadline = time.monotonic() + AHEAD_WAIT_SECONDS
        while True:
            seq = self._next_seq()
            response = self._allocate_ahead(request)
            if not response.ring_busy:
                break
            with self._lock:
                self._at_save = response.reserve_at_save
            if response.reserve_at_save:
                raise RingBusyError(
                    f"rank {key.rank}'s capture ring is full ({len(response.ring_paths)} segments) and the store gives its next "
                    "save the oldest kept step's segment when that save comes: nothing reserved ahead"
                )
            if self._closing.is_set() or time.monotonic() >= deadline:
                raise RingBusyError(
                    f"rank {key.rank}'s capture ring stayed full ({len(response.ring_paths)} segments, each holding a kept step "
                    "or a save in flight): nothing reserved ahead; the next save allocates when it comes"
                )
        if not grow:
            self._answered.set()  # the store answered: a save waits for the mapping rather than allocating anew
        slot = self._adopt(response, nbytes, ahead=True, seq=seq)
        if self.pinning:
            slot.pinned = self._pin(slot.path)  # a failure is counted when a save uses the slot
            with self._lock:
                slot.mm = self._maps[slot.path].mm
        return slot

    def commit(self, slot: Slot, handover: Handover) -> None:
        """Hand ``slot``'s shard to the store (``Commit``, reporting the ring's capture counts): it owns the bytes from
        then on, and the save's hold ends (a commit the store refuses lets the lease expire there). Then reserve the next
        save's segment ahead."""
        assert self._commit is not None, "a ring that commits is given its commit call"
        key = handover.key
        request = _commit_request(slot, handover, capture=self.report())
        try:
            self._commit(request, f"commit step {key.step}")
        finally:
            self.committed(slot)  # taken in, or refused (the lease then expires in the store)
        self.reserve_ahead(key, handover.world_size, slot.nbytes)

    def mark(self, slot: Slot, handover: Handover, captured: int) -> None:
        """The first ``captured`` bytes of ``slot`` are final: a ``Commit`` with ``captured_bytes``, and the store starts
        pushing them to the replicas; it holds the shard from the first mark on."""
        assert self._commit is not None, "a ring that commits is given its commit call"
        self._commit(_commit_request(slot, handover, captured=captured), f"commit step {handover.key.step} (its first {captured} bytes)")
        slot.marked = True

    def abort(self, slot: Slot) -> None:
        """A step of the save before its commit failed: give the lease back (after a mark the store drops the shard by
        itself once no more marks come: the save's hold just ends)."""
        if slot.marked:
            self.committed(slot)
        else:
            self.give_back(slot)

    def committed(self, slot: Slot) -> None:
        """The store took ``slot``'s shard in: its segment may leave the ring (and be unmapped) from now on; a save's
        hold on it ends."""
        if slot.hold is not None:
            slot.hold.release()
        with self._lock:
            self._leased.discard(slot.path)

    def give_back(self, slot: Slot) -> None:
        """Release an unused lease (its segment stays in the ring, mapped and registered)."""
        self.committed(slot)
        try:
            self._release(slot.lease_id)
        except Exception as exc:  # the lease expires on its own
            log.info("releasing an unused capture lease failed (%s); the store lets it expire", exc)

    def _fell_back(self, slot: Slot) -> None:
        with self._lock:
            cause = self._maps[slot.path].failed if slot.path in self._maps else "not registered"
            self._fallbacks += 1
            self._last_fallback = cause
        message = (
            f"the save's memory ({slot.path}, {slot.size} bytes) could not be registered for DMA ({cause}): CUDA tensors are "
            "copied through pageable memory, synchronously"
        )
        if knobs.strict_pinning():
            self.give_back(slot)
            raise CaptureError(f"{message}; refused because {knobs.STRICT_PINNING_ENV} is set")
        log.warning("%s", message)

    # -- mappings ------------------------------------------------------------------------
    def _next_seq(self) -> int:
        with self._lock:
            self._seq += 1
            return self._seq

    def _adopt(self, response: pb.AllocateResponse, nbytes: int, ahead: bool, seq: int) -> Slot:
        """Map the segment of an Allocate's answer, and drop the mappings of segments that left the ring: only by the
        answer to the latest request (an older one, arriving late, lists the ring as it was), and never one whose
        lease this client holds or that a restore or a registration is using.

        Mapping, registering and unmapping run outside the ring's lock (each can take a good part of a second for a
        few GiB): a save taking its reserved lease never waits for the ring's threads."""
        path, size = response.segment_path, int(response.segment_bytes)
        expires = time.monotonic() + (response.lease_seconds or 600.0)
        try:
            mapped = self._map(path, size)  # busy: not pruned by another answer before it is leased below
            try:
                with self._lock:
                    self._limit = int(response.ring_limit) or self._limit
                    self._at_save = response.reserve_at_save
                    self._ring_size = len(response.ring_paths)
                    self._leased.add(path)
                    gone: list[_Mapped] = []
                    if seq > self._pruned_at:
                        self._pruned_at = seq
                        keep = {*response.ring_paths, *self._leased}
                        gone = [self._maps.pop(p) for p, m in list(self._maps.items()) if p not in keep and not m.in_use]
                    slot = Slot(response.lease_id, path, size, nbytes, mapped.mm, ahead, expires, pinned=mapped.pinned)
            finally:
                self._put(mapped, capture=False)
            for old in gone:
                self._retire(old)
            return slot
        except BaseException:
            with contextlib.suppress(Exception):
                self._release(response.lease_id)
            raise

    def _map(self, path: str, size: int) -> _Mapped:
        """The mapping of ``path`` at exactly ``size`` bytes, marked busy (the caller ends that with ``_put``): the one
        kept if it is still that file at that size. One it replaces goes once nothing uses it (``_retire``)."""
        inode = os.stat(path).st_ino
        with self._lock:
            mapped = self._maps.get(path)
            if mapped is not None and (len(mapped.mm), mapped.inode) == (size, inode) and not mapped.mm.closed:
                mapped.busy += 1
                return mapped
        fresh = _Mapped(map_segment(path, size), inode)
        old: _Mapped | None
        with self._lock:
            mapped = self._maps.get(path)
            if mapped is not None and (len(mapped.mm), mapped.inode) == (size, inode) and not mapped.mm.closed:
                old, kept = fresh, mapped  # another thread mapped it meanwhile
            else:
                old, kept = mapped, fresh
                self._maps[path] = fresh
            kept.busy += 1
        if old is not None:
            self._retire(old)
        return kept

    def _retire(self, mapped: _Mapped) -> None:
        """Unregister and unmap a mapping that left ``_maps``: now, or, while a capture, a restore or a registration
        uses it, when the last of them is done (``_put``)."""
        with self._lock:
            mapped.retired = True
            if mapped.in_use:
                return
        _unmap(mapped)

    def _put(self, mapped: _Mapped, capture: bool) -> None:
        """One user of ``mapped`` is done (a capture's hold, or a ``busy`` one); the last one unmaps it if it retired."""
        with self._lock:
            if capture:
                mapped.captures -= 1
            else:
                mapped.busy -= 1
            last = mapped.retired and not mapped.in_use
        if last:
            _unmap(mapped)

    def hold(self, slot: Slot) -> Hold:
        """Hold ``slot``'s mapping for the save writing into it (``slot.hold``): mapped and registered, never re-mapped,
        until :meth:`committed` or :meth:`give_back` of the slot, which the save calls only once its copies are
        synchronized or it is aborted. Build the save's target from ``Hold.view``."""
        with self._lock:
            mapped = self._maps.get(slot.path)
            if slot.hold is not None or mapped is None or mapped.mm is not slot.mm or mapped.mm.closed:
                raise CaptureError(f"the mapping of {slot.path} cannot be held for a save: held already, or it left the capture ring")
            mapped.captures += 1
            try:
                slot.hold = Hold(self, mapped)
            except BaseException:
                mapped.captures -= 1
                raise
            return slot.hold

    def _pin(self, path: str) -> bool:
        """Register ``path``'s mapping for DMA unless done; retried once after re-mapping. Whether it is registered."""
        with self._lock:
            mapped = self._maps.get(path)
            if mapped is None:
                return False
            mapped.busy += 1  # not unmapped while it is being registered
        try:
            with mapped.pinning:
                if mapped.pinned or mapped.failed:
                    return mapped.pinned
                return self._register(path, mapped)
        finally:
            self._put(mapped, capture=False)

    def _register(self, path: str, mapped: _Mapped) -> bool:
        size = len(mapped.mm)
        cause = ""
        for attempt in range(2):
            if os.stat(path).st_size < size:  # never register past the file's end (CUDA refuses it: invalid argument)
                code, cause = cuda.ERROR_INVALID_VALUE, f"the file is shorter than its {size}-byte mapping"
            else:
                code = cuda.register(address_of(mapped.mm), size, cuda.HOST_REGISTER_PORTABLE)
                cause = cuda.error_text(code) if code else ""
            if code == 0:
                with self._lock:
                    mapped.pinned = True
                    self._registrations += 1
                return True
            log.warning("cudaHostRegister of %d bytes of %s failed (attempt %d of 2): %s", size, path, attempt + 1, cause)
            if attempt == 0:  # map it afresh (same object: its users see the new mapping) and try once more
                fresh = map_segment(path, size)
                with self._lock:
                    held = mapped.captures > 0  # a save writes into the mapping: it must stay where it is
                    if not held:
                        stale, mapped.mm, mapped.inode = mapped.mm, fresh, os.stat(path).st_ino
                if held:
                    fresh.close()
                    cause += " (not re-mapped: a save was writing into it)"
                    break
                _close(stale)
        mapped.failed = cause
        return False

    def pin_all(self) -> None:
        """Register every ring mapping now (the client starts pinning: its first save with CUDA tensors)."""
        with self._lock:
            paths = list(self._maps)
        for path in paths:
            self._pin(path)

    @contextlib.contextmanager
    def registered_view(self, path: str, nbytes: int) -> Iterator[mmap.mmap | None]:
        """The registered ring mapping of ``path`` while a restore reads its first ``nbytes`` (None: not one)."""
        with self._lock:
            mapped = self._maps.get(path)
            if mapped is None or not mapped.pinned or len(mapped.mm) < nbytes or mapped.inode != os.stat(path).st_ino:
                mapped = None
            else:
                mapped.busy += 1
        if mapped is None:
            yield None
            return
        try:
            yield mapped.mm
        finally:
            self._put(mapped, capture=False)

    def close(self) -> None:
        """Give back the lease reserved ahead, unregister and unmap everything (a mapping a save or a restore still uses
        once it is done with it)."""
        self._closing.set()
        with self._lock:
            future, self._ahead = self._ahead, None
            threads = [t for t in (self._thread, self._grower) if t is not None]
            self._thread = self._grower = None
        if future is not None:
            with contextlib.suppress(Exception):
                self.give_back(future.result())
        for thread in threads:
            thread.shutdown(wait=True)
        with self._lock:
            maps, self._maps = list(self._maps.values()), {}
        for mapped in maps:
            self._retire(mapped)


def _commit_request(
    slot: Slot, handover: Handover, *, captured: int | None = None, capture: pb.CaptureStats | None = None
) -> pb.CommitRequest:
    """The ``Commit`` of the shard written into ``slot``: ``handover.request`` plus the lease (and, reserved ahead, the key
    and size it names), the restorable floor read now and ``captured``, a mark (the first ``captured`` bytes are final)
    instead of the final commit, which carries the ring's ``capture`` counts, the capture's seconds and, when the trainer
    hashed the copy, its checksums."""
    request = pb.CommitRequest()
    request.CopyFrom(handover.request)
    request.lease_id = slot.lease_id
    floor = handover.floor() if handover.floor is not None else None
    if floor is not None:
        set_floor(request, *floor)
    if captured is not None:
        request.captured_bytes = captured
    else:
        if capture is not None:
            request.capture.CopyFrom(capture)
        request.capture_seconds = time.perf_counter() - handover.started
        sums = handover.sums
        if sums is not None and sums.values is not None:
            request.chunk_size, request.checksum_algo = sums.chunk_size, CHECKSUM_ALGO
            request.chunk_checksums.extend(sums.values)
    if slot.ahead:
        request.key.CopyFrom(handover.key)
        request.nbytes = slot.nbytes
    return request
