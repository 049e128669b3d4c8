"""Run ids and timelines: what names one start of a job, so that its saves form one timeline (see
:mod:`trainer_client.client`), and :class:`Timeline`, the one a client's saves go to.

The run id a client is given (``run_id=``, ``MEMSTORE_RUN_ID``) is read and checked by
:func:`trainer_client.knobs.run_id`; this module draws one when none is given.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

__all__ = ["PROCESS_RUN_ID", "Timeline", "broadcast_run_id", "new_run_id"]

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


class Timeline:
    """A client's timeline, ``<run id>.<epoch>``: the one its next save goes to, moved on by each save that went through.

    The run id is the one given, else drawn at the first save (:func:`broadcast_run_id`, else this process's). The epoch
    goes up when a step at or below one saved before is saved again (a rollback), which every rank of an SPMD job does at
    the same point. Only saves that went through count (:meth:`saved`): a rank whose save failed and is retried stays on
    the timeline of the ranks whose save went through. ``listener`` is told each of them too (the restorable floor's
    agreement: ``FloorAgreement.saved``).
    """

    def __init__(self, run_id: str | None, world_size: int, rank: int) -> None:
        self.run_id = run_id
        self._world_size, self._rank = world_size, rank
        self.epoch = 0
        self._last_saved: int | None = None
        self.listener: Callable[[int, str], None] | None = None

    @property
    def name(self) -> str:
        """``<run id>.<epoch>``; "" before a run id is known."""
        return f"{self.run_id}.{self.epoch}" if self.run_id else ""

    def epoch_for(self, step: int) -> int:
        """The epoch a save of ``step`` goes to (a collective at the first save when the run id is drawn)."""
        if self.run_id is None:
            self.run_id = broadcast_run_id(self._world_size, self._rank) or PROCESS_RUN_ID
        rollback = self._last_saved is not None and step <= self._last_saved
        return self.epoch + 1 if rollback else self.epoch

    def saved(self, step: int, epoch: int) -> None:
        """The save of ``step`` in ``epoch`` went through: the timeline moves on."""
        self.epoch, self._last_saved = epoch, step
        if self.listener is not None:
            self.listener(step, self.name)
