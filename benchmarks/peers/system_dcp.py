"""DCP's best staging: ``async_save`` with one caller-owned ``DefaultStager(StagingOptions(use_pinned_memory=True,
use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=True))`` kept across saves (it registers shared
memory once, then stages on a side thread), writing with ``FileSystemWriter(sync_files=True)`` into a directory.

On a machine without CUDA, torch refuses ``use_non_blocking_copy=True`` when the stager is built (an AssertionError:
"Non-blocking copy requires that the current accelerator is available") and ignores ``use_pinned_memory`` with a
warning; the system then runs the same options with ``use_non_blocking_copy=False`` and says so in its notes.

Stall: until the staging completes (``AsyncSaveResponse.staging_completion``: the trainer may touch the state again);
the call's own return is reported beside it. DCP does not replicate: the save survives the loss of the host only
where its directory lives on storage that outlives the host; durable is the fsynced write (``upload_completion``).
Restores, in a fresh process (no process group): ``_load_state_dict_from_keys`` reads the whole checkpoint without
a template; after the loss, the checkpoint's pages are first evicted from the page cache (``POSIX_FADV_DONTNEED``),
so the read comes from the disk, as it would from storage that is not this host's memory.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

from benchmarks.peers.common import Context, Unavailable

BEST = {"use_pinned_memory": True, "use_shared_memory": True, "use_async_staging": True, "use_non_blocking_copy": True}


def make_stager(notes: list[str]) -> tuple[Any, dict[str, bool]]:
    """The brief's DefaultStager, or (where torch refuses an option here) the nearest one torch builds; notes say which."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    options = dict(BEST)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            stager = DefaultStager(StagingOptions(**options))
        except AssertionError as exc:  # torch: non-blocking copies need an accelerator
            notes.append(f"StagingOptions(**{BEST}) refused by torch here: AssertionError: {exc}; ran use_non_blocking_copy=False")
            options["use_non_blocking_copy"] = False
            stager = DefaultStager(StagingOptions(**options))
    pins = {
        f"use_pinned_memory=True ignored by torch here ({w.category.__name__}: {w.message})"
        for w in caught
        if "pin" in str(w.message).lower()
    }
    notes.extend(sorted(pins))
    return stager, options


class DcpSystem:
    name = "dcp"

    def __init__(self) -> None:
        self.ctx: Context | None = None
        self.stager: Any = None
        self.options: dict[str, bool] = {}
        self.last: Path | None = None

    def version(self) -> str:
        import torch

        return f"torch {torch.__version__}"

    def unavailable(self) -> str | None:
        from memstore.bench.baselines_dcp import detect_dcp

        api = detect_dcp()
        if isinstance(api, str):
            return api
        return api.no_stager or None

    def start(self, ctx: Context) -> None:
        self.ctx = ctx
        self.stager, self.options = make_stager(ctx.notes)

    def save(self, step: int, state: Any) -> Any:
        import torch.distributed.checkpoint as dcp

        assert self.ctx is not None
        path = self.ctx.workdir / f"step-{step}"
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming the intent is to save in a single process"
            response = dcp.async_save(
                state, storage_writer=dcp.FileSystemWriter(str(path), sync_files=True), async_stager=self.stager, no_dist=True
            )
        returned = time.perf_counter() - t0
        staging = getattr(response, "staging_completion", None)
        if staging is not None:
            staging.result()
        return {"response": response, "path": path, "returned_seconds": returned}

    def wait_durable(self, token: Any) -> dict[str, Any]:
        response = token["response"]
        getattr(response, "upload_completion", response).result()
        if self.last is not None:
            shutil.rmtree(self.last, ignore_errors=True)
        self.last = token["path"]
        nbytes = sum(p.stat().st_size for p in self.last.iterdir())
        return {"returned_seconds": token["returned_seconds"], "file_bytes": nbytes, "options": self.options}

    def memory(self) -> dict[str, Any]:
        return {"servers": {}, "shm_bytes": None}  # the stager's shared memory is the trainer's (its RssShmem)

    def restore_local(self) -> dict[str, Any]:
        from benchmarks.peers.common import restore_in_child

        assert self.ctx is not None and self.last is not None
        return restore_in_child("dcp", {"path": str(self.last)}, self.ctx.timeout)

    def restore_after_loss(self) -> dict[str, Any]:
        from benchmarks.peers.common import restore_in_child

        assert self.ctx is not None and self.last is not None
        evict(self.last)
        return restore_in_child("dcp", {"path": str(self.last)}, self.ctx.timeout)

    def stop(self) -> None:
        if self.stager is not None:
            self.stager.close()
        if self.last is not None:
            shutil.rmtree(self.last, ignore_errors=True)


def evict(directory: Path) -> None:
    """Drop the page cache of every file under ``directory`` (they were fsynced: nothing is lost)."""
    for p in directory.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def imports() -> None:
    """What a trainer restoring with DCP has imported before it restores."""
    import torch.distributed.checkpoint  # noqa: F401


def restore_here(spec: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """In the fresh process: the whole checkpoint at ``spec["path"]``, read without a template or a process group."""
    try:
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    except ImportError as exc:  # an older torch
        raise Unavailable(f"torch has no _load_state_dict_from_keys: {exc}") from exc
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = _load_state_dict_from_keys(checkpoint_id=spec["path"])
    return state, {"source": "disk"}
