"""Storage baseline: ``torch.save`` + fsync / ``torch.load`` of the state (DCP ``async_save``: :mod:`memstore.bench.floors_dcp`)."""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from memstore.bench.results import DiskFloor, Summary
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
