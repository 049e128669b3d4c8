"""``CheckpointClient``: save a rank's state into the host's store and restore it; a facade over its collaborators.

- its **connection** (``transport.link``), made by the constructor's one step with I/O: the gRPC channel, the store's
  ``Hello``, its Unix control socket;
- its **save path** (``transport.save_path.SavePath``), picked by that step: ``SharedMemoryPath`` when the store shares
  this machine's memory (the state is copied straight into the store's segment and committed: the stall is that copy,
  and a trainer crash afterwards loses nothing), else ``RemotePath`` (staged here, hashed, sent over the data channel);
  checksums and replication happen in the store, in the background;
- its **restorer** (``trainer_client.restoring``): which version to read, then the verified read (never unpickled);
- the restorable floor's agreement (``trainer_client.floor``) and the replica group's stripes (``trainer_client.stripes``).

``save()`` reads: validate, plan (the shard's layout and device part; a replica group's stripe), ``path.capture(shard)``,
the handle.

Timelines: every shard is saved under the timeline of the save that produced it, and a step restores only from shards
of one timeline, so a restore never mixes two saves of a step. A client's timeline is ``<run id>.<epoch>``: the run id
is the same on every rank of one start of the job (``run_id=``, ``MEMSTORE_RUN_ID``, or drawn by rank 0 and broadcast
over the default process group at the first save), and the epoch goes up whenever the client saves a step at or below
one it saved before (a rollback), which every rank of an SPMD job does at the same point.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from memstore.v1 import store_pb2 as pb
from memstore.v1.integrity import SPILL_CODECS
from memstore.v1.keys import timeline_problem
from trainer_client import knobs, serialization
from trainer_client.agreement import Agreements
from trainer_client.capture import cuda as _cuda
from trainer_client.capture.device_restore import prepare_bounce_ring
from trainer_client.capture.device_save import CAPTURE_MODES, Captures
from trainer_client.capture.ring import CaptureRing, CaptureStats
from trainer_client.connection import Connection, connection_from_kwargs
from trainer_client.errors import CapacityExceededError, InvalidArgumentError
from trainer_client.floor import ALLOCATE_WAIT_SECONDS, FloorAgreement
from trainer_client.handles import ClientStats, RestorePoint, SaveHandle, SaveResult
from trainer_client.job_group import default_job_group, resolve_group
from trainer_client.reading import ShardReader
from trainer_client.replica_check import verify_replicas
from trainer_client.replicas import resolve_replica_group
from trainer_client.restoring import Restorer
from trainer_client.run_ids import Timeline
from trainer_client.stripes import split_state, stripe_state
from trainer_client.transport import messages
from trainer_client.transport.link import connect
from trainer_client.transport.remote_path import RemotePath
from trainer_client.transport.save_path import PlannedShard, SavePath
from trainer_client.transport.shared_memory_path import SharedMemoryPath

log = logging.getLogger(__name__)


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

    The constructor checks every option, then connects (the one step that does I/O): the store must be reachable.
    ``connection`` is then the connection as resolved; :meth:`stats` says which path the client took and what its
    last calls did.
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
        messages.shard_key(job_id, 0, rank, world_size)  # a bad job id, rank or world size is refused here
        self._timeline = Timeline(knobs.run_id(run_id), world_size, rank)
        if spill_compression is not None and spill_compression not in SPILL_CODECS:
            raise InvalidArgumentError(f"spill_compression {spill_compression!r} is invalid: expected one of {', '.join(SPILL_CODECS)}")
        self.spill_compression = spill_compression or ""
        if remote_save not in ("sync", "background"):
            raise InvalidArgumentError(f"remote_save {remote_save!r} is invalid: expected 'sync' or 'background'")
        self.remote_save = remote_save
        if on_capacity not in ("raise", "skip"):
            raise InvalidArgumentError(f"on_capacity {on_capacity!r} is invalid: expected 'raise' or 'skip'")
        self.on_capacity = on_capacity
        self.job_id, self.rank, self.world_size = job_id, rank, world_size
        self.replica_group = resolve_replica_group(replica_group, rank, world_size, verify_replicas)
        self.verify_replicas = verify_replicas
        if group is not None:  # else the default group is looked for at the first save or restore
            self._use_group(resolve_group(group, rank, world_size))
        self._marking, self._hashing = knobs.marked_captures(), knobs.trainer_hashing()  # a bad value is refused here
        self._captures = Captures()  # CUDA copies (pinned destinations, side streams), the capture="enqueued" save in flight
        self.connection = requested
        self._connect(requested)

    def _connect(self, requested: Connection) -> None:
        """The constructor's one step with I/O: dial the store, ask its Hello, open its control socket
        (``transport.link.connect``); then the save path the store allows and the restorer."""
        self._link = link = connect(requested)
        self.connection = link.connection  # address and credentials filled in from the environment
        self._path: SavePath
        self._ring: CaptureRing | None = None
        if link.shared_memory:
            path = SharedMemoryPath(link, self._captures, self.rank, self.world_size, self.spill_compression, self._marking, self._hashing)
            self._path, self._ring = path, path.ring
        else:
            self._path = RemotePath(link, self._captures, self.world_size, self.spill_compression, self.remote_save == "background")
        self._agreement = Agreements()  # latest_step(group=...): its last cost, its answer, versions found durable
        reader = ShardReader(link, self._ring, self.rank, self._agreement)
        self._restorer = Restorer(self.job_id, self.rank, self.world_size, link, reader, self._agreement)
        prepare_bounce_ring(only_if_cuda_in_use=True)  # a trainer on a GPU: its first restore onto it registers nothing

    def _key(self, step: int, rank: int | None = None, timeline: str = "") -> pb.ShardKey:
        return messages.shard_key(self.job_id, step, self.rank if rank is None else rank, self.world_size, timeline)

    @property
    def run_id(self) -> str | None:
        """This start of the job's run id (``run_id=``, ``MEMSTORE_RUN_ID``, else drawn at the first save)."""
        return self._timeline.run_id

    @property
    def timeline(self) -> str:
        """The timeline the next save of a newer step goes to (``<run id>.<epoch>``); "" before the first save."""
        return self._timeline.name

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
            self._timeline.listener = self._floor.saved

    def _group_for(self, group: Any, rank: int | None = None) -> Any:
        """The group a restore agrees over, for its ``group=``: None -> the client's (unless it reads another rank's
        shard: that is no collective), False -> none, a group -> that one."""
        if group is None:
            return self.group if rank is None or rank == self.rank else None
        return resolve_group(group, self.rank, self.world_size)

    # -- save ---------------------------------------------------------------------------
    def save(
        self, step: int, state: Any, metrics: Mapping[str, float] | None = None, *, timeline: str | None = None, capture: str = "copied",
        replicated: Sequence[str] | None = None, restorable_floor: tuple[int, str] | None = None,
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

        ``restorable_floor``: (step, timeline) of a version every rank of the job is known to have saved, agreed
        elsewhere (the DCP writer's plan, ``trainer_client.dcp.floors``): the commit tells the store, instead of this
        client's own agreement, so that its retention needs no listing of the cluster. For integrations that save on
        a ``timeline`` of their own; ``None`` (default): the client's floor, if it has a group.
        """
        if capture not in CAPTURE_MODES:
            raise InvalidArgumentError(f"capture {capture!r} is invalid: expected 'copied' or 'enqueued'")
        if self._captures.in_flight is not None:
            self._captures.settle()  # the enqueued save before: its outcome decides this one's epoch
        if timeline is not None and (not timeline or timeline_problem(timeline)):
            raise InvalidArgumentError(timeline_problem(timeline) or "timeline '' is invalid: expected 1-128 characters of [A-Za-z0-9._-]")
        if timeline is None and self._timeline.run_id is None:
            self._key(step)  # validated before a run id is drawn (a collective); the key below checks it otherwise
        epoch = self._timeline.epoch_for(step) if timeline is None else self._timeline.epoch
        key = self._key(step, timeline=f"{self._timeline.run_id}.{epoch}" if timeline is None else timeline)
        if self.group is not None and self._floor is not None and timeline is None:
            self._floor.start(step, key.timeline)  # the ranks agree on the newest step all of them saved: read at the commit
        t0 = time.perf_counter()
        layout, stripe = self._plan(state, replicated)
        shard = PlannedShard(
            key, layout, _cuda.device_part(layout), {str(k): float(v) for k, v in (metrics or {}).items()}, stripe,
            enqueued=capture == "enqueued", started=t0,
            floor=self._floor_reading(key, restorable_floor),
            allocate_floor=self._floor_reading(key, restorable_floor, wait=ALLOCATE_WAIT_SECONDS),
            on_success=None if timeline is not None else functools.partial(self._timeline.saved, step, epoch),
            skip_capacity=self.on_capacity == "skip",
        )  # fmt: skip
        try:
            job = self._path.capture(shard)
        except CapacityExceededError as exc:
            if self.on_capacity == "skip":
                log.warning("skipping checkpoint of step %d (rank %d): %s", step, self.rank, exc)
                return self._handle(step, key.timeline, skipped_reason=str(exc))
            raise
        if shard.enqueued:
            handle = self._handle(step, key.timeline, capture=job)
        else:
            handle = self._handle(step, key.timeline, sending=job.handed_off)
        handle.stall_seconds = time.perf_counter() - t0
        return handle

    def _floor_reading(
        self, key: pb.ShardKey, given: tuple[int, str] | None, wait: float = 0.0
    ) -> Callable[[], tuple[int, str] | None] | None:
        """What the save of ``key`` reads as its floor when it hands the shard over (``PlannedShard.floor``): ``given``,
        else the newest floor this client's agreement has for the save's timeline; None: no floor. ``wait``: first wait
        that long at most for this save's all-reduce (``PlannedShard.allocate_floor``)."""
        if given is not None:
            step, timeline = given
            if not isinstance(step, int) or step < 0 or timeline_problem(timeline) or (timeline == key.timeline and step > key.step):
                raise InvalidArgumentError(f"restorable_floor {given!r:.200} is invalid: expected (step, timeline) of an earlier save")
            floor = (step, "" if timeline == key.timeline else timeline)
            return lambda: floor
        agreement = self._floor
        if agreement is None:
            return None

        def agreed() -> tuple[int, str] | None:
            step = agreement.agreed(key.timeline, key.step, wait) if wait else agreement.floor(key.timeline, key.step)
            return None if step is None else (step, "")

        return agreed

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
        return serialization.plan(plan.state), messages.stripe(
            group.members, group.index, plan.logical_nbytes, plan.stripe_nbytes, plan.slices_only
        )

    def gate(self, optimizer: torch.optim.Optimizer) -> RemovableHandle:
        """Hold each ``optimizer.step()`` until the latest ``capture="enqueued"`` save no longer needs the state.

        Registers a step pre-hook calling that save's ``wait_captured()`` (CUDA copies gate the current
        stream, the host goes on; a failed capture raises its error there, once). Returns the hook's handle.
        """
        return optimizer.register_step_pre_hook(self._captures.gate_hook())

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
            nbytes, pin = layout.nbytes, _cuda.device_part(layout).pin
        self._path.prepare(self._key(0), nbytes, pin)

    def save_status(self, step: int, timeline: str, wait: float = 0.0) -> tuple[SaveResult, bool]:
        """How this rank's save of ``step`` in ``timeline`` stands in its store: (its status, whether it settled), after
        waiting up to ``wait`` seconds for it to settle (committed, failed or superseded). What a :class:`SaveHandle`
        asks; ``handle.wait()`` and ``handle.done()`` are the usual way to use it."""
        return self._status(step, timeline, wait, None)

    def _status(self, step: int, timeline: str, wait: float, floor: int | None) -> tuple[SaveResult, bool]:
        """``save_status``, telling the store the job's restorable ``floor`` too (the floor agreement's watcher)."""
        key = self._key(step, timeline=timeline)
        request = pb.WaitCommittedRequest(key=key, timeout_seconds=wait, restorable_floor=floor)
        resp = self._link.control("WaitCommitted", request, f"status of step {step}", retries=3, wait=wait)
        result = SaveResult.from_wire(resp.info, step, self.rank, timeline)
        if self._floor is not None and resp.done:
            self._floor.observed(step, timeline, result)  # the next save's agreement knows it at once
        return result, resp.done

    def _handle(self, step: int, timeline: str, **kwargs: Any) -> SaveHandle:
        return SaveHandle(step, timeline, self.rank, functools.partial(self.save_status, step, timeline), **kwargs)

    def stats(self) -> ClientStats:
        """A snapshot of which path this client took and what its last calls did: its store's host id, shared memory or
        not, the control socket, capture registrations and fallbacks, the last save's route, the last load's source,
        why the last lookup found nothing, the last agreement's cost (:class:`~trainer_client.handles.ClientStats`)."""
        link, restorer = self._link, self._restorer
        return ClientStats(
            store_host=link.hello.host_id, shared_memory=link.shared_memory, control_socket=link.local is not None,
            capture=self._captures.stats(self._ring.stats if self._ring is not None else CaptureStats()),
            last_save_route=self._path.last_route, last_load_source=restorer.last_load_source,
            last_restore_note=restorer.last_restore_note, agreement=dataclasses.replace(self._agreement.stats),
        )  # fmt: skip

    # -- restore (trainer_client.restoring) ---------------------------------------------
    def latest_step(self, group: Any = None) -> int | None:
        """Newest step restorable for every rank of the job, or None if there is none.

        ``group``: the job's ``torch.distributed`` process group (rank i of it is the client of rank i); default: the
        client's (``group=`` in the class doc: the job's default group when there is one); ``False``: none. With a
        group this is a collective (every rank calls it at the same point) that costs each rank one call to its own
        store, which asks only its placement group, plus a few small all-reduces: O(replicas) calls per rank
        instead of O(hosts) (``memstore.core.agreement``). Without a group every call asks every store.
        """
        return self._restorer.latest_step(self._group_for(group))

    def restore_point(self, step: int | None = None, group: Any = None) -> RestorePoint | None:
        """The version to restore: of the newest restorable step, or of exactly ``step``; None if there is none.

        Every rank's shard of the returned (step, timeline) is verified somewhere; shards of other saves
        of that step are never part of it. ``group``: agree over the job's process group (see ``latest_step``).
        """
        return self._restorer.restore_point(step, self._group_for(group))

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
        ``load(step)`` right after ``latest_step()`` returned ``step`` reuses that answer. ``stats().last_load_source``
        then names the host the copy came from.
        """
        return self._restorer.load(step, rank, zero_copy, timeline, map_location, lambda: self._group_for(group, rank))

    def close(self) -> None:
        if self._floor is not None:
            self._floor.close()
        self._captures.close()  # an enqueued capture in flight is finished, then every registration undone
        self._path.close()  # the lease reserved ahead given back, the ring unmapped; a background send finished
        self._link.close()

    def __enter__(self) -> CheckpointClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
