"""PyTorch Lightning checkpoints in memstore: ``Trainer(plugins=[MemStoreCheckpointIO("my-run")])``.

Lightning names every checkpoint by a filesystem path (``ModelCheckpoint`` builds it, lists its directory for
``ckpt_path="last"``, removes old ones for ``save_top_k``); memstore names a shard by (job, step, rank, timeline).
The plugin maps one to the other explicitly:

* **the bytes** go to memstore: each ``save_checkpoint`` is one shard ``(job_id, step, rank 0, timeline)``, where
  ``step`` counts this job's Lightning saves (the next after the newest step memstore holds for the job, so a
  resumed run goes on counting; Lightning's ``global_step`` is not unique, as ``last.ckpt`` and a top-k checkpoint
  are saved at the same one). Non-tensor entries the shard format cannot hold are pickled
  (:mod:`trainer_client.framework_state`) and loaded back with Lightning's ``weights_only``;
* **the path** gets a *pointer*: a small JSON file (``memstore.lightning.pointer/1``: job id, step, timeline,
  Lightning's ``global_step`` and ``epoch``) written after the store owns the bytes. Lightning's own file logic
  (``ModelCheckpoint`` retention, ``save_last``, ``ckpt_path="last"``, ``save_last="link"``) therefore works
  unchanged, and ``load_checkpoint(path)`` reads exactly the save the pointer names.

**The first save of a resumed run is prepared**: the global-zero process's ``load_checkpoint`` (``fit(ckpt_path=...)``)
holds the state the next save will be like, so it prepares the client with it (:func:`trainer_client.warmup.prepare_once`:
the capture ring filled before training, so that first save is a memcpy instead of the store making memory). A
``CheckpointIO`` gets no hook before the first save of a fresh run, and preparing right before that save would make
it slower (:mod:`trainer_client.warmup`): that one save makes its memory, and the ring fills after it in the
background. (A ``validate``/``test``/``predict`` with ``ckpt_path`` prepares too: the plugin cannot tell them apart.)

``remove_checkpoint`` removes the pointer; the store's RAM is reclaimed by its own retention (``--keep``: the
newest K steps of the job), so a pointer older than the newest ``--keep`` saves names a step the stores dropped
(unless it was spilled): loading it raises ``NotFoundError``. Only the global-zero process saves (Lightning calls
``save_checkpoint`` there); every process loads, each through its own host's store.
"""

from __future__ import annotations

import json
import logging
import math
import os
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import fsspec
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.rank_zero import rank_zero_only

from trainer_client import framework_state
from trainer_client.client import CheckpointClient
from trainer_client.connection import Connection, check_options
from trainer_client.errors import InvalidArgumentError, SerializationError
from trainer_client.handles import SaveHandle
from trainer_client.warmup import prepare_once

log = logging.getLogger(__name__)

POINTER_FORMAT = "memstore.lightning.pointer/1"


@dataclass(frozen=True)
class Pointer:
    """What a Lightning checkpoint path holds: the memstore save it names."""

    job_id: str
    step: int
    timeline: str
    global_step: int
    epoch: int

    def write(self, path: str) -> None:
        """Write the pointer at ``path`` (any fsspec URL) atomically: a temporary file, then a rename."""
        fs, where = fsspec.core.url_to_fs(path)
        fs.makedirs(os.path.dirname(where) or ".", exist_ok=True)
        tmp = f"{where}.tmp-{uuid.uuid4().hex[:8]}"
        with fs.open(tmp, "w") as f:
            json.dump({"format": POINTER_FORMAT, **asdict(self)}, f)
        fs.mv(tmp, where)

    @classmethod
    def read(cls, path: str) -> Pointer:
        fs, where = fsspec.core.url_to_fs(path)
        if not fs.exists(where):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        try:
            with fs.open(where, "r") as f:
                doc = json.load(f)
        except (UnicodeDecodeError, ValueError):
            doc = None
        types = {"job_id": str, "step": int, "timeline": str, "global_step": int, "epoch": int}
        if not isinstance(doc, dict) or doc.get("format") != POINTER_FORMAT or any(not isinstance(doc.get(k), t) for k, t in types.items()):
            raise InvalidArgumentError(
                f"{path} is not a memstore checkpoint pointer (expected JSON of format {POINTER_FORMAT!r}); a file saved by "
                f"Lightning's TorchCheckpointIO loads without this plugin"
            )
        return cls(**{k: doc[k] for k in types})


def monitored_metrics(checkpoint: dict[str, Any]) -> dict[str, float]:
    """The scores ``ModelCheckpoint`` callbacks monitor (``{monitor: current_score}``), for the store's
    ``--spill-keep-best``/``--spill-metric``."""
    out: dict[str, float] = {}
    for name, state in (checkpoint.get("callbacks") or {}).items():
        if not (isinstance(name, str) and name.startswith("ModelCheckpoint") and isinstance(state, dict)):
            continue
        monitor, score = state.get("monitor"), state.get("current_score")
        if isinstance(score, torch.Tensor) and score.numel() == 1:
            score = score.item()
        if isinstance(monitor, str) and isinstance(score, float | int) and not isinstance(score, bool):
            value = float(score)
            if math.isfinite(value):
                out[monitor] = value
    return out


CLIENT_OPTIONS = ("on_capacity", "spill_compression", "run_id", "remote_save")
"""The options of :class:`~trainer_client.CheckpointClient` the plugin passes on (its client is rank 0 of a world of one:
no replica group, no process group)."""


class MemStoreCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves each checkpoint into memstore and writes a pointer at its path.

    Args:
        job_id: the memstore job of this training run, ``[A-Za-z0-9._-]{1,128}``; the same across restarts of the run.
        connection: how to reach the store on this host (:class:`~trainer_client.connection.Connection`); default
            ``Connection()``: ``MEMSTORE_STORE``, else ``127.0.0.1:7070``.
        wait_for_replication: ``save_checkpoint`` returns once the checkpoint has its R verified copies (survives
            the loss of this host). Default False: it returns once the store owns the bytes (survives a crash of the
            trainer), and the next save, and ``teardown`` at the end of ``fit``, first wait for the previous one's copies,
            raising ``ReplicationError`` if they failed.
        zero_copy: loaded tensors are copy-on-write views of the store's memory (Lightning copies them into the
            model and optimizer anyway); False gives tensors with memory of their own.
        client_options: the other options of :class:`~trainer_client.CheckpointClient` (``on_capacity``,
            ``spill_compression``, ``run_id``, ``remote_save``).
    """

    def __init__(self, job_id: str, *, connection: Connection | None = None, wait_for_replication: bool = False,
                 zero_copy: bool = True, **client_options: Any) -> None:  # fmt: skip
        super().__init__()
        takes = "job_id, connection=, wait_for_replication=, zero_copy= and the client's "
        check_options("MemStoreCheckpointIO", client_options, CLIENT_OPTIONS, takes)  # when the plugin is made, not inside fit
        self.job_id = job_id
        self.connection = (connection or Connection()).resolved()
        self.wait_for_replication = wait_for_replication
        self.zero_copy = zero_copy
        self.client_options = client_options
        self._client: CheckpointClient | None = None
        self._next_step: int | None = None
        self._pending: SaveHandle | None = None
        self.last_handle: SaveHandle | None = None  # the last save's handle (its stall_seconds, wait())

    @property
    def client(self) -> CheckpointClient:
        """This process's client, rank 0 of a world of one (Lightning saves from the global-zero process only)."""
        if self._client is None:
            self._client = CheckpointClient(self.job_id, 0, 1, connection=self.connection, **self.client_options)
        return self._client

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` as the job's next step, then write its pointer at ``path``."""
        if storage_options is not None:
            raise TypeError(f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by {type(self).__name__}")
        client = self.client
        previous, self._pending = self._pending, None
        if previous is not None:
            previous.wait()  # it had a whole interval to reach R copies; a failure is reported here
        step = self._step()
        metrics = monitored_metrics(checkpoint)
        try:
            handle = client.save(step, framework_state.wrap(checkpoint), metrics)
        except SerializationError:  # an entry the shard format cannot hold (a hyperparameter object): pickled
            handle = client.save(step, framework_state.pack(checkpoint), metrics)
        self._next_step = step + 1
        self.last_handle = handle
        if handle.skipped:  # on_capacity="skip": no checkpoint, so no pointer
            log.warning("memstore skipped checkpoint %s (store full); no pointer written", path)
            return
        if self.wait_for_replication:
            handle.wait()
        else:
            self._pending = handle
        global_step, epoch = checkpoint.get("global_step", -1), checkpoint.get("epoch", -1)
        Pointer(self.job_id, step, handle.timeline, int(global_step), int(epoch)).write(str(path))

    def _step(self) -> int:
        if self._next_step is None:
            newest = self.client.restore_point()  # a resumed run counts on from the newest step the job has
            self._next_step = 0 if newest is None else newest.step + 1
        return self._next_step

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint the pointer at ``path`` names; its pickled entries loaded with ``weights_only``.

        ``map_location``: None or ``"cpu"`` (CPU tensors), or a device / device string every tensor lands on. In the
        global-zero process (the one that saves), before this plugin's first save, it also prepares the next save's
        memory for a state like the one loaded (never failing the load: a failure is logged).
        """
        if map_location is not None and not isinstance(map_location, str | torch.device):
            raise InvalidArgumentError(
                f"map_location {map_location!r} is not supported by {type(self).__name__}: expected None, a device or its name"
            )
        pointer = Pointer.read(str(path))
        client = self.client if pointer.job_id == self.job_id else CheckpointClient(pointer.job_id, 0, 1, connection=self.connection)
        try:
            stored = client.load(pointer.step, timeline=pointer.timeline, zero_copy=self.zero_copy, map_location=map_location)
        finally:
            if client is not self._client:
                client.close()
        global_rank = getattr(rank_zero_only, "rank", 0)  # set by Lightning's strategy (an attribute of the function)
        if global_rank == 0 and self._next_step is None:  # Lightning saves from global zero; this client saved nothing yet
            prepare_once(self.client, stored)
        return framework_state.unpack(stored, weights_only=weights_only, map_location=map_location)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer at ``path``; the store drops the step by its own retention (``--keep``)."""
        fs, where = fsspec.core.url_to_fs(str(path))
        if fs.exists(where):
            fs.rm(where)

    def teardown(self) -> None:
        """Wait for the last save's copies (``ReplicationError`` if they failed), then close the client."""
        pending, self._pending = self._pending, None
        try:
            if pending is not None:
                pending.wait()
        finally:
            if self._client is not None:
                self._client.close()
                self._client = None
            self._next_step = None
