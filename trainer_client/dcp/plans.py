"""What the ranks of one DCP save or load agree on: checkpoint ids, plan infos, and the save's timeline.

Used by :mod:`trainer_client.dcp.storage_layer` (the package re-exports the public names): ``dcp.save(..., checkpoint_id=...)``
ids are parsed here; the coordinator's :class:`MemStoreSavePlanInfo` / :class:`MemStoreLoadPlanInfo` travel to
every rank in DCP's plans and are checked here against what a rank's writer knows.
"""

from __future__ import annotations

import collections
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Final

from memstore.v1.keys import job_id_problem, key_problem
from trainer_client.errors import InvalidArgumentError

__all__ = [
    "URI_PREFIX",
    "MemStoreLoadPlanInfo",
    "MemStoreSavePlanInfo",
    "checked_plan_info",
    "checkpoint_uri",
    "dcp_version",
    "new_timeline",
    "parse_checkpoint_id",
    "parse_step",
    "valid_checkpoint_id",
]

URI_PREFIX: Final = "memstore://"


def dcp_version() -> str:
    """The version FileSystemWriter stamps on its metadata."""
    try:
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
    except ImportError:  # pragma: no cover - older torch
        return "1.0.0"
    return str(CURRENT_DCP_VERSION)


@dataclass(frozen=True)
class MemStoreSavePlanInfo:
    """What the coordinator tells each saving rank about one save (its ``SavePlan.storage_data``).

    ``world_size`` is the size of the group DCP saves with (the number of plans), ``rank`` the plan's
    index in it, ``timeline`` the id of this save, ``floor`` the job's restorable floor the ranks agreed
    (:mod:`trainer_client.dcp.floors`): (step, timeline) of the newest earlier save every rank committed, or None;
    ``refusal`` why the save must not go on (``overwrite=False`` and the step restorable: every rank raises it
    before it writes), "" when it may. Pickled by DCP's collectives (and to the checkpoint daemon of process-mode
    ``async_save``): plain fields only.
    """

    job_id: str
    step: int
    world_size: int
    rank: int
    timeline: str
    floor: tuple[int, str] | None = None
    refusal: str = ""


@dataclass(frozen=True)
class MemStoreLoadPlanInfo:
    """The version the DCP coordinator's reader resolved (its ``LoadPlan.storage_data`` for every rank)."""

    job_id: str
    step: int
    timeline: str


def new_timeline() -> str:
    """A fresh timeline id for one DCP save: time-ordered, unique across processes."""
    return f"dcp-{time.time_ns():016x}-{secrets.token_hex(4)}"


# --------------------------------------------------------------------------------------------
# checkpoint ids
# --------------------------------------------------------------------------------------------


def parse_step(value: Any) -> int:
    if isinstance(value, bool):
        raise InvalidArgumentError(f"step {value!r} is invalid: expected an int >= 0")
    if isinstance(value, int):
        if value < 0:
            raise InvalidArgumentError(f"step {value!r} is invalid: expected an int >= 0")
        return value
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    raise InvalidArgumentError(f"step {value!r} is invalid: expected an int >= 0 or a string of decimal digits")


def parse_checkpoint_id(checkpoint_id: Any, job_id: str) -> int:
    """The step a DCP ``checkpoint_id`` names for ``job_id``.

    Accepted: a step (``int >= 0``, or its decimal string) or ``"memstore://<job>/<step>"`` whose job
    must be ``job_id``.
    """
    if isinstance(checkpoint_id, os.PathLike):
        checkpoint_id = os.fspath(checkpoint_id)
    if isinstance(checkpoint_id, str) and checkpoint_id.startswith(URI_PREFIX):
        job, sep, step = checkpoint_id[len(URI_PREFIX) :].rpartition("/")
        if not sep:
            raise InvalidArgumentError(f"checkpoint_id {checkpoint_id!r} is invalid: expected 'memstore://<job>/<step>'")
        if job != job_id:
            raise InvalidArgumentError(f"checkpoint_id {checkpoint_id!r} names job {job!r} but this storage is for job {job_id!r}")
        return parse_step(step)
    try:
        return parse_step(checkpoint_id)
    except InvalidArgumentError:
        raise InvalidArgumentError(
            f"checkpoint_id {checkpoint_id!r} is invalid: expected a step (int >= 0 or decimal string) or 'memstore://<job>/<step>'"
        ) from None


def valid_checkpoint_id(checkpoint_id: Any) -> bool:
    if isinstance(checkpoint_id, os.PathLike):
        checkpoint_id = os.fspath(checkpoint_id)
    if isinstance(checkpoint_id, str) and checkpoint_id.startswith(URI_PREFIX):
        job, sep, step = checkpoint_id[len(URI_PREFIX) :].rpartition("/")
        return bool(sep) and job_id_problem(job) is None and step.isascii() and step.isdigit()
    try:
        parse_step(checkpoint_id)
    except InvalidArgumentError:
        return False
    return True


def checkpoint_uri(job_id: str, step: int | None) -> str | None:
    return None if step is None else f"{URI_PREFIX}{job_id}/{step}"


# (job, step, rank, timeline) of the save plans ``write_data`` consumed in this process: a plan seen twice
# is a replay of an earlier save's plan (DefaultSavePlanner(enable_plan_caching=True) hands ranks their
# cached final plan, storage_data included), which would write into that earlier save's timeline.
_CONSUMED_PLANS: collections.OrderedDict[tuple[str, int, int, str], None] = collections.OrderedDict()
_CONSUMED_PLANS_LOCK = threading.Lock()
_CONSUMED_PLANS_MAX = 4096


def _consume_plan(info: MemStoreSavePlanInfo) -> bool:
    key = (info.job_id, info.step, info.rank, info.timeline)
    with _CONSUMED_PLANS_LOCK:
        if key in _CONSUMED_PLANS:
            return False
        _CONSUMED_PLANS[key] = None
        while len(_CONSUMED_PLANS) > _CONSUMED_PLANS_MAX:
            _CONSUMED_PLANS.popitem(last=False)
    return True


def checked_plan_info(
    info: Any, job_id: str, step: int | None, world_size: int | None, rank: int | None, dcp_rank: int | None
) -> MemStoreSavePlanInfo:
    """This rank's part of the save, from the plan the coordinator made, checked against what its writer knows.

    ``world_size`` and ``rank`` are the writer's explicit ones (None: unset), ``dcp_rank`` the rank DCP set it up with.
    """
    if not isinstance(info, MemStoreSavePlanInfo):
        raise InvalidArgumentError(
            f"the DCP save plan carries no MemStoreSavePlanInfo (storage_data is {type(info).__qualname__}): the coordinator's "
            "storage writer is not a MemStoreWriter, or its prepare_global_plan did not run"
        )
    if info.job_id != job_id or info.step != step:
        raise InvalidArgumentError(
            f"the DCP coordinator saves step {info.step} of job {info.job_id!r} but this rank's MemStoreWriter saves step "
            f"{step} of job {job_id!r}: every rank must save the same job and step (DefaultSavePlanner("
            "enable_plan_caching=True), which replays an earlier save's plan, is not supported)"
        )
    if world_size is not None and world_size != info.world_size:
        raise InvalidArgumentError(
            f"MemStoreWriter(world_size={world_size}) but DCP saves with {info.world_size} ranks (the process "
            "group passed to dcp.save); leave world_size unset to take it from that group"
        )
    if rank is not None and rank != info.rank:
        raise InvalidArgumentError(f"MemStoreWriter(rank={rank}) but DCP saves as rank {info.rank} of its process group")
    if dcp_rank is not None and dcp_rank != info.rank:
        raise InvalidArgumentError(f"DCP saves as rank {dcp_rank} but was handed the save plan of rank {info.rank}")
    problem = key_problem(info.job_id, info.step, info.rank, info.world_size, info.timeline)
    if problem:
        raise InvalidArgumentError(f"invalid DCP save plan: {problem}")
    if not _consume_plan(info):
        raise InvalidArgumentError(
            f"rank {info.rank} already wrote step {info.step} of job {info.job_id!r} under timeline {info.timeline!r}: DCP "
            "replayed an earlier save's plan (DefaultSavePlanner(enable_plan_caching=True) is not supported by MemStoreWriter; "
            "every save needs a timeline of its own)"
        )
    return info
