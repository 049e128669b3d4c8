"""One rank's DCP shard: its layout, the items a save plan writes into it, and the items a load plan reads out.

The shard is a plain dict (see :mod:`trainer_client.dcp.storage_layer`)::

    {"format": "memstore-dcp", "version": 1, "step": step, "rank": r, "world_size": W, "timeline": T,
     "items": {<item key>: tensor | bytes, ...},
     "metadata": <tagged plain dicts>}          # rank 0 (the DCP coordinator) only
"""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping
from typing import Any, Final

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import WriteResult

from trainer_client.capture.device_restore import HostToDevice
from trainer_client.dcp.metadata import MemStoreStorageInfo, item_key
from trainer_client.dcp.plans import MemStoreSavePlanInfo
from trainer_client.errors import CorruptShardError, InvalidArgumentError, NotFoundError

__all__ = [
    "COORDINATOR_RANK",
    "SHARD_FORMAT",
    "SHARD_VERSION",
    "checked_shard",
    "items_by_rank",
    "new_shard",
    "planned_save",
    "read_items",
    "storage_data_of",
    "write_items",
]

SHARD_FORMAT: Final = "memstore-dcp"
SHARD_VERSION: Final = 1
COORDINATOR_RANK: Final = 0
"""DCP's coordinator is rank 0 of the saving group; its shard carries the metadata."""

log = logging.getLogger(__name__)


def new_shard(info: MemStoreSavePlanInfo, items: dict[str, Any], metadata: dict[str, Any] | None) -> dict[str, Any]:
    """The shard of ``info``'s rank holding ``items`` (and, on the coordinator, the encoded metadata)."""
    shard: dict[str, Any] = {
        "format": SHARD_FORMAT,
        "version": SHARD_VERSION,
        "step": info.step,
        "rank": info.rank,
        "world_size": info.world_size,
        "timeline": info.timeline,
        "items": items,
    }
    if metadata is not None:
        shard["metadata"] = metadata
    return shard


def planned_save(state_dict: dict[str, Any], rank: int, world_size: int, group: Any) -> tuple[SavePlanner, list[SavePlan], Metadata] | None:
    """What ``dcp.save(state_dict, process_group=group)`` with DCP's default planner will have each rank write, planned
    now: a planner holding this rank's final plan (for :func:`write_items`), every rank's final plan (replicated
    items written by one rank only) and the global metadata. None if a rank could not plan its state (each logs why).

    A collective over ``group`` when ``world_size`` > 1 (the local plans are gathered as ``dcp.save`` gathers them):
    every rank calls it. ``Stateful`` values are asked for their ``state_dict()``, as ``dcp.save`` asks them.
    """
    planner: SavePlanner = DefaultSavePlanner()
    local: SavePlan | None
    try:
        flat = {key: value.state_dict() if isinstance(value, Stateful) else value for key, value in state_dict.items()}
        planner.set_up_planner(flat, storage_meta=None, is_coordinator=rank == COORDINATOR_RANK)
        local = planner.create_local_plan()
    except Exception as exc:  # the save itself will say what is wrong with the state
        log.warning("memstore: cannot plan this rank's DCP save ahead: %s", exc)
        local = None
    plans: list[Any] = [local]
    if world_size > 1:
        plans = [None] * world_size
        dist.all_gather_object(plans, local, group=group)
    if any(plan is None for plan in plans):
        return None
    final, metadata = planner.create_global_plan(plans)
    planner.finish_plan(final[rank])
    return planner, final, metadata


def write_items(plan: SavePlan, planner: SavePlanner, rank: int) -> tuple[dict[str, torch.Tensor | bytes], list[WriteResult]]:
    """The items of ``plan``, keyed as in the shard of ``rank``, and DCP's write results that point at them."""
    items: dict[str, torch.Tensor | bytes] = {}
    results: list[WriteResult] = []
    for item in plan.items:
        key = item_key(item.index)
        if key in items:
            raise InvalidArgumentError(f"two DCP write items map to the same memstore key {key!r}")
        data = planner.resolve_data(item)
        value: torch.Tensor | bytes
        if item.type == WriteItemType.BYTE_IO:
            if not isinstance(data, io.BytesIO):
                raise InvalidArgumentError(f"{item.index.fqn}: planner returned {type(data).__qualname__} for a BYTE_IO item")
            value = data.getvalue()
            size = len(value)
        else:
            if not isinstance(data, torch.Tensor):
                raise InvalidArgumentError(f"{item.index.fqn}: planner returned {type(data).__qualname__} for a tensor item")
            value = data.detach()  # on its device: CUDA tensors are copied straight into the store's memory
            size = value.numel() * value.element_size()
        items[key] = value
        results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=MemStoreStorageInfo(rank, key)))
    return items, results


def storage_data_of(results: list[list[WriteResult]]) -> dict[MetadataIndex, MemStoreStorageInfo]:
    """The metadata's ``storage_data``: where every rank's write results put each item."""
    storage_md: dict[MetadataIndex, MemStoreStorageInfo] = {}
    for rank_results in results:
        for wr in rank_results:
            if not isinstance(wr.storage_data, MemStoreStorageInfo):
                raise InvalidArgumentError(f"{wr.index.fqn}: write result was not produced by MemStoreWriter")
            storage_md[wr.index] = wr.storage_data
    return storage_md


def checked_shard(shard: Any, job_id: str, step: int, rank: int, world_size: int, timeline: str, metadata: bool) -> Mapping[str, Any]:
    """``shard``, loaded for (``step``, ``rank``) of save ``timeline``, checked to be that rank's DCP shard.

    ``metadata``: it must carry the DCP metadata (the coordinator's). ``NotFoundError`` where it is no DCP shard
    at all, ``CorruptShardError`` where it is a malformed one or another rank's or save's.
    """
    where = f"step {step} of job {job_id!r}, rank {rank}"
    if not isinstance(shard, dict) or shard.get("format") != SHARD_FORMAT:
        raise NotFoundError(f"{where} was not written by MemStoreWriter (no DCP shard); load it with CheckpointClient.load")
    if shard.get("version") != SHARD_VERSION:
        raise CorruptShardError(f"{where}: DCP shard version {shard.get('version')!r}, this reader knows {SHARD_VERSION}")
    saved_world = shard.get("world_size")
    if type(saved_world) is not int or saved_world < 1 or not isinstance(shard.get("items"), dict):
        raise CorruptShardError(f"{where}: malformed DCP shard header")
    if shard.get("step") != step or shard.get("rank") != rank:
        raise CorruptShardError(f"{where}: shard says step {shard.get('step')!r} rank {shard.get('rank')!r}")
    if shard.get("timeline", timeline) != timeline:  # shards of writers before timelines carry none
        raise CorruptShardError(f"{where}: shard of save {shard.get('timeline')!r} returned for save {timeline!r}")
    if metadata and "metadata" not in shard:
        raise NotFoundError(f"{where} holds no DCP metadata: it was not saved by the DCP coordinator")
    if saved_world != world_size:
        raise CorruptShardError(f"{where}: saved by {saved_world} ranks but the store says the step has {world_size}")
    return shard


def items_by_rank(
    reqs: list[ReadItem], storage_data: Mapping[MetadataIndex, Any], checkpoint_id: str | None
) -> dict[int, list[tuple[ReadItem, MemStoreStorageInfo]]]:
    """The read requests of a load plan, grouped by the rank whose shard holds each item."""
    by_rank: dict[int, list[tuple[ReadItem, MemStoreStorageInfo]]] = {}
    for req in reqs:
        info = storage_data.get(req.storage_index)
        if not isinstance(info, MemStoreStorageInfo):
            raise CorruptShardError(f"{checkpoint_id}: the metadata has no memstore location for {req.storage_index}")
        by_rank.setdefault(info.rank, []).append((req, info))
    return by_rank


def _narrow(tensor: torch.Tensor, offsets: torch.Size, lengths: torch.Size) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if offset != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor


def read_items(
    shard: Mapping[str, Any], reqs: list[tuple[ReadItem, MemStoreStorageInfo]], planner: LoadPlanner, checkpoint_id: str | None
) -> None:
    """Hand ``planner`` every requested item of one rank's shard: bytes as they are, tensor slices copied into its targets."""
    items = shard["items"]
    copies = HostToDevice()  # onto CUDA targets: from the shard's pinned memory, asynchronous, done before returning
    try:
        for req, info in reqs:
            where = f"{checkpoint_id} rank {info.rank} item {info.key!r}"
            if info.key not in items:
                raise CorruptShardError(f"{where} is named by the metadata but missing from the shard")
            value = items[info.key]
            if req.type == LoadItemType.BYTE_IO:
                if not isinstance(value, (bytes, bytearray)):
                    raise CorruptShardError(f"{where}: expected bytes, found {type(value).__qualname__}")
                planner.load_bytes(req, io.BytesIO(value))
                continue
            if not isinstance(value, torch.Tensor):
                raise CorruptShardError(f"{where}: expected a tensor, found {type(value).__qualname__}")
            source = _narrow(value, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != source.size():
                raise CorruptShardError(f"{where}: DCP asks for {tuple(target.size())} but the stored slice is {tuple(source.size())}")
            copies.copy_into(target, source)
            planner.commit_tensor(req, target)
    finally:
        copies.finish()
