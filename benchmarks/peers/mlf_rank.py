"""One rank of the 2-rank ml-flashpoint job, ``python -m benchmarks.peers.mlf_rank`` (run in its host's mount
namespace by :mod:`benchmarks.peers.system_mlflashpoint`), driven over JSON lines on stdin/stdout like the restore
child: ``{"op": "init"}`` joins the gloo job (``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` from the
environment) and sets up ml-flashpoint as its PyTorch DCP guide does; ``{"op": "build", "spec": {...}}`` (rank 0: the
trainer) builds the benchmarked state; ``{"op": "save", "step": n}`` is one ``dcp.save`` with its
``MemoryStorageWriter`` (rank 1 saves an empty state: the peer); ``{"op": "wait", "files": {...}}`` (rank 1) waits
until its host holds every file of rank 0's checkpoint; ``{"op": "restore"}`` finds the newest complete checkpoint
(retrieving what this host lacks from its peer) and loads it whole. Times are ``time.time()`` (one clock: one machine).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

BASE = os.environ.get("PEERS_MLF_BASE", "/tmp/peers-mlf")


class Rank:
    def __init__(self) -> None:
        self.rank = int(os.environ["RANK"])
        self.state: Any = {}
        self.base: Any = None

    def init(self, nbytes: int) -> dict[str, Any]:
        import torch.distributed as dist
        import torch.multiprocessing as torch_mp
        from ml_flashpoint.adapter.pytorch.memory_storage_writer import MemoryStorageWriter
        from ml_flashpoint.checkpoint_object_manager.checkpoint_object_manager import CheckpointObjectManager
        from ml_flashpoint.core.checkpoint_id_types import CheckpointContainerId
        from ml_flashpoint.core.checkpoint_loader import DefaultMLFlashpointCheckpointLoader
        from ml_flashpoint.core.checkpoint_saver import DefaultMLFlashpointCheckpointSaver
        from ml_flashpoint.replication.replication_manager import PairwiseReplicationStrategy, ReplicationManager
        from ml_flashpoint.replication.transfer_service import transfer_service_ext

        t0 = time.time()
        dist.init_process_group("gloo")
        objects = CheckpointObjectManager()
        service = transfer_service_ext.TransferService()
        port = service.initialize(0, global_rank=self.rank)
        addresses: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(addresses, f"127.0.0.1:{port}")
        replication = ReplicationManager()
        # processes_per_node=1: the default strategy divides by torch.cuda.device_count(), 0 here
        replication.initialize(objects, replication_transfer_service=service, repl_strategy=PairwiseReplicationStrategy(addresses, 1))
        saver = DefaultMLFlashpointCheckpointSaver(
            global_rank_getter=dist.get_rank, local_rank_getter=lambda: 0, global_barrier_func=dist.barrier,
            ckpt_obj_manager=objects, replication_manager=replication, initial_buffer_size_bytes=nbytes + (64 << 20),
        )  # fmt: skip
        manager: concurrent.futures.Future[Any] = concurrent.futures.Future()
        manager.set_result(torch_mp.get_context("spawn").Manager())
        self.saver = saver
        self.writer = MemoryStorageWriter(checkpoint_saver=saver, mp_manager_future=manager)
        self.loader = DefaultMLFlashpointCheckpointLoader(
            objects, replication, global_rank_getter=dist.get_rank, local_rank_getter=lambda: 0,
            broadcast_object_list_func=dist.broadcast_object_list, all_gather_object_func=dist.all_gather_object,
            world_size_getter=dist.get_world_size,
        )  # fmt: skip
        self.base = CheckpointContainerId(f"{BASE}/job")
        return {"init_seconds": time.time() - t0, "address": addresses[self.rank]}

    def build(self, spec: dict[str, Any]) -> dict[str, Any]:
        from benchmarks.peers.common import process_memory
        from benchmarks.peers.states import StateSpec, build
        from memstore.bench.state import fingerprint

        self.state = build(StateSpec(**spec))
        return {"fingerprint": fingerprint(self.state), "memory": process_memory(os.getpid())}

    def save(self, step: int) -> dict[str, Any]:
        import torch
        import torch.distributed.checkpoint as dcp
        from ml_flashpoint.core.checkpoint_id_types import CheckpointContainerId
        from ml_flashpoint.core.defaults import COMMON_STATE_FNAME

        from benchmarks.peers.common import process_memory

        ckpt = CheckpointContainerId.create_child(self.base, CheckpointContainerId.format_version_container(step))
        started = time.time()
        metadata = dcp.save(self.state, checkpoint_id=str(ckpt), storage_writer=self.writer)
        # What its Megatron path does after the DCP save, and plain dcp.save does not; without it the loader never
        # finds the checkpoint complete: every node writes the checkpoint's metadata (else only the coordinator's host
        # has it, lost with it) and a common-state object (the loader requires one per node: empty here), then every
        # rank finalizes it (the dirty marker goes, older checkpoints are removed).
        if self.rank != 0:
            self.saver.write_metadata(ckpt, metadata)
        torch.save({}, os.path.join(str(ckpt), COMMON_STATE_FNAME))
        self.saver.finalize_checkpoint(ckpt)
        returned = time.time()
        files = {str(p): p.stat().st_size for p in Path(str(ckpt)).rglob("*") if p.is_file()}
        return {"started": started, "returned": returned, "files": files, "memory": process_memory(os.getpid())}

    def wait(self, files: dict[str, int], timeout: float) -> dict[str, Any]:
        deadline = time.time() + timeout
        while not all(os.path.exists(p) and os.path.getsize(p) >= n for p, n in files.items()):
            if time.time() > deadline:
                missing = [p for p in files if not os.path.exists(p)]
                raise TimeoutError(f"the peer host does not hold {len(missing)} of {len(files)} files after {timeout:.0f} s: {missing}")
            time.sleep(0.002)
        return {"held": time.time()}

    def restore(self) -> dict[str, Any]:
        from ml_flashpoint.adapter.pytorch.memory_storage_reader import MemoryStorageReader
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

        from benchmarks.peers.common import keys_as_str, process_memory
        from memstore.bench.state import fingerprint

        started = time.time()
        latest = self.loader.get_latest_complete_checkpoint(self.base)
        if latest is None:
            candidates = self.loader.get_candidate_checkpoints(self.base)
            held = {str(c): self.loader.get_checkpoint_objects_by_rank(c) for c in candidates}
            raise RuntimeError(f"ml-flashpoint found no complete checkpoint; candidates and objects by rank: {held}")
        state = _load_state_dict_from_keys(storage_reader=MemoryStorageReader(path=str(latest), checkpoint_loader=self.loader))
        done = time.time()
        state = {k: v for k, v in state.items() if k != "peer"}
        return {
            "started": started, "done": done, "checkpoint": str(latest), "memory": process_memory(os.getpid()),
            "fingerprint": fingerprint(state), "fingerprint_keys_as_str": fingerprint(keys_as_str(state)),
        }  # fmt: skip


def main() -> None:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    t0 = time.perf_counter()
    import ml_flashpoint.adapter.pytorch.memory_storage_writer  # noqa: F401
    import torch  # noqa: F401

    rank = Rank()
    out.write(json.dumps({"ready": True, "import_seconds": time.perf_counter() - t0}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            answer = getattr(rank, op)(**cmd)
        except Exception as exc:  # the peer's error, reported to the runner
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
