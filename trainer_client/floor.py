"""The restorable floor: at each save the ranks agree on the newest step they have all saved.

With ``CheckpointClient(group=<the job's process group>)``, every ``save()`` of the client's own timeline starts one
all-reduce over the group, asynchronous (the trainer does not wait for it), of what this rank knows of its earlier
saves: the steps its store reported committed. Its result is a step every rank saved, a lower bound of the newest
restorable step (``memstore.core.floors``). The store learns it with messages the client sends anyway: the
commit of the save carries the newest floor already agreed (the trainer never waits for one), and a background
watcher, which asks the store when each save has settled (``WaitCommitted``, what tells the next agreement that
the save is committed), sends this save's floor as soon as its all-reduce is back. Retention then never lists the
cluster, and the floor trails the newest save by one: with ``--keep`` 2 a store holds the same two steps as before.
When the store takes each save's segment as the save comes (``AllocateResponse.reserve_at_save``: ``--redundancy
ec:K+M`` with ``--keep`` 2 or more), the save's ``Allocate`` carries this save's floor (:meth:`FloorAgreement.agreed`,
waiting at most ``ALLOCATE_WAIT_SECONDS`` for its all-reduce): the store retires the rank's oldest kept step for the
save's segment only below a step every rank saved (``memstore.server.engine.recycling``).

Encoding: a vector of ``2 * WINDOW`` int64, this rank's ``WINDOW`` newest committed steps (newest first, -1 where it has
fewer), then their negations. One MIN all-reduce gives at position i the least of the ranks' i-th newest steps and
the negated greatest: where the two are equal, every rank committed that very step. The floor is the greatest such
step. Ranks that saved the same steps (the usual case) agree at position 0, on the newest step all of them committed;
a rank that missed a save shifts its positions, and a position then agrees on an older step or on none: the floor
lags, it is never wrong.

Internal to ``CheckpointClient``; not public API. Every rank of the group must call ``save()`` for every step it
saves (as for the save to be restorable at all): the all-reduce is a collective.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from trainer_client.agreement import collective_device, group_problem
from trainer_client.errors import MemstoreClientError, NotFoundError
from trainer_client.handles import SaveResult

log = logging.getLogger(__name__)

WINDOW = 8  # committed steps per rank in one agreement
STATUS_WAIT_SECONDS = 60.0  # one WaitCommitted of the watcher
AGREEMENT_WAIT_SECONDS = 10.0  # how long the watcher waits for a save's all-reduce (every rank must reach the save)
AGREEMENT_POLL_SECONDS = 0.002
# How long a save whose store takes its segment when it comes (``AllocateResponse.reserve_at_save``) waits for its own
# all-reduce before its Allocate, which carries the floor agreed: the ranks of a data-parallel job reach the save
# together, so it is back in about one collective's latency. Not back in time: the Allocate carries the floor known.
ALLOCATE_WAIT_SECONDS = 1.0
CLOSE_WAIT_SECONDS = 5.0  # close() lets the last save's watch tell the store its floor, for at most this long
NOT_FOUND_RETRIES = 50  # a remote save sent in the background may not have reached its store yet: ask again


@dataclass
class _Pending:
    step: int
    timeline: str
    work: Any
    values: torch.Tensor
    source: torch.Tensor | None  # the pinned host copy an all-reduce on the GPU was filled from (kept until it is done)


def agreed_floor(values: list[int]) -> int | None:
    """The floor the reduced vector (see the module doc) shows: the greatest step every rank has at one position."""
    window = len(values) // 2
    agreed = [values[i] for i in range(window) if values[i] >= 0 and values[i] == -values[window + i]]
    return max(agreed, default=None)


def encode(steps: list[int]) -> list[int]:
    """This rank's vector: its newest ``WINDOW`` committed steps, newest first, padded with -1, then their negations."""
    newest = sorted(steps, reverse=True)[:WINDOW]
    newest += [-1] * (WINDOW - len(newest))
    return newest + [-s for s in newest]


def reduced(vectors: list[list[int]]) -> list[int]:
    """What the MIN all-reduce makes of the ranks' vectors, computed where they were gathered (the DCP coordinator:
    ``trainer_client.dcp.floors``)."""
    return [min(column) for column in zip(*vectors, strict=True)]


class FloorAgreement:
    """One client's part in the agreement: the steps it saw committed, the all-reduces in flight, the floors agreed.

    ``status(step, timeline, wait, floor)``: ``CheckpointClient.save_status`` telling the store ``floor`` too, asked on
    one background thread after each save.
    """

    def __init__(
        self, group: Any, rank: int, world_size: int, status: Callable[[int, str, float, int | None], tuple[SaveResult, bool]]
    ) -> None:
        _, problem = group_problem(group, rank, world_size)
        if problem is not None:
            raise problem
        self.group = group
        self.device = collective_device(group)
        self._status = status
        self._lock = threading.Lock()
        self._committed: dict[str, list[int]] = {}  # timeline -> steps this rank saw committed (the newest WINDOW)
        self._floors: dict[str, int] = {}  # timeline -> the newest floor agreed
        self._pending: list[_Pending] = []
        self._watcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memstore-floor")
        self._last_watch: Future[None] | None = None
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.collectives = 0

    # -- on the trainer's thread, in save() ---------------------------------------------------------------
    def start(self, step: int, timeline: str) -> None:
        """Start this save's all-reduce (every rank starts one in the same save): it is read by a later ``floor()``."""
        import torch.distributed as dist

        self._harvest()
        with self._lock:
            steps = list(self._committed.get(timeline, ()))
        host = torch.tensor(encode(steps), dtype=torch.int64)
        source = None
        if self.device.type == "cuda":  # a pinned source and an asynchronous copy: the trainer's stream is not waited for
            source = host.pin_memory()
            host = source.to(self.device, non_blocking=True)
        work = dist.all_reduce(host, op=dist.ReduceOp.MIN, group=self.group, async_op=True)
        self.collectives += 1
        with self._lock:
            self._pending.append(_Pending(step, timeline, work, host, source))

    def saved(self, step: int, timeline: str) -> None:
        """A save of this client's own timeline went through: learn in the background when its store has it committed."""
        self._last_watch = self._watcher.submit(self._watch, step, timeline)

    # -- any thread ---------------------------------------------------------------------------------------
    def floor(self, timeline: str, step: int) -> int | None:
        """The newest floor agreed for ``timeline`` so far, for a save of ``step`` (None: none yet, or none below
        ``step``); never waits for an all-reduce."""
        self._harvest()
        with self._lock:
            floor = self._floors.get(timeline)
        return floor if floor is not None and floor <= step else None

    def agreed(self, timeline: str, step: int, wait: float) -> int | None:
        """:meth:`floor`, once this save's all-reduce (of ``step``, started by :meth:`start`) is back, waiting at most
        ``wait`` seconds for it (the floor known then, if it is not)."""
        self._await_agreement(step, timeline, wait)
        return self.floor(timeline, step)

    def close(self) -> None:
        """Stop watching; the last save's watch gets a few seconds to tell the store its floor (else the store keeps one
        step more until the job's next save)."""
        last = self._last_watch
        self._watcher.shutdown(wait=False)
        if last is not None:
            with contextlib.suppress(Exception):
                last.result(timeout=CLOSE_WAIT_SECONDS)
        # Let go of the process group and its collectives now: a closed client must not keep the job's group (its
        # connections to every rank) alive until the garbage collector breaks a cycle that holds the client.
        with self._lock:
            self._pending = []
        self.group = None

    def _harvest(self) -> None:
        with self._lock:
            done = [p for p in self._pending if p.work.is_completed()]
            self._pending = [p for p in self._pending if p not in done]
        for p in done:
            try:
                values = self._read(p)
            except Exception as exc:  # a failed all-reduce (a rank gone): its buffer may hold this rank's own vector
                log.debug("restorable floor: the all-reduce of step %d failed: %s", p.step, exc)
                continue
            floor = agreed_floor(values)
            if floor is None:
                continue
            with self._lock:
                self._floors[p.timeline] = max(floor, self._floors.get(p.timeline, floor))

    def _read(self, p: _Pending) -> list[int]:
        """The reduced vector of a completed all-reduce; raises if it failed (then it is no agreement at all)."""
        if self._stream is None:
            p.work.wait()
            return [int(v) for v in p.values.tolist()]
        with torch.cuda.stream(self._stream):  # a stream of its own: the trainer's queued kernels are not waited for
            p.work.wait()
            values = p.values.to("cpu")
        return [int(v) for v in values.tolist()]

    def _await_agreement(self, step: int, timeline: str, wait: float = AGREEMENT_WAIT_SECONDS) -> None:
        """Wait (at most ``wait`` seconds) for the all-reduce this save started: once every rank reached the save it is
        back."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            with self._lock:
                mine = [p for p in self._pending if p.step == step and p.timeline == timeline]
            if not mine or mine[0].work.is_completed():
                self._harvest()
                return
            time.sleep(AGREEMENT_POLL_SECONDS)

    def _watch(self, step: int, timeline: str) -> None:
        self._await_agreement(step, timeline)
        for _ in range(NOT_FOUND_RETRIES):
            try:
                result, done = self._status(step, timeline, STATUS_WAIT_SECONDS, self.floor(timeline, step))
            except NotFoundError:
                time.sleep(0.1)
                continue
            except MemstoreClientError as exc:
                log.debug("restorable floor: status of step %d: %s", step, exc)
                return
            if done:
                self.observed(step, timeline, result)
                return

    def observed(self, step: int, timeline: str, result: SaveResult) -> None:
        """A settled status of this rank's save of ``step`` (the watcher's, or a ``handle.wait()``'s): remember it if the
        store holds it verified, restorable as far as this rank goes."""
        if result.copies < 1 or result.superseded:
            return
        with self._lock:
            steps = self._committed.setdefault(timeline, [])
            if step not in steps:
                steps.append(step)
                steps.sort()
                del steps[:-WINDOW]
