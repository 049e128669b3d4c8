"""Storage baselines: ``torch.save`` + fsync / ``torch.load``, and DCP ``async_save``, on the same state."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from memstore.bench.results import DcpCall, DcpFloor, DcpMode, DiskFloor, Summary
from memstore.bench.state import states_equal

FLOOR_TIMEOUT = 300.0


def _evict_page_cache(path: str) -> bool:
    """Drop the file's clean pages from the page cache (POSIX_FADV_DONTNEED; no root needed)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def filesystem_of(path: str) -> str:
    best = ("", "")
    with contextlib.suppress(OSError):
        real = os.path.realpath(path)
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")) and len(parts[1]) >= len(best[0]):
                best = (parts[1], f"{parts[2]} ({parts[0]} on {parts[1]})")
    return best[1]


def _timed_load(path: str) -> tuple[float, Any]:
    import torch

    t0 = time.perf_counter()
    loaded = torch.load(path, weights_only=True)
    return time.perf_counter() - t0, loaded


def floor_disk(state: Any, disk_dir: str | None, reps: int) -> DiskFloor:
    """torch.save + flush + fsync to a temp file on local disk; torch.load(weights_only=True) with the file's
    page cache evicted (cold) and warm, ``reps`` times each."""
    import torch

    cold: list[float] = []
    warm: list[float] = []
    evicted = False
    ok = True
    with tempfile.TemporaryDirectory(prefix="memstore-bench-", dir=disk_dir) as d:
        path = os.path.join(d, "state.pt")
        t0 = time.perf_counter()
        with open(path, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            t1 = time.perf_counter()
            os.fsync(fh.fileno())
        t2 = time.perf_counter()
        file_bytes = os.path.getsize(path)
        for i in range(reps):
            evicted = _evict_page_cache(path)
            seconds, loaded = _timed_load(path)
            cold.append(seconds)
            if i == 0:
                ok = states_equal(state, loaded)
            del loaded
            gc.collect()
            seconds, loaded = _timed_load(path)
            warm.append(seconds)
            del loaded
            gc.collect()
        fs = filesystem_of(d)
    return DiskFloor(
        dir=d,
        filesystem=fs,
        file_bytes=file_bytes,
        save_seconds=t1 - t0,
        fsync_seconds=t2 - t1,
        save_fsync_seconds=t2 - t0,
        load_cold_seconds=Summary.of(cold),
        load_cold_page_cache_evicted=evicted,
        load_warm_seconds=Summary.of(warm),
        load_verified=ok,
    )


def _dcp_once(state: Any, directory: str, stager: Any) -> tuple[float, float, int]:
    """One async_save: (blocking seconds, total seconds, bytes written)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    writer = FileSystemWriter(directory, sync_files=True)
    t0 = time.perf_counter()
    fut: Any = dcp.async_save(state, storage_writer=writer, no_dist=True, async_stager=stager)
    t1 = time.perf_counter()
    done = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse (async staging) or a Future
    done.result(timeout=FLOOR_TIMEOUT)
    t2 = time.perf_counter()
    nbytes = sum(p.stat().st_size for p in Path(directory).iterdir())
    return t1 - t0, t2 - t0, nbytes


def _dcp_mode(state: Any, d: str, mode: str, reps: int) -> tuple[DcpMode, int]:
    """``reps`` async_saves in one staging mode, and the bytes the last one wrote."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(False, False, False, False)) if mode == "reused_stager" else None
    blocking: list[float] = []
    total: list[float] = []
    first: DcpCall | None = None
    file_bytes = 0
    try:
        for i in range(reps + (1 if stager is not None else 0)):
            path = os.path.join(d, f"{mode}-{i}")
            b, t, nbytes = _dcp_once(state, path, stager)
            shutil.rmtree(path, ignore_errors=True)
            if stager is not None and i == 0:
                first = DcpCall(blocking_seconds=b, total_seconds=t)  # fills the stager's cache: reported apart
                continue
            blocking.append(b)
            total.append(t)
            file_bytes = nbytes
            gc.collect()
    finally:
        if stager is not None:
            stager.close()
    return DcpMode(blocking_seconds=Summary.of(blocking), total_seconds=Summary.of(total), first_call=first), file_bytes


def floor_dcp(state: Any, disk_dir: str | None, reps: int) -> DcpFloor:
    """``torch.distributed.checkpoint.async_save`` of the state to a local directory with ``FileSystemWriter``
    (``sync_files=True``, its default: every file is fsynced before the future completes), in this single process:
    torch 2.13 needs no process group for that (``no_dist=True``). Blocking = until async_save returns (DCP stages
    the state into CPU memory and plans); total = until the returned future completes (written and fsynced).

    Two stagings: ``default`` as documented (async_save makes a new DefaultStager per call, so each call stages into
    fresh memory), and ``reused_stager``, a caller-owned DefaultStager kept across calls (it caches its staging
    storages, so after a first call it copies into memory already faulted in: DCP's best case)."""
    import torch

    with warnings.catch_warnings(), tempfile.TemporaryDirectory(prefix="memstore-bench-dcp-", dir=disk_dir) as d:
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming the intent is to save in a single process"
        fs = filesystem_of(d)
        default, _ = _dcp_mode(state, d, "default", reps)
        gc.collect()
        reused, file_bytes = _dcp_mode(state, d, "reused_stager", reps)
        gc.collect()
    return DcpFloor(
        torch=torch.__version__,
        writer="FileSystemWriter(sync_files=True, thread_count=1)",
        process_group="none: async_save(no_dist=True) in one process",
        reps=reps,
        dir=d,
        filesystem=fs,
        file_bytes=file_bytes,
        default=default,
        reused_stager=reused,
    )
