"""The restorable floor: what a store knows of the newest restorable step without asking the cluster.

A job's ranks, when their client was given the job's process group (``CheckpointClient(group=...)``), agree at
each save on the newest step of their timeline that every rank has saved (one all-reduce, see
``trainer_client.floor``). That step is restorable, so the newest restorable step is at or above it: a *floor*,
never newer than the truth. The ranks send it with the Commit they send anyway, and each store passes it on with
the replicas it pushes (``PutHeader.restorable_floor``): every store holding a copy of the job's newest save learns
it with no message of its own. Under ec:K+M with ``--keep`` 2 or more a save's ``Allocate`` carries this save's floor
too, so that the store may retire the rank's oldest kept step for it (``memstore.server.engine.recycling``).

Retention (``memstore.core.retention``) then keeps every version at or above the floor, whatever ``--keep`` says,
and evicts below it without listing the cluster: a version below the floor is never the newest restorable one.
A floor that lags (a rank's save is slow, an all-reduce result not back yet) only keeps more.

A floor names a version, (step, timeline). The ranks of a ``CheckpointClient`` agree on a step of the timeline they
save to, and send the step alone (``restorable_floor``: a step of the saved shard's own timeline). A DCP save names a
timeline of its own (``trainer_client.dcp``), and its ranks agree on an earlier save's version, of another timeline:
they send both (``restorable_floor_version``). :func:`sent_floor` makes the version of either.

Copies lost after the floor was agreed (R hosts failing at once) can make it newer than the truth. Until the job
restores, retention keeps what it kept before the loss (the floor's step and above); a restore tells each store
which version the ranks agreed on (``Floors.restoring``, at every Fetch), and the floor falls to it, so the copy
being restored, pulled from a peer or the durable tier, is never evicted under it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Floor:
    """Every rank of the job saved ``step`` of ``timeline``: it, or a newer version, is the newest restorable."""

    step: int
    timeline: str

    @property
    def version(self) -> tuple[int, str]:
        return self.step, self.timeline


def floor_problem(floor: int, step: int, timeline: str = "") -> str | None:
    """Why a floor sent with a save of ``step`` is invalid (None if it is not): it names an earlier save of the job.

    ``timeline`` "": the floor is a step of the saved shard's own timeline, at most the saved step. Else the floor is
    ``floor`` of ``timeline``, another save's (any step: a job that went back saves lower steps on a newer timeline);
    the wire's conversion checked the timeline's name."""
    if timeline:
        return f"restorable_floor_version step {floor} is invalid: expected a step >= 0" if floor < 0 else None
    if floor < 0 or floor > step:
        return f"restorable_floor {floor} is invalid: expected a step from 0 to the saved step {step}"
    return None


def sent_floor(floor: int | None, timeline: str, saved_timeline: str) -> Floor | None:
    """The version a floor sent with a save of ``saved_timeline`` names: ``floor`` of ``timeline`` ("": of the save's)."""
    return None if floor is None else Floor(floor, timeline or saved_timeline)


class Floors:
    """Per job, the newest floor a store heard of (thread-safe).

    A floor of the same timeline only moves up; a floor of another timeline replaces it (the ranks moved to a new
    timeline, a rollback: its saves are the newest whatever their step numbers). Either is a safe bound.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._floors: dict[str, Floor] = {}

    def note(self, job_id: str, floor: Floor) -> bool:
        """Record ``floor`` for ``job_id``; True if it moved."""
        with self._lock:
            old = self._floors.get(job_id)
            if old is not None and old.timeline == floor.timeline and old.step >= floor.step:
                return False
            self._floors[job_id] = floor
            return True

    def restoring(self, job_id: str, version: Floor) -> None:
        """The job's ranks restore ``version`` (a Fetch of it): they agreed it is the newest restorable one, whatever
        floor came before. Copies lost since (R hosts failing at once) can leave an older floor behind the truth's
        fall: from now on nothing at or above ``version`` goes, the copy being restored included. A job without a
        floor keeps none: its retention lists the cluster, which protects the newest restorable step itself."""
        with self._lock:
            old = self._floors.get(job_id)
            if old is not None and (old.timeline != version.timeline or old.step > version.step):
                self._floors[job_id] = version

    def get(self, job_id: str) -> Floor | None:
        with self._lock:
            return self._floors.get(job_id)

    def forget(self, job_id: str) -> None:
        with self._lock:
            self._floors.pop(job_id, None)
