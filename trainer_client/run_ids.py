"""Run ids: what names one start of a job, so that its saves form one timeline (see :mod:`trainer_client.client`).

The one a client is given (``run_id=``, ``MEMSTORE_RUN_ID``) is read and checked by :func:`trainer_client.knobs.run_id`;
this module draws one when none is given.
"""

from __future__ import annotations

import secrets
import time

__all__ = ["PROCESS_RUN_ID", "broadcast_run_id", "new_run_id"]

PROCESS_RUN_ID = f"p{time.time_ns():x}-{secrets.token_hex(4)}"  # shared by every client of this process


def new_run_id() -> str:
    """A fresh run id: sortable by creation time, unique across machines."""
    return f"r{time.time_ns():x}-{secrets.token_hex(4)}"


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
