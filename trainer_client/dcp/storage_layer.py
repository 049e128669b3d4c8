"""``torch.distributed.checkpoint`` (DCP) storage layer backed by memstore.

``MemStoreWriter`` / ``MemStoreReader`` plug memstore under ``dcp.save``, ``dcp.async_save`` (thread
and process mode) and ``dcp.load``, so DCP's planners handle DTensor / ShardedTensor sharding and
resharding (save with N ranks, load with M) while the bytes live in the stores' RAM::

    import torch.distributed.checkpoint as dcp
    from trainer_client.dcp import MemStoreReader, MemStoreWriter

    dcp.save(state_dict, storage_writer=MemStoreWriter("run-7", step, store=addr))
    dcp.load(state_dict, storage_reader=MemStoreReader("run-7", store=addr))  # newest complete step

Layout: each saving rank ``r`` stores ONE memstore shard ``(job, step, r)`` under the save's timeline, a plain dict::

    {"format": "memstore-dcp", "version": 1, "step": step, "rank": r, "world_size": W, "timeline": T,
     "items": {<item key>: tensor | bytes, ...},
     "metadata": <tagged plain dicts>}          # rank 0 (the DCP coordinator) only

Tensors are stored as tensors (bit-exact); DCP's byte items (non-tensor values, which DCP's planner
serializes with ``torch.save``) as ``bytes``. The item key is a stable string of the item's
``MetadataIndex`` and each ``WriteResult.storage_data`` is a :class:`MemStoreStorageInfo`
``(rank, key)``, so any reader finds any item whatever its own rank and world size.

World size and rank come from the process group DCP saves with (like ``FileSystemWriter``'s
``_StoragePrefix``): in ``prepare_global_plan`` the coordinator puts a :class:`MemStoreSavePlanInfo`
``(job, step, world_size=len(plans), rank=i, timeline)`` into each rank's ``SavePlan.storage_data`` and
``write_data`` takes them from there, so ``dcp.save(..., process_group=<a subgroup>)`` saves with the
subgroup's size and ranks.

Every save is a timeline of its own (``"dcp-<ns>-<random>"``, picked by the coordinator): the store
addresses shards by (job, step, rank, timeline) and a version of a step is restorable only when every
rank holds a shard of that one timeline. The reader resolves ``(step, world_size, timeline)`` once
(``CheckpointClient.restore_point``) and reads every rank's shard of exactly that timeline, so a
re-save of a step that did not finish never mixes with the complete version before it.

The global ``Metadata`` is never pickled: :func:`encode_metadata` turns the dataclass tree into tagged
plain dicts (an explicit allowlist of types; anything else raises ``SerializationError``) and
:func:`decode_metadata` rebuilds it, constructing only allowlisted classes.

Only a complete save is ever visible: non-coordinator ranks save their shard in ``write_data``, but
the coordinator stages its items there and saves them, together with the metadata, in ``finish()``,
which DCP calls only after every rank's ``write_data`` succeeded. Until then the save's timeline lacks
rank 0's shard, so ``restore_point`` does not report it (the previous complete version of the step, if
any, stays the one read) and a reader of a step with no complete version fails with ``NotFoundError``.
With ``wait_for_replication=True`` (the default) every rank also waits until its shard has its R
verified copies, so ``dcp.save`` returns (and ``async_save``'s future completes) only once the whole
step survives the loss of a host.

Bytes read back are never unpickled by this module; DCP's load planner decodes its own byte items
(``torch.load``) exactly as it does with ``FileSystemReader``.

This module holds the two storage classes; the rest of the package is in modules by job (the package,
:mod:`trainer_client.dcp`, re-exports their public names): :mod:`trainer_client.dcp.plans` (checkpoint ids, the plan
infos, timelines), :mod:`trainer_client.dcp.shard` (the shard's layout, the items a save plan writes and a load plan
reads) and :mod:`trainer_client.dcp.metadata` (``Metadata`` to tagged plain dicts and back).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid
import warnings
from collections.abc import Mapping
from typing import Any, cast

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from memstore.v1.keys import job_id_problem, key_problem
from trainer_client.agreement import AgreementStats
from trainer_client.client import CheckpointClient
from trainer_client.connection import Connection, connection_from_kwargs
from trainer_client.dcp.floors import agree_floor, remember_committed, save_history
from trainer_client.dcp.metadata import MemStoreStorageInfo, decode_metadata, encode_metadata, item_key
from trainer_client.dcp.plans import (
    MemStoreLoadPlanInfo,
    MemStoreSavePlanInfo,
    checked_plan_info,
    checkpoint_uri,
    dcp_version,
    new_timeline,
    parse_checkpoint_id,
    valid_checkpoint_id,
)
from trainer_client.dcp.plans import parse_step as _parse_step
from trainer_client.dcp.shard import (
    COORDINATOR_RANK,
    checked_shard,
    items_by_rank,
    new_shard,
    planned_save,
    read_items,
    storage_data_of,
    write_items,
)
from trainer_client.errors import (
    CheckpointExistsError,
    CorruptShardError,
    InvalidArgumentError,
    MemstoreClientError,
    NoCheckpointError,
    NotFoundError,
)
from trainer_client.handles import RestorePoint, SaveHandle, SaveResult
from trainer_client.warmup import prepare_once

log = logging.getLogger(__name__)

__all__ = ["MemStoreReader", "MemStoreWriter"]  # the package, trainer_client.dcp, re-exports its modules' public names


def _rank_and_size(group: Any) -> tuple[int, int]:
    """This process's rank in ``group`` (None: the default group) and its size; (0, 1) without torch.distributed."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


class MemStoreWriter(StorageWriter):
    """DCP ``StorageWriter`` saving each rank's items as one memstore shard ``(job_id, step, rank)`` of a per-save timeline.

    Args:
        job_id: the training run, ``[A-Za-z0-9._-]{1,128}``.
        step: the step to save; may instead come from ``dcp.save(..., checkpoint_id=step)``
            (an int, its decimal string, or ``"memstore://<job_id>/<step>"``).
        connection: how to reach the store on this host (:class:`~trainer_client.connection.Connection`); default
            ``Connection()``: ``MEMSTORE_STORE``, else ``127.0.0.1:7070``, credentials from the environment.
        world_size: by default (None) both it and ``rank`` come from the process group DCP saves with
            (``dcp.save(..., process_group=...)``, else the default group): the coordinator hands every
            rank the group's size and its rank in it through the save plan. Passed explicitly they are
            checked against that group (``InvalidArgumentError`` naming both numbers on a mismatch).
        rank: see ``world_size``.
        overwrite: as ``FileSystemWriter(overwrite=...)`` (default True). False: saving a step that is
            already restorable raises :class:`CheckpointExistsError` (a ``RuntimeError``, which
            ``dcp.save`` reports in a ``CheckpointException``) on every rank, before anything is
            written. True: the save goes on (with a warning from the coordinator, as
            ``FileSystemWriter`` warns); the old version stays restorable until the new one is complete.
        wait_for_replication: each rank waits until its shard has R verified copies before DCP goes
            on (default True), so a returned ``dcp.save`` means the step survives a host loss.
        replication_timeout: bound of that wait, in seconds (``TimeoutError`` past it).

    Deprecated (one release, with a ``DeprecationWarning``): ``store`` (also the third positional argument),
    ``timeout``, ``use_shared_memory``, ``auth_token``, ``tls_ca``, ``tls_cert``, ``tls_key``; use ``connection=``.

    After ``write_data``, ``world_size``, ``rank`` and ``timeline`` hold what the save used (in the process
    that ran it: process-mode ``async_save`` runs it in DCP's checkpoint daemon, on a pickled copy).
    Picklable (``async_save`` in process mode): the store connection is created lazily and is not
    part of the pickled state.
    """

    def __init__(
        self,
        job_id: str,
        step: int | None = None,
        store: str | None = None,
        *,
        connection: Connection | None = None,
        world_size: int | None = None,
        rank: int | None = None,
        overwrite: bool = True,
        wait_for_replication: bool = True,
        replication_timeout: float = 300.0,
        **deprecated: Any,
    ) -> None:
        super().__init__()
        # Read from the environment now (the token too: hidden from repr), as pickled copies must connect alike.
        self.connection = connection_from_kwargs("MemStoreWriter", connection, {"store": store, **deprecated}).resolved()
        problem = job_id_problem(job_id)
        if problem:
            raise InvalidArgumentError(problem)
        if world_size is not None or rank is not None:
            problem = key_problem(job_id, 0, 0 if rank is None else rank, world_size)
            if problem:
                raise InvalidArgumentError(problem)
        self.job_id = job_id
        self.step = None if step is None else _parse_step(step)
        self.world_size: int | None = world_size  # explicit, else learned from the save plan in write_data
        self.rank: int | None = rank
        self._explicit_world_size = world_size
        self._explicit_rank = rank
        self.overwrite = overwrite
        self.wait_for_replication = wait_for_replication
        self.replication_timeout = replication_timeout
        self.is_coordinator = False
        self.save_id = uuid.uuid4().hex
        self.timeline: str | None = None
        self._dcp_rank: int | None = None
        self._plan_info: MemStoreSavePlanInfo | None = None
        self._client: CheckpointClient | None = None
        self._staged: dict[str, Any] | None = None
        self._unwaited: tuple[MemStoreSavePlanInfo, SaveHandle] | None = None  # wait_for_replication=False: the last save

    # -- pickling (async_save process mode) ------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = None
        state["_staged"] = None
        state["_unwaited"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # -- StorageWriter ------------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.step = parse_checkpoint_id(checkpoint_id, self.job_id)
        self.save_id = uuid.uuid4().hex
        self._staged = None
        self._plan_info = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return valid_checkpoint_id(checkpoint_id)

    @property
    def checkpoint_id(self) -> str | None:
        """``"memstore://<job>/<step>"`` (None before a step is known)."""
        return checkpoint_uri(self.job_id, self.step)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise InvalidArgumentError(
                "MemStoreWriter needs use_collectives=True: a memstore step holds one global metadata, written by the coordinator"
            )
        if self.step is None:
            raise InvalidArgumentError("MemStoreWriter has no step: pass step= or dcp.save(..., checkpoint_id=<step>)")
        dcp_rank = kwargs.get("rank")
        if dcp_rank is not None:
            dcp_rank = int(dcp_rank)
            if self._explicit_rank is not None and dcp_rank != self._explicit_rank:
                raise InvalidArgumentError(
                    f"MemStoreWriter(rank={self._explicit_rank}) but DCP saves as rank {dcp_rank} of its process group"
                )
            if self._explicit_world_size is not None and dcp_rank >= self._explicit_world_size:
                raise InvalidArgumentError(
                    f"MemStoreWriter(world_size={self._explicit_world_size}) but DCP saves as rank {dcp_rank} of its process group"
                )
        rank = dcp_rank if dcp_rank is not None else self._explicit_rank
        if is_coordinator and rank not in (None, COORDINATOR_RANK):
            raise InvalidArgumentError(f"the DCP coordinator must be memstore rank {COORDINATOR_RANK}, got rank {rank}")
        self._dcp_rank = dcp_rank
        self.is_coordinator = is_coordinator
        self._staged = None
        self._plan_info = None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # What this rank saw committed, for the restorable floor the coordinator agrees on (trainer_client.dcp.floors).
        self._settle_unwaited()
        rank = self._dcp_rank if self._dcp_rank is not None else self._explicit_rank
        if rank is None:
            return plan  # no rank known before the plan: this save agrees on no floor
        return dataclasses.replace(plan, storage_data=save_history(self._store_address, self.job_id, rank))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        world = len(plans)
        if self._explicit_world_size is not None and self._explicit_world_size != world:
            raise InvalidArgumentError(
                f"MemStoreWriter(world_size={self._explicit_world_size}) but DCP saves with {world} ranks (the process group "
                f"passed to dcp.save); leave world_size unset to take it from that group"
            )
        # FileSystemWriter looks for an existing .metadata before anything of this save is written. The coordinator alone
        # asks (one listing of the cluster per save); its refusal rides the plans, and every rank raises it in write_data.
        refusal = self._check_existing(world)
        step = cast(int, self.step)
        timeline = new_timeline()
        floor = agree_floor([plan.storage_data for plan in plans], world)
        return [
            dataclasses.replace(plan, storage_data=MemStoreSavePlanInfo(self.job_id, step, world, i, timeline, floor, refusal))
            for i, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        info = self._take_plan_info(plan.storage_data)
        if info.refusal:
            raise CheckpointExistsError(info.refusal)  # overwrite=False and the step is restorable: nothing is written
        items, results = write_items(plan, planner, info.rank)
        if self.is_coordinator:
            self._staged = items  # saved with the metadata in finish(): a save is visible only once complete
        else:
            self._save(items, None)
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if not self.is_coordinator:
            return
        info = self._plan_info
        if self._staged is None or info is None:
            raise InvalidArgumentError("MemStoreWriter.finish() called without write_data() on the coordinator")
        if len(results) != info.world_size:
            raise InvalidArgumentError(f"finish() got results of {len(results)} ranks, but the save has {info.world_size}")
        encoded = self._encoded_metadata(metadata, storage_data_of(results))
        staged, self._staged = self._staged, None
        self._save(staged, encoded)

    # -- before the first save ------------------------------------------------------------------
    def prepare(self, state_dict: dict[str, Any], *, group: Any = None) -> bool:
        """Prepare this rank's next save now, at set-up: its shard planned as ``dcp.save`` will write it, and the memory
        for it reserved, mapped and (CUDA tensors) registered (:func:`trainer_client.warmup.prepare_once`), so the first
        save made with this writer is a memcpy instead of the store making memory. Reuse the writer for the saves after
        it (``dcp.save(..., storage_writer=writer, checkpoint_id=step)``): a new writer is a new client.

        ``state_dict``: what the next save will save, with its tensors already in place (an optimizer's state
        exists once it has stepped or loaded one); ``group``: the process group ``dcp.save`` will save with (default:
        the default group when there is one). A collective over that group: every rank calls it. Call it before the
        training loop: right before a save it makes that save slower (:mod:`trainer_client.warmup`).

        Returns whether it prepared now: False after the first time, or when planning or preparing failed (logged,
        never raised: the first save then allocates its memory, as without it).
        """
        rank, world = _rank_and_size(group)
        planned = planned_save(state_dict, rank, world, group)
        if planned is None:
            return False
        planner, plans, metadata = planned
        items, _ = write_items(plans[rank], planner, rank)
        encoded = None
        if rank == COORDINATOR_RANK:
            where = {item.index: MemStoreStorageInfo(r, item_key(item.index)) for r, plan in enumerate(plans) for item in plan.items}
            encoded = self._encoded_metadata(metadata, where)
        info = MemStoreSavePlanInfo(self.job_id, self.step or 0, world, rank, new_timeline())
        return prepare_once(self._client_for(rank, world), new_shard(info, items, encoded))

    # -- helpers --------------------------------------------------------------------------------
    def _encoded_metadata(self, metadata: Metadata, storage_data: dict[MetadataIndex, MemStoreStorageInfo]) -> dict[str, Any]:
        """The coordinator's metadata as its shard holds it: where each item is, DCP's version, this save's ids."""
        metadata.storage_data = storage_data
        metadata.version = dcp_version()
        metadata.storage_meta = self.storage_meta()
        return encode_metadata(metadata)

    def _take_plan_info(self, info: Any) -> MemStoreSavePlanInfo:
        """This rank's part of the save, from the plan the coordinator made; checked against what this writer knows."""
        info = checked_plan_info(info, self.job_id, self.step, self._explicit_world_size, self._explicit_rank, self._dcp_rank)
        self._plan_info = info
        self.world_size, self.rank, self.timeline = info.world_size, info.rank, info.timeline
        return info

    def _check_existing(self, world: int) -> str:
        """FileSystemWriter's overwrite rule, on the coordinator (rank 0 of ``world``): why an already restorable step is
        refused unless ``overwrite`` (every rank raises it, ``write_data``); "" when it is not, after a warning if it
        is overwritten."""
        step = cast(int, self.step)
        client = self._client_for(COORDINATOR_RANK, world)  # kept for the save
        try:
            existing = client.restore_point(step)  # the writer's client has no group: no collective (one rank checks)
        except (NotFoundError, NoCheckpointError):
            existing = None  # a job no store knows yet
        if existing is None:
            return ""
        if not self.overwrite:
            return (
                f"Checkpoint already exists and self.overwrite=False: step {step} of job {self.job_id!r} is restorable "
                f"(saved by {existing.world_size} ranks); pass overwrite=True to save a new version of it"
            )
        warnings.warn(
            f"Detected an existing checkpoint: step {step} of job {self.job_id!r}; overwriting since self.overwrite=True "
            "(the existing version stays restorable until the new one is complete)",
            stacklevel=2,
        )
        return ""

    def _client_for(self, rank: int, world_size: int) -> CheckpointClient:
        """The client saving as ``rank`` of ``world_size``, with no process group (``group=False``): a DCP save names
        its own timeline, which the restorable floor does not follow, and ``dcp.async_save`` writes on a thread where a
        collective over the job's group would race the trainer's."""
        if self._client is None or (self._client.rank, self._client.world_size) != (rank, world_size):
            self.close()
            self._client = CheckpointClient(self.job_id, rank, world_size, connection=self.connection, group=False)
        return self._client

    def _save(self, items: dict[str, Any], metadata: dict[str, Any] | None) -> None:
        info = cast(MemStoreSavePlanInfo, self._plan_info)
        shard = new_shard(info, items, metadata)
        client = self._client_for(info.rank, info.world_size)
        handle = client.save(info.step, shard, timeline=info.timeline, restorable_floor=info.floor)
        if self.wait_for_replication:
            self._settled(info, handle.wait(self.replication_timeout))
        else:
            self._unwaited = (info, handle)  # settled or not, asked at this writer's next save

    def _settle_unwaited(self) -> None:
        """The last save made with ``wait_for_replication=False``: if its store has it settled now, remember it."""
        unwaited, self._unwaited = self._unwaited, None
        if unwaited is None or self._client is None:
            return
        info, handle = unwaited
        try:
            done = handle.done()
        except MemstoreClientError as exc:
            log.debug("memstore: the status of step %d is unknown (%s): it is left out of the restorable floor", info.step, exc)
            return
        if done and handle.last_status is not None:
            self._settled(info, handle.last_status)

    def _settled(self, info: MemStoreSavePlanInfo, result: SaveResult) -> None:
        """This rank's save of ``info`` settled as ``result``: a verified copy makes it part of this rank's history."""
        if result.copies >= 1 and not result.superseded:
            remember_committed(self._store_address, info.job_id, info.rank, (info.step, info.timeline, info.world_size))

    @property
    def _store_address(self) -> str:
        return str(self.connection.address)

    def close(self) -> None:
        self._unwaited = None
        if self._client is not None:
            self._client.close()
            self._client = None


# --------------------------------------------------------------------------------------------
# reader
# --------------------------------------------------------------------------------------------


class MemStoreReader(StorageReader):
    """DCP ``StorageReader`` loading a step saved by :class:`MemStoreWriter`, with any loading world size.

    Args:
        job_id: the training run.
        step: the step to load; None (default) = the newest restorable step.
            ``dcp.load(..., checkpoint_id=step)`` sets it too.
        connection: how to reach the store on this host (:class:`~trainer_client.connection.Connection`); shards of
            any rank are fetched through it. Default ``Connection()``: ``MEMSTORE_STORE``, else ``127.0.0.1:7070``.
        zero_copy: map shards copy-on-write instead of copying them (they are copied into the
            destination tensors anyway). Destinations on a CUDA device are filled straight from that
            memory (registered read-only while it is read: asynchronous DMA), synchronized per shard.
        group: the loading job's process group (the one ``dcp.load`` loads with; rank *i* of it reads as rank *i*).
            Resolving the version to read (``read_metadata``, ``latest_step``) then is a collective, as
            ``CheckpointClient.latest_step(group=...)``: each rank asks only its own store about its own shard, and rank 0
            alone asks the whole cluster, once, when the ranks' views cannot decide (a load by another world size than
            the save's, a save that did not complete). Without it every rank asks the whole cluster. It has no default:
            DCP hands its reader no process group, and ``dcp.load`` may load on a subgroup or on one rank alone (``no_dist``),
            where a collective over the default group would wait forever (the torchtitan integration passes it).
            ``agreement_stats`` says what the last resolution cost this rank.

    Deprecated (one release, with a ``DeprecationWarning``): ``store`` (also the third positional argument),
    ``timeout``, ``use_shared_memory``, ``auth_token``, ``tls_ca``, ``tls_cert``, ``tls_key``; use ``connection=``.

    ``read_metadata`` resolves ``(step, world_size, timeline)`` once (``CheckpointClient.restore_point``:
    the newest complete version of the step) and every shard is read from exactly that timeline, so a
    load never mixes two saves of one step. The coordinator passes its resolution to every rank in the
    load plans (:class:`MemStoreLoadPlanInfo`); a rank that resolved another version (a save completed
    between the ranks' ``read_metadata``) raises ``NotFoundError`` before reading anything, so ranks
    never load two different saves either. After it, ``resolved_step``, ``saved_world_size`` and
    ``resolved_timeline`` say what is read.

    Errors: ``NoCheckpointError`` when the job has no restorable step (or is unknown), ``NotFoundError``
    when the requested step has no complete version (never saved, or its save did not finish) or was
    not saved by DCP, ``CorruptShardError`` when a shard is not a well-formed DCP shard.
    """

    def __init__(
        self,
        job_id: str,
        step: int | None = None,
        store: str | None = None,
        *,
        connection: Connection | None = None,
        zero_copy: bool = True,
        group: Any = None,
        **deprecated: Any,
    ) -> None:
        super().__init__()
        # Read from the environment now (the token too: hidden from repr), as pickled copies must connect alike.
        self.connection = connection_from_kwargs("MemStoreReader", connection, {"store": store, **deprecated}).resolved()
        problem = job_id_problem(job_id)
        if problem:
            raise InvalidArgumentError(problem)
        self.job_id = job_id
        self.step = None if step is None else _parse_step(step)
        self.zero_copy = zero_copy
        self.load_id = uuid.uuid4().hex
        self.resolved_step: int | None = None
        self.saved_world_size: int | None = None
        self.resolved_timeline: str | None = None
        self.storage_data: dict[MetadataIndex, Any] = {}
        self._client: CheckpointClient | None = None
        self._shards: dict[int, Mapping[str, Any]] = {}
        self.group = group
        self._agreeing: CheckpointClient | None = None  # with a group: this rank's client in the loading job
        self.agreement_stats: AgreementStats | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = None
        state["_agreeing"] = None
        state["group"] = None  # a process group does not travel; a pickled copy resolves on its own
        state["_shards"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # -- StorageReader ----------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.step = parse_checkpoint_id(checkpoint_id, self.job_id)
        self.load_id = uuid.uuid4().hex
        self.resolved_step = None
        self.saved_world_size = None
        self.resolved_timeline = None
        self.storage_data = {}
        self._shards = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return valid_checkpoint_id(checkpoint_id)

    @property
    def checkpoint_id(self) -> str | None:
        """``"memstore://<job>/<step>"`` of the step being read (None before it is resolved)."""
        return checkpoint_uri(self.job_id, self.step if self.step is not None else self.resolved_step)

    # ``**_kwargs`` (not ``**kwargs``) on purpose: DCP retries ``read_metadata(rank=...)`` for
    # rank-local metadata only when the parameter is named ``kwargs``; memstore has none, and the retry
    # would only bury the real error under a second one.
    def read_metadata(self, *args: Any, **_kwargs: Any) -> Metadata:
        step, world_size, timeline = self._resolve()
        shard = self._read_shard(step, COORDINATOR_RANK, world_size, timeline, metadata=True)
        metadata = decode_metadata(shard["metadata"])
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        self.resolved_step = step
        self.saved_world_size = world_size
        self.resolved_timeline = timeline
        self._shards = {COORDINATOR_RANK: shard}
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not isinstance(metadata.storage_data, dict):
            raise CorruptShardError(f"DCP metadata of {self.checkpoint_id} has no memstore storage_data")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        # Every rank resolved its version in read_metadata; the coordinator tells them which one it planned
        # with, so that a save completing between two ranks' read_metadata cannot make them read two saves.
        if self.resolved_step is None or self.resolved_timeline is None:
            raise InvalidArgumentError("MemStoreReader.prepare_global_plan() called before read_metadata()")
        info = MemStoreLoadPlanInfo(self.job_id, self.resolved_step, self.resolved_timeline)
        return [dataclasses.replace(plan, storage_data=info) for plan in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self.resolved_step is None or self.saved_world_size is None or self.resolved_timeline is None:
            raise InvalidArgumentError("MemStoreReader.read_data() called before read_metadata()")
        info = plan.storage_data
        if isinstance(info, MemStoreLoadPlanInfo) and (info.job_id, info.step, info.timeline) != (
            self.job_id,
            self.resolved_step,
            self.resolved_timeline,
        ):
            raise NotFoundError(
                f"this rank resolved step {self.resolved_step} of job {self.job_id!r} (save {self.resolved_timeline!r}) but the DCP "
                f"coordinator step {info.step} of job {info.job_id!r} (save {info.timeline!r}): a save completed while the ranks "
                "started dcp.load; nothing was read, load again"
            )
        by_rank = items_by_rank(plan.items, self.storage_data, self.checkpoint_id)
        for rank in list(self._shards):
            if rank not in by_rank:
                del self._shards[rank]
        try:
            for rank in sorted(by_rank):  # one shard in memory at a time
                shard = self._shards.pop(rank, None) or self._read_shard(
                    self.resolved_step, rank, self.saved_world_size, self.resolved_timeline
                )
                read_items(shard, by_rank[rank], planner, self.checkpoint_id)
                del shard
        finally:
            self._shards = {}
        return _done(None)

    # -- helpers --------------------------------------------------------------------------------
    def _client_for(self, world_size: int | None) -> CheckpointClient:
        """A client of ``world_size`` ranks (None: any; restore_point does not depend on it).

        Rank 0 is valid in any world; reads name their rank explicitly (``load(rank=...)``).
        """
        if self._client is None or (world_size is not None and self._client.world_size != world_size):
            self.close()
            # Rank 0 of the saved world, in every loading process: never the job's group (each reads on its own).
            self._client = CheckpointClient(self.job_id, 0, world_size or 1, connection=self.connection, group=False)
        return self._client

    def _restore_point(self, step: int | None) -> tuple[int, int, str] | None:
        try:
            point = self._agreed_point(step) if self.group is not None else self._client_for(None).restore_point(step)
        except (NotFoundError, NoCheckpointError):
            return None  # a job no store knows
        if point is None:
            return None
        return int(point.step), int(point.world_size), str(point.timeline)

    def _agreed_point(self, step: int | None) -> RestorePoint | None:
        """The version agreed over the loading group (a collective): this rank's client is rank i of the group's size."""
        import torch.distributed as dist

        try:
            rank, size = dist.get_rank(self.group), dist.get_world_size(self.group)
        except (RuntimeError, ValueError, TypeError, AttributeError) as exc:
            raise InvalidArgumentError(f"MemStoreReader(group={self.group!r:.80}) is not a process group of this job: {exc}") from None
        if not 0 <= rank < size:
            raise InvalidArgumentError(f"MemStoreReader(group=...): this process is not a member of that group (rank {rank} of {size})")
        if self._agreeing is None or (self._agreeing.rank, self._agreeing.world_size) != (rank, size):
            if self._agreeing is not None:
                self._agreeing.close()
            self._agreeing = CheckpointClient(self.job_id, rank, size, connection=self.connection, group=False)
        point = self._agreeing.restore_point(step, group=self.group)
        self.agreement_stats = self._agreeing.stats().agreement
        return point

    def _resolve(self) -> tuple[int, int, str]:
        """(step, world size, timeline) to read: the requested step's, or the newest restorable step's, complete version."""
        found = self._restore_point(self.step)
        if found is not None:
            return found
        if self.step is None:
            raise NoCheckpointError(f"job {self.job_id!r} has no complete step: no step has a verified shard of one save for every rank")
        raise NotFoundError(
            f"step {self.step} of job {self.job_id!r} has no DCP metadata: no save of it is complete (rank 0, the coordinator, "
            f"saves its shard with the metadata last), so the step was never saved or its dcp.save did not finish"
        )

    def latest_step(self) -> int | None:
        """The step ``dcp.load`` would read with ``step=None``: the newest restorable one, or None."""
        found = self._restore_point(None)
        return None if found is None else found[0]

    def _read_shard(self, step: int, rank: int, world_size: int, timeline: str, metadata: bool = False) -> Mapping[str, Any]:
        client = self._client_for(world_size)
        try:
            shard = client.load(step, rank=rank, zero_copy=self.zero_copy, timeline=timeline)
        except NotFoundError as exc:
            if rank == COORDINATOR_RANK:
                raise NotFoundError(
                    f"step {step} of job {self.job_id!r} has no DCP metadata: the coordinator's shard (rank {rank}) of save "
                    f"{timeline!r} is in no store, so the step was never saved or its dcp.save did not finish ({exc})"
                ) from None
            raise NotFoundError(
                f"step {step} of job {self.job_id!r}: the shard of rank {rank} of save {timeline!r} is missing ({exc})"
            ) from None
        return checked_shard(shard, self.job_id, step, rank, world_size, timeline, metadata)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._agreeing is not None:
            self._agreeing.close()
            self._agreeing = None
