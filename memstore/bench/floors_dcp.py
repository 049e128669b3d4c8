"""The DCP baseline: ``torch.distributed.checkpoint.async_save`` of the state to local disk, in two stagings.

torch's DCP API moves between releases (the package declares torch>=2.4; only 2.13 is tested), so what the baseline
needs beyond ``async_save`` and ``FileSystemWriter`` is feature-detected, never assumed from the version number:
``no_dist=`` and ``async_stager=`` (from :func:`inspect.signature`), ``staging.DefaultStager`` / ``StagingOptions``
(imported). Whatever torch's own DCP machinery raises (the import, the stager, ``async_save``, its future) makes that
staging mode *unavailable* with the reason (exception type and message, where in torch, torch's version) instead of
ending the run: the tables print it, the JSON keeps it (``unavailable``), and the ratios and the target that need the
mode are n/a with it (:mod:`memstore.bench.targets`).

Known case, torch 2.11: ``DefaultStager._stage`` closes its ``StateDictStager`` at the end of every stage (a leak fix,
pytorch/pytorch PR 170431; reported as issue 183413), and ``StateDictStager.close()`` clears ``_deepcopy_dispatch``,
which only ``__init__`` fills. A stager reused across ``async_save`` calls (our ``reused_stager`` mode) then fails
from its second call: ``deepcopy_with_tensor_offload`` finds no copier for the state's top-level ``dict``, falls back
to ``dict.__reduce_ex__(4)`` = ``(copyreg.__newobj__, (dict,), None, None, <items>)``, deep-copies the args and so the
class object ``dict``, and a class (``issubclass(cls, type)``) is copied by ``self._deepcopy_dispatch[type]``:
``KeyError: <class 'type'>``. Nothing in the bench's state (no class or dtype object in it) is to blame: any state
dict fails so, and ``StagingOptions(True, True, True, True)`` only moves the raise into the staging future. The default
staging (a new stager per call) is unaffected.
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

from memstore.bench.floors_disk import FLOOR_TIMEOUT, filesystem_of
from memstore.bench.results import DcpCall, DcpFloor, DcpMode, Summary

DEFAULT, REUSED = "default", "reused_stager"
WRITER = "FileSystemWriter(sync_files=True, thread_count=1)"
_DCP_SOURCE = "/torch/distributed/checkpoint/"
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


def _innermost_dcp_frame(exc: BaseException) -> traceback.FrameSummary | None:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _DCP_SOURCE in f.filename.replace(os.sep, "/")]
    return frames[-1] if frames else None


def is_closed_stager_error(exc: BaseException) -> bool:
    """torch 2.11's failure of a reused DefaultStager (see the module's docstring)."""
    frame = _innermost_dcp_frame(exc)
    return isinstance(exc, KeyError) and exc.args == (type,) and frame is not None and frame.filename.endswith("_state_dict_stager.py")


def describe_failure(exc: BaseException, version: str, hint: str = "") -> str:
    """``unavailable on torch <version>: <type>: <message> in torch's DCP <part> (<file>, <function>)<hint>``."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    frame = _innermost_dcp_frame(exc)
    if frame is not None:
        name = os.path.basename(frame.filename)
        part = "stager" if "stag" in name else "checkpoint code"
        text += f" in torch's DCP {part} ({name}, {frame.name})"
    return unavailable(version, text + hint)


def _parameters(fn: Callable[..., Any]) -> set[str] | None:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # no signature to read: pass the arguments and let a TypeError say so
        return None


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


def _stager_factory(params: set[str] | None, version: str) -> tuple[Callable[[], Any] | None, str]:
    """A maker of caller-owned DefaultStagers with every option off (synchronous staging into plain CPU memory), or
    None and why this torch has none."""
    if params is not None and "async_stager" not in params:
        return None, unavailable(version, "torch.distributed.checkpoint.async_save has no async_stager parameter")
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError as e:
        return None, unavailable(version, f"torch.distributed.checkpoint.staging has no DefaultStager/StagingOptions ({e})")
    off = {"use_pinned_memory": False, "use_shared_memory": False, "use_async_staging": False, "use_non_blocking_copy": False}
    return (lambda: DefaultStager(StagingOptions(**off))), ""


def detect_dcp() -> DcpApi | str:
    """What this torch's DCP offers, or (a str) why the DCP baseline is unavailable altogether."""
    version = torch_version()
    try:
        import torch.distributed.checkpoint as dcp

        async_save, writer = dcp.async_save, dcp.FileSystemWriter
    except Exception as e:  # ImportError (torch built without distributed), AttributeError (no async_save)
        return describe_failure(e, version)
    params = _parameters(async_save)
    extra: dict[str, Any] = {"no_dist": True} if params is None or "no_dist" in params else {}
    new_stager, no_stager = _stager_factory(params, version)
    return DcpApi(version, async_save, writer, extra, new_stager, no_stager)


def _dcp_once(api: DcpApi, state: Any, directory: str, stager: Any) -> tuple[float, float, int]:
    """One async_save: (blocking seconds, total seconds, bytes written)."""
    writer = api.writer(directory, sync_files=True)
    kwargs = dict(api.extra, **({"async_stager": stager} if stager is not None else {}))
    t0 = time.perf_counter()
    fut: Any = api.async_save(state, storage_writer=writer, **kwargs)
    t1 = time.perf_counter()
    done = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse (async staging) or a Future
    try:
        done.result(timeout=FLOOR_TIMEOUT)
    except TimeoutError as e:  # concurrent.futures.TimeoutError is TimeoutError (Python >= 3.11)
        raise TimeoutError(f"async_save's future did not complete in {FLOOR_TIMEOUT:.0f} s") from e
    t2 = time.perf_counter()
    nbytes = sum(p.stat().st_size for p in Path(directory).iterdir())
    return t1 - t0, t2 - t0, nbytes


def _close(stager: Any, api: DcpApi) -> str | None:
    try:
        stager.close()
    except Exception as e:  # torch's stager: reported, not raised
        return describe_failure(e, api.version)
    return None


def dcp_mode(api: DcpApi, state: Any, d: str, mode: str, reps: int) -> tuple[DcpMode, int | None]:
    """``reps`` async_saves in one staging mode, and the bytes the last one wrote; the mode is unavailable (with the
    reason, and no bytes) if torch's DCP raises on any of them."""
    stager: Any = None
    if mode == REUSED:
        if api.new_stager is None:
            return DcpMode.not_measured(api.no_stager), None
        try:
            stager = api.new_stager()
        except Exception as e:  # e.g. a StagingOptions without these fields: TypeError
            return DcpMode.not_measured(describe_failure(e, api.version)), None
    blocking: list[float] = []
    total: list[float] = []
    first: DcpCall | None = None
    file_bytes = 0
    failure: str | None = None
    try:
        for i in range(reps + (1 if stager is not None else 0)):
            path = os.path.join(d, f"{mode}-{i}")
            try:
                b, t, nbytes = _dcp_once(api, state, path, stager)
            except Exception as e:  # torch's DCP machinery (async_save, the stager, the future)
                hint = CLOSED_STAGER_HINT if stager is not None and i > 0 and is_closed_stager_error(e) else ""
                failure = describe_failure(e, api.version, hint)
                break
            finally:
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
            failure = failure or _close(stager, api)
    if failure is not None:
        return DcpMode.not_measured(failure), None
    return DcpMode(blocking_seconds=Summary.of(blocking), total_seconds=Summary.of(total), first_call=first), file_bytes


def floor_dcp(state: Any, disk_dir: str | None, reps: int) -> DcpFloor:
    """``torch.distributed.checkpoint.async_save`` of the state to a local directory with ``FileSystemWriter``
    (``sync_files=True``, its default: every file is fsynced before the future completes), in this single process:
    no process group is needed for that (``no_dist=True`` where async_save has it). Blocking = until async_save
    returns (DCP stages the state into CPU memory and plans); total = until the returned future completes (written
    and fsynced).

    Two stagings: ``default`` as documented (async_save makes a new DefaultStager per call, so each call stages into
    fresh memory), and ``reused_stager``, a caller-owned DefaultStager kept across calls (it caches its staging
    storages, so after a first call it copies into memory already faulted in: DCP's best case). Either is
    ``unavailable`` (with the reason) where this torch cannot do it; the run goes on."""
    api = detect_dcp()
    with warnings.catch_warnings(), tempfile.TemporaryDirectory(prefix="memstore-bench-dcp-", dir=disk_dir) as d:
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming the intent is to save in a single process"
        fs = filesystem_of(d)
        if isinstance(api, str):
            default = reused = DcpMode.not_measured(api)
            file_bytes: int | None = None
        else:
            default, default_bytes = dcp_mode(api, state, d, DEFAULT, reps)
            gc.collect()
            reused, file_bytes = dcp_mode(api, state, d, REUSED, reps)
            gc.collect()
            file_bytes = default_bytes if file_bytes is None else file_bytes
    return DcpFloor(
        torch=torch_version() if isinstance(api, str) else api.version,
        writer=WRITER,
        process_group="none: async_save in one process" if isinstance(api, str) else api.process_group,
        reps=reps,
        dir=d,
        filesystem=fs,
        file_bytes=file_bytes,
        default=default,
        reused_stager=reused,
    )
