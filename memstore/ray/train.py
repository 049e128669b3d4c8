"""Ray Train jobs that checkpoint every step into memstore and resume from it after a failure.

The bytes stay in memstore (RAM of the nodes, replicated; the durable tier when the stores spill). Ray Train
keeps only a tiny *pointer* checkpoint, ``memstore.json`` = (job id, step, timeline, world size), reported
with ``ray.train.report`` for steps memstore has committed on every rank. When Ray Train restarts the
worker group (a worker killed, a node lost), ``ray.train.get_checkpoint()`` hands the newest pointer to the
new workers and each rank loads its shard of exactly that save::

    def train_func(config):
        ckpt = RayTrainCheckpoints()                   # job id = the Ray Train run's name
        model, opt = build()
        start = 0
        restored = ckpt.restore()                      # None on a fresh start
        if restored is not None:
            step, state = restored
            model.load_state_dict(state["model"]); opt.load_state_dict(state["optim"])
            start = step + 1
        for step in range(start, config["steps"]):
            train_one_step(model, opt, step)
            ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict()}, metrics={"loss": loss})
        ckpt.finish()

``save`` is pipelined: it captures step *s* (one memcpy) and reports the pointer of step *s-1*, whose
copies had a whole training step to reach R; it waits only if they have not. Every rank waits for its own
copies of *s-1* before it enters ``ray.train.report``, which is a barrier across the workers, so the
pointer Ray Train registers names a step that is restorable on every rank. ``finish`` reports the last
step. memstore's retention (``--keep``, spill retention) is independent of Ray Train's ``num_to_keep``:
keep ``--keep`` >= 2 so the step a pointer names is still in RAM when the next one is reported.

``restore`` also prepares the first save after a restart (:func:`trainer_client.warmup.prepare_once`): the state
it loaded is what the next save will be like, so each rank's capture ring is filled before training resumes and
that save is a memcpy instead of the store making memory. A fresh start has no state before its first save, and
preparing right before that save would make it slower (:mod:`trainer_client.warmup`): that one save makes its
memory, and the ring fills after it in the background.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import ray.train

from memstore.errors import RayTrainError
from memstore.ray.stores import DEFAULT_NAMESPACE, local_store_connection
from trainer_client import CheckpointClient, Connection, SaveHandle
from trainer_client.connection import CLIENT_OPTIONS, DEPRECATED_KWARGS, check_options, connection_from_kwargs
from trainer_client.errors import NotFoundError
from trainer_client.warmup import prepare_once

POINTER_FILE = "memstore.json"
POINTER_FORMAT = "memstore.ray.pointer/1"


@dataclass(frozen=True)
class Pointer:
    """What Ray Train keeps of a memstore checkpoint."""

    job_id: str
    step: int
    timeline: str
    world_size: int
    namespace: str

    def write(self, directory: str) -> None:
        with open(os.path.join(directory, POINTER_FILE), "w") as f:
            json.dump({"format": POINTER_FORMAT, **asdict(self)}, f)

    @classmethod
    def read(cls, directory: str) -> Pointer:
        path = os.path.join(directory, POINTER_FILE)
        try:
            with open(path) as f:
                doc = json.load(f)
        except FileNotFoundError:
            raise RayTrainError(f"Ray Train's checkpoint at {directory} has no {POINTER_FILE}: not from memstore.ray.train") from None
        except (OSError, ValueError) as exc:
            raise RayTrainError(f"{path}: cannot read the memstore pointer: {exc}") from None
        types = {"job_id": str, "step": int, "timeline": str, "world_size": int, "namespace": str}
        if not isinstance(doc, dict) or doc.get("format") != POINTER_FORMAT or any(not isinstance(doc.get(k), t) for k, t in types.items()):
            raise RayTrainError(f"{path}: not a memstore pointer: expected format {POINTER_FORMAT!r} with {', '.join(types)}")
        return cls(**{k: doc[k] for k in types})


def job_id_for(run_name: str) -> str:
    """A memstore job id from a Ray Train run name: invalid characters become '-', at most 128 characters."""
    return (re.sub(r"[^A-Za-z0-9._-]", "-", run_name) or "ray-train")[:128]


def _on_every_rank(flag: bool) -> bool:
    """True if ``flag`` is true on every rank of the default process group (Ray Train's TorchTrainer sets it up)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    box = torch.tensor([1 if flag else 0])
    dist.all_reduce(box, op=dist.ReduceOp.MIN)
    return bool(box.item())


def _from_rank_0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank of the default process group (``value`` itself without one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class RayTrainCheckpoints:
    """Checkpoints of one Ray Train worker: created inside the train function, one per worker.

    Args:
        job_id: the memstore job; default: the Ray Train run's name (``RunConfig(name=...)``), which stays
            the same when Ray Train restarts the workers of that run.
        namespace: the memstore cluster (``ensure_stores(namespace=...)``).
        connection: how to reach the store (:class:`trainer_client.Connection`: timeout, credentials, ...); its
            address defaults to the store of this worker's node, its credentials to the environment's or else the
            cluster token ``ensure_stores`` created (``local_store_connection``).
        client_options: the other options of :class:`trainer_client.CheckpointClient` (``on_capacity``,
            ``run_id``, ...); another name is a ``TypeError`` when the object is made. Its connection options
            (``timeout=``, ``auth_token=``, ...) still work for one release, with a ``DeprecationWarning``: put them
            in ``connection``.
    """

    def __init__(self, job_id: str | None = None, *, namespace: str = DEFAULT_NAMESPACE, connection: Connection | None = None,
                 **client_options: Any) -> None:  # fmt: skip
        old = {name: client_options.pop(name) for name in DEPRECATED_KWARGS if name in client_options}
        check_options("RayTrainCheckpoints", client_options, CLIENT_OPTIONS, "job_id, namespace=, connection= and the client's ")
        connection = connection_from_kwargs("RayTrainCheckpoints", connection, old)
        ctx = ray.train.get_context()
        self.rank = ctx.get_world_rank()
        self.world_size = ctx.get_world_size()
        self.namespace = namespace
        self.job_id = job_id or job_id_for(ctx.get_experiment_name())
        connection = local_store_connection(connection, namespace=namespace)  # the node's store, the cluster's token
        self.client = CheckpointClient(self.job_id, self.rank, self.world_size, connection=connection, **client_options)
        self._unreported: SaveHandle | None = None
        self.reported_step: int | None = None  # the newest step this worker reported a pointer for
        self.last_capture_seconds = 0.0  # the last save's stall: capture into the store (the training step waits this long)
        self.last_report_seconds = 0.0  # the last report: waiting for the previous step's copies, plus ray.train.report

    def restore(self) -> tuple[int, Any] | None:
        """``(step, state)`` to resume from; None on a fresh start (Ray Train has no checkpoint of this run).

        The step is the one Ray Train's newest pointer names, or a newer one memstore holds for every rank of
        this job: a failure can come before Ray Train registers the last reported pointers, and memstore's
        newest restorable step is never older than a committed save. Every rank gets rank 0's answer (a
        broadcast over the process group TorchTrainer sets up).
        Each rank then prepares its next save's memory for a state like the one loaded (a failure is logged, never
        raised: that save then allocates its memory)."""
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return None
        with checkpoint.as_directory() as directory:
            pointer = Pointer.read(directory)
        if pointer.job_id != self.job_id or pointer.world_size != self.world_size:
            raise RayTrainError(
                f"Ray Train's checkpoint points at job {pointer.job_id!r} saved by {pointer.world_size} ranks; this worker is job "
                f"{self.job_id!r} with {self.world_size} ranks (memstore.ray.train restores the same job and world size)"
            )
        step, timeline = pointer.step, pointer.timeline
        newest = self.client.restore_point()  # Ray Train may not have registered the last pointers before the failure
        if newest is not None and newest.step > step:
            step, timeline = newest.step, newest.timeline
        step, timeline = _from_rank_0((step, timeline))  # a copy finishing between two ranks' questions must not split them
        try:
            state = self.client.load(step, timeline=timeline)  # zero-copy: copy-on-write views of the store's memory
        except NotFoundError as exc:
            raise RayTrainError(
                f"Ray Train's checkpoint points at step {pointer.step} of job {pointer.job_id!r}, which memstore cannot restore: {exc}"
            ) from exc
        self.reported_step = step
        prepare_once(self.client, state)
        return step, state

    def save(self, step: int, state: Any, metrics: Mapping[str, float] | None = None, *, report: bool = True) -> SaveHandle:
        """Capture ``state`` for ``step``, then report ``metrics`` to Ray Train with the pointer of the previous save.

        Every worker calls it at the same steps with the same ``report`` (``ray.train.report`` is a barrier
        across the workers). ``report=False`` only captures: a ``ray.train.report`` round costs Ray Train
        about 2 s on a small cluster (docs/ray.md), so save every step and report every N steps; resume
        still starts from memstore's newest step restorable on every rank, not from the reported one."""
        t0 = time.perf_counter()
        handle = self.client.save(step, state, metrics)
        t1 = time.perf_counter()
        previous, self._unreported = self._unreported, handle
        if report:
            self._report(dict(metrics or {}), previous)
        self.last_capture_seconds, self.last_report_seconds = t1 - t0, time.perf_counter() - t1
        return handle

    def finish(self, metrics: Mapping[str, float] | None = None) -> None:
        """Report the pointer of the last save (waits for its copies); call once after the last ``save``."""
        last, self._unreported = self._unreported, None
        self._report(dict(metrics or {}), last)

    def _report(self, metrics: dict[str, Any], handle: SaveHandle | None) -> None:
        committed = handle is not None and not handle.skipped
        if self.client.on_capacity == "skip":
            committed = _on_every_rank(committed)  # a rank that skipped this step makes its pointer unrestorable
        if committed:
            assert handle is not None
            handle.wait()  # every rank: its own copies of this step are verified before the barrier in report()
            metrics["memstore_step"] = handle.step
        if not committed or self.rank != 0:
            ray.train.report(metrics, checkpoint=None)
            return
        assert handle is not None
        pointer = Pointer(self.job_id, handle.step, handle.timeline, self.world_size, self.namespace)
        with tempfile.TemporaryDirectory(prefix="memstore-pointer-") as directory:
            pointer.write(directory)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))
        self.reported_step = handle.step

    def close(self) -> None:
        self.client.close()
