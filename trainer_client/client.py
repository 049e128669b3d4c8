"""``CheckpointClient``: save a rank's state into the host's store and restore it.

Save path on the same machine as the store (the common case): the store hands out a shared-memory
segment it owns (pre-faulted, and mapped here ahead of time when the store could name it), the client
copies the state straight into it, and ``commit`` transfers ownership; these calls go over the
store's Unix socket (``trainer_client.transport.local_control_client``). ``save()`` returns then: the only stall is
that copy, and a trainer crash afterwards loses nothing. Checksums and replication happen in the store,
in the background. Without shared memory (a store on another machine) the client stages the shard,
checksums it and sends it over the store's data channel (``trainer_client.transport.remote``).

Load path: the local store first makes sure it holds a verified copy (pulling from a peer if not) and
verifies it again when the client opens it; the client maps it copy-on-write and decodes. Bytes are
never unpickled.

Timelines: every shard is saved under the timeline of the save that produced it, and a step restores
only from shards of one timeline, so a restore never mixes two saves of a step. A client's timeline is
``<run id>.<epoch>``: the run id is the same on every rank of one start of the job (``run_id=``,
``MEMSTORE_RUN_ID``, or drawn by rank 0 and broadcast over the default process group at the first
save), and the epoch goes up whenever the client saves a step at or below one it saved before (a
rollback), which every rank of an SPMD job does at the same point.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import torch
from torch.utils.hooks import RemovableHandle

from memstore.core.agreement import Seen
from memstore.v1 import store_pb2 as pb
from memstore.v1.channel import boot_id, store_stub
from memstore.v1.integrity import CHECKSUM_ALGO, DEFAULT_CHUNK_BYTES, SPILL_CODECS, compute_checksums
from memstore.v1.keys import job_id_problem, key_problem, timeline_problem
from trainer_client import serialization
from trainer_client.agreement import Agreements, AgreementStats, ClusterAnswer, LocalAnswer, agree
from trainer_client.capture import cuda as _cuda
from trainer_client.capture.device_restore import parse_map_location, prepare_bounce_ring
from trainer_client.capture.device_save import CAPTURE_MODES, Capture, Captures, host_writer
from trainer_client.capture.ring import CaptureRing, CaptureStats
from trainer_client.connection import Connection, connection_from_kwargs
from trainer_client.errors import (
    CapacityExceededError,
    InvalidArgumentError,
    NoCheckpointError,
    NotFoundError,
    StoreUnavailableError,
    raise_for_rpc,
)
from trainer_client.floor import FloorAgreement
from trainer_client.handles import RestorePoint, SaveHandle, SaveResult
from trainer_client.job_group import default_job_group, resolve_group
from trainer_client.reading import VERIFY_THREADS, ShardReader
from trainer_client.replica_check import verify_replicas
from trainer_client.replicas import resolve_replica_group
from trainer_client.run_ids import PROCESS_RUN_ID, broadcast_run_id, run_id_given
from trainer_client.save_switches import marked_captures_wanted, trainer_hashing_wanted
from trainer_client.stripes import is_stripe, split_state, stripe_members, stripe_state, whole_state
from trainer_client.transport.local_control_client import LocalStub, RpcFailure
from trainer_client.transport.remote import RemotePath, byte_view, empty_buffer

log = logging.getLogger(__name__)
T = TypeVar("T")

_MAX_BACKGROUND_SENDS = 2  # remote_save="background": staged saves in flight; the next waits for the oldest
MARKED_FROM = 64 << 20  # a CPU state this large is pushed by the store while it is copied (CommitRequest.captured_bytes)


class CheckpointClient:
    """One trainer rank's connection to its host's store.

    Args:
        job_id: the training run, ``[A-Za-z0-9._-]{1,128}``.
        rank: this trainer's rank.
        world_size: the number of ranks of the job.
        connection: how to reach the store on this host (:class:`~trainer_client.connection.Connection`: address,
            timeout, credentials, shared memory); default ``Connection()``: ``MEMSTORE_STORE`` (on Kubernetes the pod
            sets it to ``$(HOST_IP):7070`` from the downward API), else ``127.0.0.1:7070``, credentials from the
            environment, shared memory when the store is on this machine.
        on_capacity: ``"raise"`` (default) raises CapacityExceededError when the store is full;
            ``"skip"`` logs it and returns a handle with ``skipped=True`` so training goes on.
        spill_compression: this job's codec on the durable tier (``none``, ``zstd``, ``zstd-shuffle2`` for
            bf16/fp16, ``zstd-shuffle4`` for fp32); default: the store's ``--spill-compression``.
        run_id: names this start of the job; the same on every rank, new for every start (a restart
            that resumes from a checkpoint is a new start). Default: ``MEMSTORE_RUN_ID``, else rank 0
            draws one and broadcasts it over the default process group at the first save (a collective:
            every rank saves at the same point anyway), else one per process (enough when all ranks
            live in one process, or world_size is 1). Ranks in separate processes with no process group
            must pass it: otherwise their shards never form a restorable step, and ``load()`` says so.
            A job restarted inside the same process (tests, notebooks) must pass a new one: saving a
            step again under a timeline that already holds it raises ``AlreadySavedError``.
        remote_save: without shared memory, ``"sync"`` (default) returns from ``save()`` once the store
            holds verified bytes (crash-safe; the stall includes the transfer), ``"background"`` once the
            state is staged in this process (the stall is one copy; the send runs on a thread, at most two
            in flight, and a crash before it finished loses that save; ``handle.wait()`` reports it).
        replica_group: the ranks that hold the same state as this one (data parallelism): a ``torch.distributed`` process
            group (``dist.group.WORLD`` under DDP, the replicate group under HSDP) or a list of job ranks. Its D members
            then save one logical shard between them: each captures and stores only 1/D of its bytes (a *stripe*), and
            any member, or a rank that replaces one, restores the whole state from the D stripes. Every member must save
            the same state at the same steps; ``save(..., replicated=[keys])`` limits that promise to part of it.
            Default: none, every rank saves its whole state.
        verify_replicas: with a process group as ``replica_group``, every save first checks that the members' states
            agree on a deterministic sample (one all-reduce; ``ReplicaMismatchError`` names the ranks that differ).
        group: the job's process group (rank i of it is the client of rank i). Each save then starts one asynchronous
            all-reduce by which the ranks agree on the newest step all of them saved, and tells the store with the
            commit: retention needs no listing of the cluster (``trainer_client.floor``); ``latest_step()`` and
            ``load()`` agree over it too (``trainer_client.agreement``). Every rank must then call ``save()`` for every
            step, and ``latest_step()`` / ``load()`` at the same point. Default (None): ``torch.distributed``'s default
            group when it is the job's (initialized, ``world_size`` ranks, this process its rank ``rank``), found at the
            first save or restore; else none (``trainer_client.job_group``). ``False``: none (each store's retention
            then lists every store when it evicts, and ``latest_step()`` asks every store: O(hosts) calls).

    Deprecated (for one release, each with a ``DeprecationWarning``): ``store`` (also the fourth positional
    argument), ``timeout``, ``use_shared_memory``, ``auth_token``, ``tls_ca``, ``tls_cert``, ``tls_key``; put them in
    ``connection=`` instead (passing both is a ``TypeError``).
    """

    _floor: FloorAgreement | None = None  # the restorable floor's agreement, with a group (``group``)
    _job_group: Any = None
    _group_found = False

    def __init__(
        self,
        job_id: str,
        rank: int,
        world_size: int,
        store: str | None = None,
        *,
        connection: Connection | None = None,
        on_capacity: str = "raise",
        spill_compression: str | None = None,
        run_id: str | None = None,
        remote_save: str = "sync",
        replica_group: Any = None,
        verify_replicas: bool = False,
        group: Any = None,
        **deprecated: Any,
    ) -> None:
        requested = connection_from_kwargs("CheckpointClient", connection, {"store": store, **deprecated})
        problem = key_problem(job_id, 0, rank, world_size)
        if problem:
            raise InvalidArgumentError(problem)
        self.run_id = run_id_given(run_id)
        self._epoch = 0
        self._last_saved_step: int | None = None
        if spill_compression is not None and spill_compression not in SPILL_CODECS:
            raise InvalidArgumentError(f"spill_compression {spill_compression!r} is invalid: expected one of {', '.join(SPILL_CODECS)}")
        self.spill_compression = spill_compression or ""
        if remote_save not in ("sync", "background"):
            raise InvalidArgumentError(f"remote_save {remote_save!r} is invalid: expected 'sync' or 'background'")
        self.remote_save = remote_save
        if on_capacity not in ("raise", "skip"):
            raise InvalidArgumentError(f"on_capacity {on_capacity!r} is invalid: expected 'raise' or 'skip'")
        self.job_id, self.rank, self.world_size = job_id, rank, world_size
        self.replica_group = resolve_replica_group(replica_group, rank, world_size, verify_replicas)
        self.verify_replicas = verify_replicas
        if group is not None:  # else the default group is looked for at the first save or restore
            self._use_group(resolve_group(group, rank, world_size))
        self.connection = connection = requested.resolved()  # address and credentials filled in from the environment
        assert connection.address is not None and connection.credentials is not None
        self.address, self.credentials, self.timeout = connection.address, connection.credentials, connection.timeout
        timeout = self.timeout
        self.on_capacity = on_capacity
        self._channel, self._stub = store_stub(self.address, self.credentials)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            self._channel.close()
            tls = (
                " (TLS: check that the credentials' CA signed the store's certificate and the store accepts this client's certificate)"
                if self.credentials.tls
                else ""
            )
            where = f"{self.address}{requested.address_source}"
            hint = f"is `memstore serve` running there?{tls}"
            raise StoreUnavailableError(f"store at {where} not reachable within {timeout}s; {hint}") from None
        self.hello = self._call(lambda t: self._stub.Hello(pb.HelloRequest(), timeout=t), "connect to store")
        same_machine = bool(self.hello.shm_dir) and self.hello.boot_id == boot_id() and os.path.isdir(self.hello.shm_dir)
        use_shared_memory = connection.shared_memory
        if use_shared_memory and not same_machine:
            raise InvalidArgumentError(f"store at {self.address} shares no memory with this process (different machine or no --shm-dir)")
        self.shared_memory = same_machine if use_shared_memory is None else use_shared_memory
        # The save path's calls go over the store's Unix socket when this process shares its machine.
        self._local: LocalStub | None = None
        if self.shared_memory and self.hello.control_socket and os.path.exists(self.hello.control_socket):
            local = LocalStub(self.hello.control_socket, self.credentials.token)
            try:
                local.connect(timeout)
                self._local = local
            except OSError as exc:
                log.info("store control socket %s not usable (%s); the save path uses gRPC", self.hello.control_socket, exc)
        # The segments this rank's saves land in, mapped (and registered for DMA) once; the next save's reserved ahead.
        self._ring = CaptureRing(
            lambda request: self._control("Allocate", request, f"allocate memory for rank {rank}'s save"),
            lambda lease_id: self._control("Release", pb.ReleaseRequest(lease_id=lease_id), "release an unused capture lease"),
            lambda request: self._call(lambda t: self._stub.Allocate(request, timeout=t), f"reserve memory for rank {rank}'s next save"),
        )
        self.last_load_source = self.last_restore_note = ""
        self.agreement = Agreements()  # latest_step(group=...): its last cost, its answer, versions found durable
        # Without shared memory: shards travel over the store's data channel, staged in buffers kept here.
        self._remote = RemotePath(self._stub, self.address, self.credentials, timeout, self.hello.data_port)
        self._free_staging: list[torch.Tensor] = []
        self._sends: collections.deque[Future[None]] = collections.deque()
        self._sender: ThreadPoolExecutor | None = None
        self.last_save_path = ""  # how the last remote save travelled: "data channel" or "grpc"
        self._marking = marked_captures_wanted()
        self._hashing = trainer_hashing_wanted()  # a bad MEMSTORE_TRAINER_HASHING is refused here, not at the first save
        self._reader = ShardReader(self._call, self._control, self._stub, self._ring, self._remote, self.shared_memory, self.hello.host_id,
                                   rank, self.agreement)  # fmt: skip
        prepare_bounce_ring(only_if_cuda_in_use=True)  # a trainer on a GPU: its first restore onto it registers nothing

    @functools.cached_property
    def _captures(self) -> Captures:
        return Captures()  # CUDA copies (pinned destinations, side streams), the capture="enqueued" save in flight

    # -- plumbing -----------------------------------------------------------------------
    def _call(self, fn: Callable[[float], T], what: str, retries: int = 0) -> T:
        attempt = 0
        while True:
            try:
                return fn(self.timeout)
            except grpc.RpcError as err:
                if attempt < retries and err.code() == grpc.StatusCode.UNAVAILABLE:
                    attempt += 1
                    time.sleep(min(1.0, 0.1 * 2**attempt))
                    continue
                raise_for_rpc(err, what)

    def _control(self, name: str, request: Any, what: str, retries: int = 0, wait: float = 0.0) -> Any:
        """A save-path call (``Allocate``, ``Commit``, ``Release``, ``WaitCommitted``, ``Open``): over the store's
        Unix socket when there is one, else (or once it is gone) over gRPC; ``wait``: seconds the call may block
        in the store beyond the usual deadline."""
        local = self._local
        if local is not None:
            try:
                return local.call(name, request, timeout=self.timeout + wait)
            except RpcFailure as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE or err.sent:
                    raise_for_rpc(err, what)
                log.warning("store control socket gone (%s); the save path uses gRPC from now on", err.details())
                self._local = None
                local.close()
        method = getattr(self._stub, name)
        return self._call(lambda t: method(request, timeout=t + wait), what, retries)

    def _key(self, step: int, rank: int | None = None, timeline: str = "") -> pb.ShardKey:
        rank = self.rank if rank is None else rank
        problem = key_problem(self.job_id, step, rank, self.world_size, timeline)
        if problem:
            raise InvalidArgumentError(problem)
        return pb.ShardKey(job_id=self.job_id, step=step, rank=rank, timeline=timeline)

    @property
    def timeline(self) -> str:
        """The timeline the next save of a newer step goes to (``<run id>.<epoch>``); "" before the first save."""
        return f"{self.run_id}.{self._epoch}" if self.run_id else ""

    def _epoch_for(self, step: int) -> int:
        """This save's epoch: a step at or below one saved before starts a new one (a rollback).

        Only saves that succeeded count (``_saved``): a rank whose save failed and is retried must stay on
        the timeline of the ranks whose save went through.
        """
        if self.run_id is None:
            self.run_id = broadcast_run_id(self.world_size, self.rank) or PROCESS_RUN_ID
        rollback = self._last_saved_step is not None and step <= self._last_saved_step
        return self._epoch + 1 if rollback else self._epoch

    def _saved(self, step: int, epoch: int) -> None:
        self._epoch, self._last_saved_step = epoch, step
        if self._floor is not None:
            self._floor.saved(step, self.timeline)

    # -- save ---------------------------------------------------------------------------
    def save(
        self, step: int, state: Any, metrics: Mapping[str, float] | None = None, *, timeline: str | None = None, capture: str = "copied",
        replicated: Sequence[str] | None = None,
    ) -> SaveHandle:  # fmt: skip
        """Capture ``state`` for ``step`` into the store's memory; returns once the store owns the bytes.

        ``timeline`` overrides the client's own (``<run id>.<epoch>``), e.g. one id per DCP save chosen by
        the coordinator; every rank of one save must pass the same.

        CUDA tensors are copied straight into the store's (pinned) memory. ``capture="enqueued"`` returns once the
        copies are under way (CUDA ones enqueued, CPU ones on a thread), then commits in the background: **the
        state must not be modified before** ``handle.wait_captured()`` (``gate(optimizer)`` calls it before each
        step), which, like ``wait()``, raises the background part's error. One capture in flight per client.

        With a ``replica_group`` the whole state is the group's (each member saves its stripe), unless ``replicated``
        names the top-level keys that are: the rest is this rank's own (ZeRO-1: ``replicated=["model"]``).
        """
        if capture not in CAPTURE_MODES:
            raise InvalidArgumentError(f"capture {capture!r} is invalid: expected 'copied' or 'enqueued'")
        self._captures.settle()
        if timeline is not None and (not timeline or timeline_problem(timeline)):
            raise InvalidArgumentError(timeline_problem(timeline) or "timeline '' is invalid: expected 1-128 characters of [A-Za-z0-9._-]")
        self._key(step)  # validate before a run id is drawn
        epoch = self._epoch_for(step) if timeline is None else self._epoch
        key = self._key(step, timeline=f"{self.run_id}.{epoch}" if timeline is None else timeline)
        if self.group is not None and self._floor is not None and timeline is None:
            self._floor.start(step, key.timeline)  # the ranks agree on the newest step all of them saved: read at the commit
        clean_metrics = {str(k): float(v) for k, v in (metrics or {}).items()}
        t0 = time.perf_counter()
        layout, stripe = self._plan(state, replicated)
        try:
            if self.shared_memory:
                job = self._save_shared(key, layout, clean_metrics, deferred=capture == "enqueued", started=t0, stripe=stripe)
            else:
                job = self._save_remote(key, layout, clean_metrics, capture, stripe)
            if capture == "copied":
                job.run()
        except CapacityExceededError as exc:
            if self.on_capacity == "skip":
                log.warning("skipping checkpoint of step %d (rank %d): %s", step, self.rank, exc)
                return self._handle(step, key.timeline, skipped_reason=str(exc))
            raise
        if capture == "enqueued":
            job.skip_capacity = self.on_capacity == "skip"
            job.on_success = None if timeline is not None else lambda: self._saved(step, epoch)
            self._captures.start(job)
            handle = self._handle(step, key.timeline, capture=job)
        else:
            if timeline is None:
                self._saved(step, epoch)
            handle = self._handle(step, key.timeline, sending=job.handed_off)
        handle.stall_seconds = time.perf_counter() - t0
        return handle

    def _plan(
        self, state: Any, replicated: Sequence[str] | None, verify: bool = True
    ) -> tuple[serialization.ShardLayout, pb.Stripe | None]:
        """The layout of what this rank saves: its state, or (with a replica group) its stripe of the replicated part
        plus its own part; and the stripe as the store records it. ``verify``: run ``verify_replicas`` if asked for."""
        group = self.replica_group
        if group is None:
            if replicated is not None:
                raise InvalidArgumentError("replicated= names the part of the state its replica group holds alike; no replica_group given")
            return serialization.plan(state), None
        shared, own, order = split_state(state, replicated)
        if self.verify_replicas and verify:
            verify_replicas(shared, group.process_group, group.members, self.rank)
        if group.size == 1 or (replicated is not None and not replicated):
            return serialization.plan(state), None  # nothing to share
        plan = stripe_state(shared, own, order, group.members, group.index)
        stripe = pb.Stripe(group=group.members, index=group.index, logical_nbytes=plan.logical_nbytes, stripe_nbytes=plan.stripe_nbytes)
        return serialization.plan(plan.state), stripe

    def gate(self, optimizer: torch.optim.Optimizer) -> RemovableHandle:
        """Hold each ``optimizer.step()`` until the latest ``capture="enqueued"`` save no longer needs the state.

        Registers a step pre-hook calling that save's ``wait_captured()`` (CUDA copies gate the current
        stream, the host goes on; a failed capture raises its error there, once). Returns the hook's handle.
        """
        return optimizer.register_step_pre_hook(self._captures.gate_hook())

    def _save_shared(
        self, key: pb.ShardKey, layout: serialization.ShardLayout, metrics: dict[str, float], deferred: bool, started: float,
        stripe: pb.Stripe | None = None,
    ) -> Capture:  # fmt: skip
        """Into a segment of this rank's capture ring: the one reserved ahead (no call) or one allocated now.

        ``deferred`` (``capture="enqueued"``): the device copies are enqueued on the capture thread, after events
        recorded now on the trainer's streams. After the commit the ring reserves the next save's segment ahead.
        """
        ring = self._ring
        if not ring.pinning and self._captures.wants_pinning(layout):
            ring.pinning = True  # from now on every ring segment is registered once (this slot below, the rest as used)
        slot = ring.slot(key, self.world_size, layout.nbytes)

        def release() -> None:
            ring.give_back(slot)

        try:
            target = torch.frombuffer(ring.hold(slot).view, dtype=torch.uint8, count=layout.nbytes)  # held until committed or given back
            blobs, start_copies = self._captures.device_copies(layout, target, deferred=deferred)
        except BaseException:
            release()
            raise

        def request(captured: int | None = None) -> pb.CommitRequest:
            r = pb.CommitRequest(
                lease_id=slot.lease_id, metrics=metrics, format_version=serialization.FORMAT_VERSION, spill_codec=self.spill_compression,
                stripe=stripe, restorable_floor=self._floor.floor(key.timeline, key.step) if self._floor else None,
                captured_bytes=captured,
            )  # fmt: skip
            if captured is None:
                r.capture.CopyFrom(ring.report())
                r.capture_seconds = time.perf_counter() - started
                if sums is not None and sums.values is not None:
                    r.chunk_size, r.checksum_algo = sums.chunk_size, CHECKSUM_ALGO
                    r.chunk_checksums.extend(sums.values)
            if slot.ahead:
                r.key.CopyFrom(key)
                r.nbytes = layout.nbytes
            return r

        # A large CPU state on a store that replicates: the store pushes the bytes as they become final (marks).
        marked: list[int] = []
        marking = (
            not blobs and not deferred and layout.nbytes >= MARKED_FROM and self.hello.marked_captures and self.hello.replicas > 1
            and self._marking
        )  # fmt: skip
        # Otherwise, with MEMSTORE_TRAINER_HASHING=on, a state copied by this process alone is hashed chunk by chunk as
        # it is copied, with the store's chunk size: the store never reads it back to hash it (CommitRequest.chunk_checksums).
        hashing = self._hashing and not blobs and not marking and self.hello.max_chunk_bytes > 0
        sums = serialization.ChunkSums(self.hello.max_chunk_bytes) if hashing else None

        def mark(captured: int) -> None:
            self._control("Commit", request(captured), f"commit step {key.step} (its first {captured} bytes)")
            marked.append(captured)  # the store holds the lease's shard from the first mark on

        def commit() -> None:
            try:
                self._control("Commit", request(), f"commit step {key.step}")
            finally:
                ring.committed(slot)  # taken in, or refused (the lease then expires in the store)
            ring.reserve_ahead(key, self.world_size, layout.nbytes)

        def abort() -> None:
            if marked:  # the store took the shard in at the first mark: it drops it once no more marks come
                ring.committed(slot)
            else:
                release()

        return Capture(start_copies, host_writer(layout, blobs, slot.mm, mark=mark if marking else None, sums=sums), commit, abort)

    def prepare(self, state_or_nbytes: Any, *, replicated: Sequence[str] | None = None) -> None:
        """Make the next save fast from the first one: reserve its memory in the store now, map it, and (for a state
        with CUDA tensors) register it for DMA. ``state_or_nbytes``: the state the next save will hold (or one like
        it; with a replica group, this rank's stripe of it is what is reserved: pass ``replicated`` as to ``save``) or
        the bytes this rank's save will take. Without shared memory this makes the staging buffer (registered likewise).

        Later saves need no call: after each commit the next save's memory is reserved ahead in the background.
        """
        if isinstance(state_or_nbytes, int) and not isinstance(state_or_nbytes, bool):
            if state_or_nbytes <= 0:
                raise InvalidArgumentError(f"prepare({state_or_nbytes}): expected a state or a positive number of bytes")
            nbytes, pin = state_or_nbytes, _cuda.runtime().pins_host_states
        else:
            layout, _ = self._plan(state_or_nbytes, replicated, verify=False)
            nbytes, pin = layout.nbytes, self._captures.wants_pinning(layout)
        if not self.shared_memory:
            buf, _ = self._staging_buffer(nbytes)
            if pin:
                self._captures.copier.pin_buffer(buf)
            self._free_staging.append(buf)
            return
        if pin:
            self._ring.pinning = True
            self._ring.pin_all()
        self._ring.prepare(self._key(0), self.world_size, nbytes)

    @property
    def group(self) -> Any:
        """The process group this client agrees over (None: none); see ``group=`` in the class doc."""
        if not self._group_found:
            self._use_group(default_job_group(self.rank, self.world_size))
        return self._job_group

    def _use_group(self, group: Any) -> None:
        self._group_found, self._job_group = True, group
        if group is not None:
            self._floor = FloorAgreement(group, self.rank, self.world_size, self._status)

    def _group_for(self, group: Any, rank: int | None = None) -> Any:
        """The group a restore agrees over, for its ``group=``: None -> the client's (unless it reads another rank's
        shard: that is no collective), False -> none, a group -> that one."""
        if group is None:
            return self.group if rank is None or rank == self.rank else None
        return resolve_group(group, self.rank, self.world_size)

    @property
    def capture_stats(self) -> CaptureStats:
        """What this client's captures cost: registrations made (none after warm-up), fallbacks to pageable memory."""
        return self._captures.stats(self._ring.stats)

    def _save_remote(
        self, key: pb.ShardKey, layout: serialization.ShardLayout, metrics: dict[str, float], capture: str, stripe: pb.Stripe | None = None
    ) -> Capture:
        """Without shared memory: stage the shard in this process, then send it over the store's data channel.

        ``remote_save="sync"``: returns once the store holds verified bytes (crash-safe, the stall includes
        the transfer). ``"background"``: returns after the staging copy; the send runs on a thread and the
        save's handle reports it (a crash of this process before it finished loses the save). With
        ``capture="enqueued"`` the capture thread sends once the copies are done. The staging buffer is
        registered for CUDA copies like a segment (it is kept between saves too).
        """
        buf, fresh = self._staging_buffer(layout.nbytes)
        view = byte_view(buf, layout.nbytes)
        if self._captures.wants_pinning(layout):
            self._captures.copier.pin_buffer(buf)
        blobs, start_copies = self._captures.device_copies(layout, buf, deferred=capture == "enqueued")
        chunk = min(DEFAULT_CHUNK_BYTES, self.hello.max_chunk_bytes or DEFAULT_CHUNK_BYTES)
        # A send that follows the copy on the same thread (finish() below) has the copy hash each chunk from cache
        # instead of reading the shard back first; a background send keeps the stall a copy and hashes on its thread.
        inline = self.remote_save == "sync" or capture == "enqueued"
        sums = serialization.ChunkSums(chunk) if inline else None
        created = time.time()

        def send() -> None:
            done = sums.values if sums is not None else None
            checksums = done if done is not None else compute_checksums(view, layout.nbytes, chunk, workers=VERIFY_THREADS)
            manifest = pb.Manifest(
                key=key,
                world_size=self.world_size,
                nbytes=layout.nbytes,
                chunk_size=chunk,
                chunk_checksums=checksums,
                checksum_algo=CHECKSUM_ALGO,
                format_version=serialization.FORMAT_VERSION,
                metrics=metrics,
                created_unix=created,
                spill_codec=self.spill_compression,
                stripe=stripe,
            )
            header = pb.PutHeader(
                manifest=manifest, origin=pb.PUT_ORIGIN_CLIENT, sender_host=f"client-rank-{self.rank}",
                restorable_floor=self._floor.floor(key.timeline, key.step) if self._floor else None,
            )  # fmt: skip
            try:
                self.last_save_path = self._remote.put(header, view, f"put step {key.step}")
            finally:
                self._free_staging.append(buf)

        def finish() -> Future[None] | None:
            if inline:
                send()
                return None
            if self._sender is None:
                self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memstore-send")
            future = self._sender.submit(send)
            self._sends.append(future)
            return future

        writer = host_writer(layout, blobs, view, fault_ahead=fresh, sums=sums)
        return Capture(start_copies, writer, finish, lambda: self._free_staging.append(buf))

    def _staging_buffer(self, nbytes: int) -> tuple[torch.Tensor, bool]:
        """A free staging buffer of at least ``nbytes`` (kept between saves: its pages are faulted in once), and
        whether it is new. With background sends, at most two are in flight; a third save waits for the oldest."""
        while self._sends and (self._sends[0].done() or len(self._sends) >= _MAX_BACKGROUND_SENDS):
            self._sends.popleft().exception()  # waits; its handle reports the outcome
        for i, buf in enumerate(self._free_staging):
            if buf.numel() >= nbytes:
                return self._free_staging.pop(i), False
        self._captures.unpin(*self._free_staging)
        self._free_staging.clear()  # too small for this state: let them go
        return empty_buffer(nbytes), True

    def save_status(self, step: int, timeline: str, wait: float = 0.0) -> tuple[SaveResult, bool]:
        """How this rank's save of ``step`` in ``timeline`` stands in its store: (its status, whether it settled), after
        waiting up to ``wait`` seconds for it to settle (committed, failed or superseded). What a :class:`SaveHandle`
        asks; ``handle.wait()`` and ``handle.done()`` are the usual way to use it."""
        return self._status(step, timeline, wait, None)

    def _status(self, step: int, timeline: str, wait: float, floor: int | None) -> tuple[SaveResult, bool]:
        """``save_status``, telling the store the job's restorable ``floor`` too (the floor agreement's watcher)."""
        key = self._key(step, timeline=timeline)
        request = pb.WaitCommittedRequest(key=key, timeout_seconds=wait, restorable_floor=floor)
        resp = self._control("WaitCommitted", request, f"status of step {step}", retries=3, wait=wait)
        result = SaveResult.from_wire(resp.info, step, self.rank, timeline)
        if self._floor is not None and resp.done:
            self._floor.observed(step, timeline, result)  # the next save's agreement knows it at once
        return result, resp.done

    def _handle(self, step: int, timeline: str, **kwargs: Any) -> SaveHandle:
        return SaveHandle(step, timeline, self.rank, functools.partial(self.save_status, step, timeline), **kwargs)

    # -- restore ------------------------------------------------------------------------
    def latest_step(self, group: Any = None) -> int | None:
        """Newest step restorable for every rank of the job, or None if there is none.

        ``group``: the job's ``torch.distributed`` process group (rank i of it is the client of rank i); default: the
        client's (``group=`` in the class doc: the job's default group when there is one); ``False``: none. With a
        group this is a collective (every rank calls it at the same point) that costs each rank one call to its own
        store, which asks only its placement group, plus a few small all-reduces: O(replicas) calls per rank
        instead of O(hosts) (``memstore.core.agreement``). Without a group every call asks every store.
        """
        agreed_over = self._group_for(group)
        point = self._restore_point(step=None, agreed_over=agreed_over)
        self.agreement.point = point if agreed_over is not None else None
        if point is not None and point.world_size != self.world_size:
            raise InvalidArgumentError(
                f"step {point.step} of job {self.job_id} was saved by {point.world_size} ranks but this client has world_size "
                f"{self.world_size}; resharding needs trainer_client.dcp"
            )
        return None if point is None else point.step

    def restore_point(self, step: int | None = None, group: Any = None) -> RestorePoint | None:
        """The version to restore: of the newest restorable step, or of exactly ``step``; None if there is none.

        Every rank's shard of the returned (step, timeline) is verified somewhere; shards of other saves
        of that step are never part of it. ``group``: agree over the job's process group (see ``latest_step``).
        """
        return self._restore_point(step, self._group_for(group))

    def _restore_point(self, step: int | None, agreed_over: Any) -> RestorePoint | None:
        """``restore_point`` with its group resolved (``_group_for``): agreed over it, or the cluster-wide answer (None)."""
        problem = job_id_problem(self.job_id) or (None if step is None else key_problem(self.job_id, step, 0))
        if problem:
            raise InvalidArgumentError(problem)
        if agreed_over is not None:
            return self._agreed_point(step, agreed_over)
        return self._cluster_point(step)

    def _agreed_point(self, step: int | None, group: Any) -> RestorePoint | None:
        self.agreement.stats = stats = AgreementStats()

        def ask_local() -> LocalAnswer:
            request = pb.LatestStepRequest(job_id=self.job_id, ranks=[self.rank], include_durable=self.rank == 0)
            stats.rpcs += 1
            resp = self._call(lambda t: self._stub.LatestStep(request, timeout=t), "latest_step", retries=3)
            seen = [Seen(v.step, v.timeline, v.world_size, v.created_unix, tuple(v.ranks), v.durable) for v in resp.versions]
            return seen, not resp.unreachable_hosts

        def ask_cluster() -> ClusterAnswer:
            stats.rpcs += 1
            point, unreachable = self._cluster_answer(step)
            return (None if point is None else Seen(point.step, point.timeline, point.world_size, 0.0)), not unreachable

        agreed = agree(group, self.rank, self.world_size, step, ask_local, ask_cluster, stats)
        if agreed is None:
            self.last_restore_note = self.last_restore_note if stats.fallback else ""
            return None
        self.last_restore_note = ""
        if agreed.durable:
            self.agreement.durable.add((agreed.step, agreed.timeline))
        return RestorePoint(agreed.step, agreed.world_size, agreed.timeline)

    def _cluster_point(self, step: int | None) -> RestorePoint | None:
        return self._cluster_answer(step)[0]

    def _cluster_answer(self, step: int | None) -> tuple[RestorePoint | None, list[str]]:
        """The cluster-wide LatestStep: its version, and the stores that did not answer it."""
        request = pb.LatestStepRequest(job_id=self.job_id, step=step)
        try:
            resp = self._call(lambda t: self._stub.LatestStep(request, timeout=t), "latest_step", retries=3)
        except NotFoundError as exc:  # the job is unknown to every store
            self.last_restore_note = str(exc)
            return None, []
        unreachable = list(resp.unreachable_hosts)
        if not resp.found:
            if resp.note:
                log.warning("job %s has no restorable step: %s", self.job_id, resp.note)
            self.last_restore_note = resp.note
            return None, unreachable
        self.last_restore_note = ""
        return RestorePoint(int(resp.step), int(resp.world_size), resp.timeline), unreachable

    def load(
        self, step: int | None = None, *, rank: int | None = None, zero_copy: bool = True, timeline: str | None = None,
        map_location: str | torch.device | None = None, group: Any = None,
    ) -> Any:  # fmt: skip
        """Restore this rank's state at ``step`` (default: the latest restorable step); bytes verified first.

        The shard comes from the step's restorable version (``restore_point``), or from ``timeline`` when
        given. ``rank`` reads another rank's shard of the same step instead (resharding readers need it).
        With shared memory and ``zero_copy`` (the default), large tensors are copy-on-write views of the
        store's segment: no copy, no fresh page faults. Pass ``zero_copy=False`` for tensors with
        memory of their own.

        ``map_location``: None / ``"cpu"`` (CPU tensors, as above) or a device (``"cuda:0"``, ``"cuda"``, a
        ``torch.device``) every tensor lands on, copied out of the shard's memory before returning: straight
        from this rank's registered capture ring when the shard is one this client saved, else through a small
        registered bounce ring (nothing is registered per load); numpy arrays are copies then (``zero_copy`` is
        ignored), so the segment stays in the ring.

        ``group``: the job's process group (default: the client's, see ``latest_step``; ``False``: none; no default when
        ``rank`` is another rank's); without ``timeline`` the version is then agreed over it (a collective), and a
        ``load(step)`` right after ``latest_step()`` returned ``step`` reuses that answer.
        """
        device = parse_map_location(map_location)
        if device is not None and device.type == "cuda":
            prepare_bounce_ring()  # registered while the version is agreed and the store opens the shard (once per process)
        if timeline is None or step is None:
            agreed_over = self._group_for(group, rank)
            agreed, self.agreement.point = self.agreement.point, None
            reuse = agreed_over is not None and agreed is not None and agreed.step == step
            point = agreed if reuse else self._restore_point(step, agreed_over)
            if point is None:
                note = f": {self.last_restore_note}" if self.last_restore_note else ""
                if step is None:
                    raise NoCheckpointError(
                        f"job {self.job_id!r} has no restorable step: no step has a verified copy of one save for all "
                        f"{self.world_size} ranks{note}"
                    )
                raise NotFoundError(
                    f"step {step} of job {self.job_id!r} is not restorable: no save of it has a verified copy of every rank{note}"
                )
            step, timeline = point.step, point.timeline
        key = self._key(step, rank, timeline)
        others: dict[int, Future[Any]] = {}
        pools: list[ThreadPoolExecutor] = []  # made only for a stripe to fetch: an ordinary load starts no thread

        opened: dict[int, Any] = {}  # other stripes the store opened with this rank's (shared memory: one call)

        def fetch_others(group: list[int]) -> None:  # a stripe: its group's other stripes are fetched meanwhile
            for r in group:
                if r != key.rank and r not in others and r not in opened:
                    if not pools:
                        pools.append(ThreadPoolExecutor(max_workers=8, thread_name_prefix="memstore-stripes"))
                    others[r] = pools[0].submit(self._reader.read_stripe, self._key(key.step, r, key.timeline))

        try:
            state = self._reader.fetch_and_read(key, zero_copy, device, fetch_others, on_source=self._loaded_from, stripes=opened)
            if not is_stripe(state):
                return state
            fetch_others(stripe_members(state))  # not held here, or a store that did not name the group in the manifest
            stripes = {**opened, **{r: f.result() for r, f in others.items()}}
        finally:
            for pool in pools:
                pool.shutdown(wait=True)
        return whole_state(key.rank, key.step, state, stripes, device, zero_copy)

    def _loaded_from(self, source: str) -> None:
        self.last_load_source = source

    def close(self) -> None:
        if self._floor is not None:
            self._floor.close()
        self._captures.close()  # an enqueued capture in flight is finished, then every registration undone
        self._ring.close()  # the lease reserved ahead is given back; ring segments unregistered and unmapped
        if self._sender is not None:
            self._sender.shutdown(wait=True)  # a background save in flight is finished, not dropped
            self._sender = None
        if self._local is not None:
            self._local.close()
            self._local = None
        self._channel.close()

    def __enter__(self) -> CheckpointClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
