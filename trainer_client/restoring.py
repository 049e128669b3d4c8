"""The restore half of a client: which version to read, then reading it.

``CheckpointClient.latest_step``, ``restore_point`` and ``load`` delegate to one :class:`Restorer`:

- **which version**: with the job's process group, the ranks agree on it (``trainer_client.agreement``): each asks only
  its own store about its own shard (``LatestStep`` with its rank), and rank 0 asks the cluster when their views cannot
  decide; without one, every call asks the cluster (each store lists every store). A version is one timeline of one
  step, so a restore never mixes two saves of a step.
- **reading it** (``trainer_client.reading.ShardReader``): this rank's shard, verified; for a stripe of a replica
  group, the group's other stripes too (opened with it when the local store holds them, else fetched on a small
  pool meanwhile), assembled into the whole state (``trainer_client.stripes``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from memstore.core.agreement import Seen
from memstore.v1 import store_pb2 as pb
from memstore.v1.keys import job_id_problem, key_problem
from trainer_client.agreement import Agreements, AgreementStats, ClusterAnswer, LocalAnswer, agree
from trainer_client.capture.device_restore import parse_map_location, prepare_bounce_ring
from trainer_client.errors import InvalidArgumentError, NoCheckpointError, NotFoundError
from trainer_client.handles import RestorePoint
from trainer_client.reading import ShardReader
from trainer_client.stripes import is_stripe, stripe_members, whole_state
from trainer_client.transport.link import StoreLink
from trainer_client.transport.messages import shard_key

log = logging.getLogger(__name__)


class Restorer:
    """One client's restores (``job_id``, ``rank`` of ``world_size``), through ``link`` and ``reader``.

    ``last_load_source`` names the host the last load's copy came from; ``last_restore_note`` why the last lookup found
    nothing, when a store said; ``agreement`` what the last agreement cost, the point it agreed and the versions known
    complete on the durable tier. ``CheckpointClient.stats()`` reports them.
    """

    def __init__(self, job_id: str, rank: int, world_size: int, link: StoreLink, reader: ShardReader, agreement: Agreements) -> None:
        self.job_id, self.rank, self.world_size = job_id, rank, world_size
        self._link = link
        self._reader = reader
        self.agreement = agreement
        self.last_load_source = ""
        self.last_restore_note = ""

    def latest_step(self, agreed_over: Any) -> int | None:
        """``CheckpointClient.latest_step`` with its group resolved (None: the cluster-wide answer)."""
        point = self.restore_point(step=None, agreed_over=agreed_over)
        self.agreement.point = point if agreed_over is not None else None
        if point is not None and point.world_size != self.world_size:
            raise InvalidArgumentError(
                f"step {point.step} of job {self.job_id} was saved by {point.world_size} ranks but this client has world_size "
                f"{self.world_size}; resharding needs trainer_client.dcp"
            )
        return None if point is None else point.step

    def restore_point(self, step: int | None, agreed_over: Any) -> RestorePoint | None:
        """``CheckpointClient.restore_point`` with its group resolved: agreed over it, or the cluster-wide answer (None)."""
        problem = job_id_problem(self.job_id) or (None if step is None else key_problem(self.job_id, step, 0))
        if problem:
            raise InvalidArgumentError(problem)
        if agreed_over is not None:
            return self._agreed_point(step, agreed_over)
        return self._cluster_answer(step)[0]

    def _agreed_point(self, step: int | None, group: Any) -> RestorePoint | None:
        self.agreement.stats = stats = AgreementStats()
        link = self._link

        def ask_local() -> LocalAnswer:
            request = pb.LatestStepRequest(job_id=self.job_id, ranks=[self.rank], include_durable=self.rank == 0)
            stats.rpcs += 1
            resp = link.unary("LatestStep", request, "latest_step", retries=3)
            seen = [Seen(v.step, v.timeline, v.world_size, v.created_unix, tuple(v.ranks), v.durable) for v in resp.versions]
            return seen, not resp.unreachable_hosts

        def ask_cluster() -> ClusterAnswer:
            stats.rpcs += 1
            point, unreachable = self._cluster_answer(step)
            return (None if point is None else Seen(point.step, point.timeline, point.world_size, 0.0)), not unreachable

        agreed = agree(group, self.rank, self.world_size, step, ask_local, ask_cluster, stats)
        if agreed is None:
            self.last_restore_note = self.last_restore_note if stats.fallback else ""
            return None
        self.last_restore_note = ""
        if agreed.durable:
            self.agreement.durable.add((agreed.step, agreed.timeline))
        return RestorePoint(agreed.step, agreed.world_size, agreed.timeline)

    def _cluster_answer(self, step: int | None) -> tuple[RestorePoint | None, list[str]]:
        """The cluster-wide LatestStep: its version, and the stores that did not answer it."""
        request = pb.LatestStepRequest(job_id=self.job_id, step=step)
        try:
            resp = self._link.unary("LatestStep", request, "latest_step", retries=3)
        except NotFoundError as exc:  # the job is unknown to every store
            self.last_restore_note = str(exc)
            return None, []
        unreachable = list(resp.unreachable_hosts)
        if not resp.found:
            if resp.note:
                log.warning("job %s has no restorable step: %s", self.job_id, resp.note)
            self.last_restore_note = resp.note
            return None, unreachable
        self.last_restore_note = ""
        return RestorePoint(int(resp.step), int(resp.world_size), resp.timeline), unreachable

    def load(
        self, step: int | None, rank: int | None, zero_copy: bool, timeline: str | None, map_location: str | torch.device | None,
        agreed_over: Callable[[], Any],
    ) -> Any:  # fmt: skip
        """``CheckpointClient.load``; ``agreed_over`` resolves its group (asked only when the version is to be found)."""
        device = parse_map_location(map_location)
        if device is not None and device.type == "cuda":
            prepare_bounce_ring()  # registered while the version is agreed and the store opens the shard (once per process)
        if timeline is None or step is None:
            group = agreed_over()
            agreed, self.agreement.point = self.agreement.point, None
            reuse = group is not None and agreed is not None and agreed.step == step
            point = agreed if reuse else self.restore_point(step, group)
            if point is None:
                note = f": {self.last_restore_note}" if self.last_restore_note else ""
                if step is None:
                    raise NoCheckpointError(
                        f"job {self.job_id!r} has no restorable step: no step has a verified copy of one save for all "
                        f"{self.world_size} ranks{note}"
                    )
                raise NotFoundError(
                    f"step {step} of job {self.job_id!r} is not restorable: no save of it has a verified copy of every rank{note}"
                )
            step, timeline = point.step, point.timeline
        key = shard_key(self.job_id, step, self.rank if rank is None else rank, self.world_size, timeline)
        others: dict[int, Future[Any]] = {}
        pools: list[ThreadPoolExecutor] = []  # made only for a stripe to fetch: an ordinary load starts no thread
        opened: dict[int, Any] = {}  # other stripes the store opened with this rank's (shared memory: one call)

        def fetch_others(group: list[int]) -> None:  # a stripe: its group's other stripes are fetched meanwhile
            for r in group:
                if r != key.rank and r not in others and r not in opened:
                    if not pools:
                        pools.append(ThreadPoolExecutor(max_workers=8, thread_name_prefix="memstore-stripes"))
                    other = shard_key(self.job_id, key.step, r, self.world_size, key.timeline)
                    others[r] = pools[0].submit(self._reader.read_stripe, other)

        try:
            state = self._reader.fetch_and_read(key, zero_copy, device, fetch_others, on_source=self._loaded_from, stripes=opened)
            if not is_stripe(state):
                return state
            fetch_others(stripe_members(state))  # not held here, or a store that did not name the group in the manifest
            stripes = {**opened, **{r: f.result() for r, f in others.items()}}
        finally:
            for pool in pools:
                pool.shutdown(wait=True)
        return whole_state(key.rank, key.step, state, stripes, device, zero_copy)

    def _loaded_from(self, source: str) -> None:
        self.last_load_source = source
