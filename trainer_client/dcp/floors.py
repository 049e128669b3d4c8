"""The restorable floor of DCP saves, agreed in DCP's own planning collectives: no collective of memstore's.

A DCP save names a timeline of its own (:func:`~trainer_client.dcp.plans.new_timeline`), so the client's floor agreement
(``trainer_client.floor``: an all-reduce per save over the job's group, about the client's own timeline) cannot serve
it, and the writer's client has no group (``dcp.async_save`` plans and writes on a thread of its own). DCP gathers
every rank's local plan to the coordinator and scatters the final plans back anyway; the floor rides them:

1. ``prepare_local_plan``: each rank's writer puts a :class:`SaveHistory` in its plan's ``storage_data``: the versions
   (step, timeline, world size) of the job that this process saw committed as that rank (its store reported the rank's
   shard settled with a verified copy), the newest :data:`~trainer_client.floor.WINDOW` of them. The history outlives
   the writer (kept in this process per store address, job and rank: :func:`committed`, :func:`history`), so a fresh
   ``MemStoreWriter`` per save, as the DCP guide shows, carries it as well as one reused.
2. ``prepare_global_plan``: the coordinator computes the floor (:func:`agree_floor`) with the rule of ``trainer_client.floor``,
   on the gathered histories instead of an all-reduce: each rank's vector (``encode``), their element-wise MIN
   (``reduced``), ``agreed_floor``. The result is the newest version every rank of this save's world committed, or
   None; every rank gets it in its ``MemStoreSavePlanInfo.floor``.
3. Each rank's save tells its store with its commit (``CheckpointClient.save(restorable_floor=...)``), as a floor of
   another timeline (``memstore.core.floors``); the store passes it on with the replicas it pushes. Retention then keeps
   that version and everything newer, and evicts the rest without listing the cluster.

The rule compares versions by their index in the coordinator's ordering of every version the ranks sent: by timeline
(a DCP timeline's name starts with its time), then step. Equal indices are the same version, a greater one a newer
save. A version saved with another world size than this save's is left out: it is restorable only once every rank of
its own world holds it. A rank without a history (its first save in this process, a writer set up without a rank, a
planner that drops ``storage_data``) makes the floor None: the stores list the cluster when they evict, as before.
The floor trails the newest save by one: a save's floor is the save before it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from trainer_client.floor import WINDOW, agreed_floor, encode, reduced

Committed = tuple[int, str, int]  # a version a rank saw committed: (step, timeline, world size)

_HISTORIES: dict[tuple[str, str, int], list[Committed]] = {}  # (store address, job, rank) -> the newest WINDOW, oldest first
_LOCK = threading.Lock()


@dataclass(frozen=True)
class SaveHistory:
    """What one rank's local plan tells the coordinator (its ``SavePlan.storage_data``): its rank in the save's group and
    the versions of the job it saw committed, oldest first. Pickled by DCP's gather: plain fields only."""

    rank: int
    committed: tuple[Committed, ...]


def remember_committed(address: str, job_id: str, rank: int, version: Committed) -> None:
    """This process saw its shard of ``version`` settled, saved as ``rank`` through the store at ``address``."""
    with _LOCK:
        seen = _HISTORIES.setdefault((address, job_id, rank), [])
        if version not in seen:
            seen.append(version)
            del seen[:-WINDOW]


def save_history(address: str, job_id: str, rank: int) -> SaveHistory:
    """What ``rank``'s local plan carries: the versions this process saw it commit through the store at ``address``."""
    with _LOCK:
        return SaveHistory(rank, tuple(_HISTORIES.get((address, job_id, rank), ())))


def agree_floor(histories: list[Any], world_size: int) -> tuple[int, str] | None:
    """The floor of a save by ``world_size`` ranks: (step, timeline) of the newest version that every one of them
    committed, from their local plans' ``storage_data`` (``histories[i]``: rank i's); None if there is none, or a
    rank sent no :class:`SaveHistory` of its own."""
    if len(histories) != world_size:
        return None
    mine: list[list[tuple[int, str]]] = []
    for rank, h in enumerate(histories):
        if not isinstance(h, SaveHistory) or h.rank != rank:
            return None
        mine.append([(step, timeline) for step, timeline, world in h.committed if world == world_size])
    order = sorted({v for versions in mine for v in versions}, key=lambda v: (v[1], v[0]))
    index = {v: i for i, v in enumerate(order)}
    found = agreed_floor(reduced([encode([index[v] for v in versions]) for versions in mine]))
    return None if found is None else order[found]
