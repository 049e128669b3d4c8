"""Run ids: what names one start of a job, so that its saves form one timeline (see :mod:`trainer_client.client`)."""

from __future__ import annotations

import os
import secrets
import time

from memstore.v1.keys import timeline_problem
from trainer_client.errors import InvalidArgumentError

__all__ = ["PROCESS_RUN_ID", "RUN_ID_ENV", "broadcast_run_id", "new_run_id", "run_id_given", "run_id_problem"]

RUN_ID_ENV = "MEMSTORE_RUN_ID"
_MAX_RUN_ID = 100  # leaves room for ".<epoch>" within the 128 characters of a timeline
PROCESS_RUN_ID = f"p{time.time_ns():x}-{secrets.token_hex(4)}"  # shared by every client of this process


def new_run_id() -> str:
    """A fresh run id: sortable by creation time, unique across machines."""
    return f"r{time.time_ns():x}-{secrets.token_hex(4)}"


def run_id_problem(run_id: str) -> str | None:
    if not isinstance(run_id, str) or not run_id or len(run_id) > _MAX_RUN_ID or timeline_problem(run_id):
        return f"run_id {run_id!r} is invalid: expected 1-{_MAX_RUN_ID} characters of [A-Za-z0-9._-]"
    return None


def broadcast_run_id(world_size: int, rank: int) -> str | None:
    """Rank 0's fresh run id, agreed over the default process group; None if that group is not this job's."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch always ships it
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size() != world_size or dist.get_rank() != rank:
        return None
    box = [new_run_id() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def run_id_given(run_id: str | None) -> str | None:
    """The run id a client was given: ``run_id``, else ``MEMSTORE_RUN_ID``, else None (drawn at the first save);
    InvalidArgumentError naming where a bad one came from."""
    source = "run_id="
    if run_id is None and os.environ.get(RUN_ID_ENV):
        run_id, source = os.environ[RUN_ID_ENV], RUN_ID_ENV
    if run_id is not None and run_id_problem(run_id):
        raise InvalidArgumentError(f"{run_id_problem(run_id)} (from {source})")
    return run_id
