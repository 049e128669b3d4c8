"""torchtitan checkpoints in memstore: its ``CheckpointManager``, with DCP writing to and reading from the stores.

torchtitan builds its checkpointer from the trainer config (``Trainer.Config.checkpoint`` is any
``BaseCheckpointManager.Config``; ``config.checkpoint.build(...)`` constructs the class that declares it), so no
patch of torchtitan is needed: put :class:`MemStoreCheckpointManager.Config` there::

    config.checkpoint = MemStoreCheckpointManager.Config(enable=True, job_id="llama3-8b-run7", interval=100)

What maps to what:

* a save of step N (``<folder>/step-N`` to torchtitan) is DCP step N of ``job_id`` in memstore: ``dcp.save`` (or
  ``dcp.async_save`` in torchtitan's ``async`` / ``async_with_pinned_mem`` modes) with a
  :class:`~trainer_client.dcp.MemStoreWriter`; every rank saves its shard through its own host's store;
* a load (``checkpoint.load_step``, -1 = the newest) reads the step from memstore with a
  :class:`~trainer_client.dcp.MemStoreReader`, the version agreed over the default process group; when memstore
  has no such step, torchtitan's own loading runs (``initial_load_path``, Hugging Face weights, a fresh start);
* exports stay files: the last step's model-only save (``last_save_model_only``, in ``export_dtype``) and Hugging
  Face safetensors (``last_save_in_hf``) go to ``<folder>/step-N`` as torchtitan writes them;
* retention is the stores' (``--keep``, and spill retention); ``keep_latest_k`` applies only to those exports;
* one :class:`~trainer_client.dcp.MemStoreWriter` (so one store client per rank) makes every save of the manager;
  when a load restored a step from memstore (a restart), each rank prepares its next save there
  (:meth:`~trainer_client.dcp.MemStoreWriter.prepare`: its shard planned as the save will write it, its memory
  reserved, mapped and, for CUDA tensors, registered), so the first save after the restart is a memcpy instead of
  the store making memory. A fresh start is not prepared: its optimizer has no state before the first step
  (planning it would take a zero-gradient step, which advances Adam's step count) and preparing right before the
  first save makes it slower (:mod:`trainer_client.warmup`). Nor is ``async_with_pinned_mem``: DCP's checkpoint
  process saves there, with clients of its own.
"""

from __future__ import annotations

import re
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Annotated, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import tyro
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager
from torchtitan.tools.utils import GarbageCollection

from memstore.v1.keys import job_id_problem
from trainer_client.client import CheckpointClient
from trainer_client.connection import DEPRECATED_KWARGS, Connection
from trainer_client.dcp import MemStoreReader, MemStoreWriter
from trainer_client.errors import InvalidArgumentError

_STEP_DIR = re.compile(r"step-(\d+)$")


def step_of(checkpoint_id: str) -> int:
    """The step of a torchtitan checkpoint id (``.../step-N``)."""
    found = _STEP_DIR.search(str(checkpoint_id).rstrip("/"))
    if found is None:
        raise InvalidArgumentError(f"torchtitan checkpoint id {checkpoint_id!r} does not end in step-N")
    return int(found.group(1))


def _group() -> Any:
    """The default process group when there is one (torchtitan's trainer always has it), else None (one process)."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


class MemStoreCheckpointManager(CheckpointManager):
    """torchtitan's DCP ``CheckpointManager`` saving to and loading from memstore (every other option as torchtitan's)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        job_id: str = ""
        """The memstore job of this training run: the same across restarts, [A-Za-z0-9._-]{1,128}."""

        connection: Annotated[Connection | None, tyro.conf.Suppress] = None
        """How to reach this host's store (:class:`~trainer_client.Connection`, as the client takes it); None:
        ``Connection()``, i.e. MEMSTORE_STORE, else 127.0.0.1:7070, credentials from the environment. Not a
        command-line option: set MEMSTORE_STORE there."""

        store: str = ""
        """Refused when the config is made (a ``TypeError`` naming the replacement): ``connection=Connection(address=...)``,
        or MEMSTORE_STORE."""

        wait_for_replication: bool = True
        """A save returns (or its async future completes) once every rank's shard has R verified copies."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            if self.store:
                raise TypeError(
                    f"MemStoreCheckpointManager.Config(store=) is not accepted: pass connection= ({DEPRECATED_KWARGS['store']}), "
                    "or set MEMSTORE_STORE"
                )
            if self.connection is not None and not isinstance(self.connection, Connection):
                raise TypeError(f"checkpoint.connection expects a trainer_client.Connection, got a {type(self.connection).__name__}")
            problem = job_id_problem(self.job_id) if self.enable else None
            if problem:
                raise ValueError(f"checkpoint.job_id: {problem}")

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if not self.enable:
            return
        self.job_id = config.job_id
        self.connection = (config.connection or Connection()).resolved()
        self.wait_for_replication = config.wait_for_replication
        self._exporting = False
        self.writer = MemStoreWriter(self.job_id, connection=self.connection, wait_for_replication=self.wait_for_replication)

    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode, enable_garbage_collection: bool = False,
                 to_hf: bool = False) -> Future[Any] | AsyncSaveResponse | None:  # fmt: skip
        """Step ``step-N`` of ``checkpoint_id`` into memstore; an export (Hugging Face, last model-only) to its files."""
        if to_hf or self._exporting:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        step = str(step_of(checkpoint_id))  # the writer's reset(step): one writer for every save (torchtitan waits for the last)
        writer = self.writer
        ret: Future[Any] | AsyncSaveResponse | None = None
        if async_mode == AsyncMode.ASYNC:
            ret = dcp.async_save(state_dict, checkpoint_id=step, storage_writer=writer, process_group=self.pg)
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            ret = dcp.async_save(state_dict, checkpoint_id=step, storage_writer=writer, process_group=self.pg,
                                 async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=self.stager)  # fmt: skip
        else:
            dcp.save(state_dict, checkpoint_id=step, storage_writer=writer)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def _save_last_step(self, curr_step: int) -> None:
        self._exporting = self.last_save_model_only  # an export: files, as torchtitan writes them
        try:
            super()._save_last_step(curr_step)
        finally:
            self._exporting = False

    def memstore_step(self, step: int = -1) -> int | None:
        """The step a load reads from memstore (``-1``: the newest restorable), or None when memstore has none.

        A collective over the default process group when there is one (every rank gets the same answer)."""
        group = _group()
        rank, world = (dist.get_rank(), dist.get_world_size()) if group is not None else (0, 1)
        with CheckpointClient(self.job_id, rank, world, connection=self.connection) as client:
            point = client.restore_point(None if step == -1 else step, group=group)
        return None if point is None else point.step

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        found = self.memstore_step(step)
        if found is None:
            return super()._load(step)  # torchtitan's own: initial_load_path, HF weights, or a fresh start
        states = self._states_to_load(model_only=found == 0)  # step 0 is torchtitan's model-only seed checkpoint
        reader = MemStoreReader(self.job_id, found, connection=self.connection, group=_group())
        try:
            dcp.load(states, storage_reader=reader)
        finally:
            reader.close()
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(states)  # the model's entries are flattened into the top level
        GarbageCollection.collect("GC collection for checkpoint loading.")
        if found > 0 and not self.load_only and self.async_mode != AsyncMode.ASYNC_WITH_PINNED_MEM:
            self.writer.prepare(self._flattened_model_states_sd(), group=_group())  # a restart: its next save, like this one
        return True

    def _close(self) -> None:
        try:
            super()._close()
        finally:
            self.writer.close()  # its store client
