"""The DCP baseline: ``torch.distributed.checkpoint.async_save`` of the state to local disk, in two stagings.

torch's DCP API moves between releases (the package declares torch>=2.4), so what the baseline needs beyond
``async_save`` and ``FileSystemWriter`` is feature-detected, never assumed from the version number: ``no_dist=`` and
``async_stager=`` (from :func:`inspect.signature`), ``staging.DefaultStager`` / ``StagingOptions`` (imported).
Whatever torch's own DCP machinery raises (the import, the stager, ``async_save``, its future) makes that staging mode
*unavailable*, with the reason (exception, where in torch, torch's version), instead of ending the run: the table
prints it and the ratios that need the mode are n/a with it.

Known case, torch 2.11: ``DefaultStager._stage`` closes its ``StateDictStager`` after every stage, and ``close()``
clears the copier table only ``__init__`` fills. A stager reused across ``async_save`` calls (the ``reused_stager``
mode) then fails from its second call with ``KeyError: <class 'type'>`` (pytorch/pytorch#183413); the default staging
(a new stager per call) is unaffected.
"""

from __future__ import annotations

import gc
import inspect
import os
import shutil
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memstore.bench.baselines import BASELINE_TIMEOUT
from memstore.bench.state import p50

DEFAULT, REUSED = "default", "reused_stager"
WRITER = "FileSystemWriter(sync_files=True)"
DCP_SOURCE = "/torch/distributed/checkpoint/"
CLOSED_STAGER_HINT = (
    "; this torch's DefaultStager closes its StateDictStager after each stage, so a stager reused across async_save "
    "calls fails from its second call (pytorch/pytorch#183413, from torch 2.11)"
)


def torch_version() -> str:
    try:
        import torch

        return str(torch.__version__)
    except Exception:  # a broken torch install is reported, not raised
        return "?"


def unavailable(version: str, why: str) -> str:
    return f"unavailable on torch {version}: {why}"


def innermost_dcp_frame(exc: BaseException) -> traceback.FrameSummary | None:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if DCP_SOURCE in f.filename.replace(os.sep, "/")]
    return frames[-1] if frames else None


def is_closed_stager_error(exc: BaseException) -> bool:
    """torch 2.11's failure of a reused DefaultStager (see the module's docstring)."""
    frame = innermost_dcp_frame(exc)
    return isinstance(exc, KeyError) and exc.args == (type,) and frame is not None and frame.filename.endswith("_state_dict_stager.py")


def describe_failure(exc: BaseException, version: str, hint: str = "") -> str:
    """``unavailable on torch <version>: <type>: <message> in torch's DCP <part> (<file>, <function>)<hint>``."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    frame = innermost_dcp_frame(exc)
    if frame is not None:
        name = os.path.basename(frame.filename)
        text += f" in torch's DCP {'stager' if 'stag' in name else 'checkpoint code'} ({name}, {frame.name})"
    return unavailable(version, text + hint)


@dataclass
class DcpApi:
    """This torch's DCP, as the baseline uses it (feature-detected by :func:`detect_dcp`)."""

    version: str
    async_save: Callable[..., Any]
    writer: Callable[..., Any]
    extra: dict[str, Any]  # keyword arguments this async_save takes beyond storage_writer: no_dist=True where it has it
    new_stager: Callable[[], Any] | None  # a caller-owned DefaultStager, synchronous staging; None: not in this torch
    no_stager: str  # why new_stager is None

    @property
    def process_group(self) -> str:
        if "no_dist" in self.extra:
            return "none: async_save(no_dist=True) in one process"
        return "none: async_save in one process, torch.distributed not initialized (this async_save has no no_dist)"


def detect_dcp() -> DcpApi | str:
    """What this torch's DCP offers, or (a str) why the DCP baseline is unavailable altogether."""
    version = torch_version()
    try:
        import torch.distributed.checkpoint as dcp

        async_save, writer = dcp.async_save, dcp.FileSystemWriter
    except Exception as e:  # ImportError (torch built without distributed), AttributeError (no async_save)
        return describe_failure(e, version)
    try:
        params: set[str] | None = set(inspect.signature(async_save).parameters)
    except (TypeError, ValueError):  # no signature to read: pass the arguments and let a TypeError say so
        params = None
    extra: dict[str, Any] = {"no_dist": True} if params is None or "no_dist" in params else {}
    if params is not None and "async_stager" not in params:
        return DcpApi(
            version,
            async_save,
            writer,
            extra,
            None,
            unavailable(version, "torch.distributed.checkpoint.async_save has no async_stager parameter"),
        )
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError as e:
        why = unavailable(version, f"torch.distributed.checkpoint.staging has no DefaultStager/StagingOptions ({e})")
        return DcpApi(version, async_save, writer, extra, None, why)
    off = {"use_pinned_memory": False, "use_shared_memory": False, "use_async_staging": False, "use_non_blocking_copy": False}
    return DcpApi(version, async_save, writer, extra, lambda: DefaultStager(StagingOptions(**off)), "")


def dcp_once(api: DcpApi, state: Any, directory: str, stager: Any) -> tuple[float, float, int]:
    """One async_save: (blocking seconds, total seconds, bytes written)."""
    writer = api.writer(directory, sync_files=True)
    kwargs = dict(api.extra, **({"async_stager": stager} if stager is not None else {}))
    t0 = time.perf_counter()
    fut: Any = api.async_save(state, storage_writer=writer, **kwargs)
    t1 = time.perf_counter()
    done = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse (async staging) or a Future
    try:
        done.result(timeout=BASELINE_TIMEOUT)
    except TimeoutError as e:
        raise TimeoutError(f"async_save's future did not complete in {BASELINE_TIMEOUT:.0f} s") from e
    t2 = time.perf_counter()
    return t1 - t0, t2 - t0, sum(p.stat().st_size for p in Path(directory).iterdir())


def not_measured(why: str) -> dict[str, Any]:
    return {"blocking_seconds": None, "blocking_p50": None, "total_p50": None, "unavailable": why}


def dcp_mode(api: DcpApi, state: Any, d: str, mode: str, reps: int) -> tuple[dict[str, Any], int | None]:
    """``reps`` async_saves in one staging mode (the reused stager's first call, which fills its cache, is not counted)
    and the bytes the last one wrote; the mode is unavailable (with the reason, and no bytes) if torch's DCP raises."""
    stager: Any = None
    if mode == REUSED:
        if api.new_stager is None:
            return not_measured(api.no_stager), None
        try:
            stager = api.new_stager()
        except Exception as e:  # e.g. a StagingOptions without these fields: TypeError
            return not_measured(describe_failure(e, api.version)), None
    blocking: list[float] = []
    total: list[float] = []
    file_bytes = 0
    failure: str | None = None
    try:
        for i in range(reps + (1 if stager is not None else 0)):
            path = os.path.join(d, f"{mode}-{i}")
            try:
                b, t, file_bytes = dcp_once(api, state, path, stager)
            except Exception as e:  # torch's DCP machinery (async_save, the stager, the future)
                hint = CLOSED_STAGER_HINT if stager is not None and i > 0 and is_closed_stager_error(e) else ""
                failure = describe_failure(e, api.version, hint)
                break
            finally:
                shutil.rmtree(path, ignore_errors=True)
            if stager is None or i > 0:
                blocking.append(b)
                total.append(t)
            gc.collect()
    finally:
        if stager is not None:
            try:
                stager.close()
            except Exception as e:  # torch's stager: reported, not raised
                failure = failure or describe_failure(e, api.version)
    if failure is not None:
        return not_measured(failure), None
    return {"blocking_seconds": blocking, "blocking_p50": p50(blocking), "total_p50": p50(total), "unavailable": None}, file_bytes


def baseline_dcp(state: Any, disk_dir: str | None, reps: int) -> dict[str, Any]:
    """``async_save`` of the state to a local directory with ``FileSystemWriter(sync_files=True)`` (every file fsynced
    before the future completes), in this single process. Blocking = until async_save returns (DCP stages the state
    into CPU memory); total = until its future completes (written and fsynced). Two stagings: ``default`` (a new
    DefaultStager per call: fresh memory each time) and ``reused_stager`` (one kept across calls: DCP's best case)."""
    api = detect_dcp()
    with warnings.catch_warnings(), tempfile.TemporaryDirectory(prefix="memstore-bench-dcp-", dir=disk_dir) as d:
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming the intent is to save in a single process"
        if isinstance(api, str):
            default, reused, file_bytes = not_measured(api), not_measured(api), None
        else:
            default, default_bytes = dcp_mode(api, state, d, DEFAULT, reps)
            reused, file_bytes = dcp_mode(api, state, d, REUSED, reps)
            file_bytes = default_bytes if file_bytes is None else file_bytes
    return {
        "torch": torch_version() if isinstance(api, str) else api.version,
        "writer": WRITER,
        "process_group": "none: async_save in one process" if isinstance(api, str) else api.process_group,
        "reps": reps,
        "file_bytes": file_bytes,
        DEFAULT: default,
        REUSED: reused,
    }
