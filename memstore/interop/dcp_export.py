"""Plain-DCP copies of spilled DCP steps: torch's ``FileSystemWriter`` layout beside memstore's own files.

A step saved through ``trainer_client.dcp.MemStoreWriter`` is one memstore shard per saving rank
(``{"format": "memstore-dcp", ..., "items": {key: tensor | bytes}}``, rank 0's with the DCP metadata,
safely encoded). When the spiller publishes such a shard, this module adds to the step directory::

    <root>/<job>/step-<step:012d>/__<rank>_0.distcp          the rank's items as FileSystemWriter writes them
                                                              (tensors torch.save'd one after the other, bytes raw)
    <root>/<job>/step-<step:012d>/dcp-index-<rank:06d>.json  item key -> [offset, length] in that file; rank 0's
                                                              also carries the DCP metadata (safe encoding, no pickle)
    <root>/<job>/step-<step:012d>/.metadata                   pickled DCP ``Metadata`` (FileSystemReader's format),
                                                              written LAST, once every rank's index exists

so ``torch.distributed.checkpoint.load(sd, storage_reader=FileSystemReader("<root>/<job>/step-<step>"))`` loads the
step with only torch installed. memstore itself never unpickles anything: ``.metadata`` is written for DCP's reader.

How, without slowing or risking the spill:

* The spiller's hook (:func:`after_publish`, called by ``Spiller.spill_step`` for each published rank) only looks
  at the shard's header in RAM for the DCP marker (no torch import, no decode) and queues the rank.
* One thread per spiller (``dcp-export``) reads the published shard back from durable storage (every chunk
  verified against its capture checksum), decodes it, writes the data file, then the index (both atomically on
  a local filesystem: temporary name + rename).
* After writing an index, the exporter writes ``.metadata`` if every rank's index exists. Every store does that
  check after its own write, so the last one to finish sees them all; the check is also retried for about a
  minute (listings of object stores may lag).
* Failures are logged and retried a few times with backoff; the spill never waits for them and never fails
  because of them. A store that restarts re-queues ranks whose index is missing when it spills the step again.

Which URLs: by default only local filesystems (``file://``), where the copy is what plain DCP reads. The
environment variable ``MEMSTORE_SPILL_DCP_EXPORT`` of the store overrides it: ``auto`` (default), ``on`` (any
fsspec URL), ``off``. The copy costs about the uncompressed size of the step again in durable storage.

Retention: when the spiller deletes a step, :func:`doomed_paths` adds these files (the owned ranks' data
files and indexes, ``.metadata`` by whichever store gets there first) to the same deletion; ``.metadata`` goes
before the data files. An exporter that loses a race with retention removes what it wrote.
"""

from __future__ import annotations

import heapq
import io
import json
import logging
import os
import pickle
import re
import struct
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memstore.errors import LayoutError, SpillExportError, SpillStorageError
from memstore.spill import layout
from memstore.spill.reader import read_manifest, read_shard
from memstore.spill.storage import Durable

if TYPE_CHECKING:
    from memstore.core.model import Manifest
    from memstore.spill.port import SpillerView as Spiller


log = logging.getLogger(__name__)

ENV_MODE = "MEMSTORE_SPILL_DCP_EXPORT"
METADATA_FILE = ".metadata"  # torch.distributed.checkpoint.filesystem._metadata_fn
INDEX_FORMAT = "memstore-dcp-export"
INDEX_VERSION = 1
SHARD_FORMAT = "memstore-dcp"  # trainer_client.dcp.SHARD_FORMAT (not imported here: it pulls in torch)
SHARD_VERSION = 1
EXPORT_ATTEMPTS = 5  # per rank; backoff 1, 2, 4, 8 s between them
METADATA_RECHECKS = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)  # after writing an index while other ranks' were missing

# A memstore shard starts with MAGIC | u32 version | u64 header length, then the header JSON. MemStoreWriter's
# shards are dicts whose first key is "format", so their encoded tree starts with this (compact JSON):
_PRELUDE = struct.Struct("<8sIQ")
_MAGIC = b"MSTSHRD1"
_DCP_MARKER = b'"root":["d","format","memstore-dcp",'

EXTRA_FILE = re.compile(r"(?:__(\d+)_0\.distcp|dcp-index-(\d{6})\.json|(\.metadata))(?:\.tmp-[0-9a-f]+)?$")


def data_file_name(rank: int) -> str:
    return f"__{rank}_0.distcp"


def index_path(root: str, job_id: str, step: int, rank: int) -> str:
    return f"{layout.step_dir(root, job_id, step)}/dcp-index-{rank:06d}.json"


def data_path(root: str, job_id: str, step: int, rank: int) -> str:
    return f"{layout.step_dir(root, job_id, step)}/{data_file_name(rank)}"


def metadata_path(root: str, job_id: str, step: int) -> str:
    return f"{layout.step_dir(root, job_id, step)}/{METADATA_FILE}"


def enabled(durable: Durable) -> bool:
    mode = os.environ.get(ENV_MODE, "auto").strip().lower()
    if mode in ("off", "0", "false", "no"):
        return False
    if mode in ("on", "1", "true", "yes", "always"):
        return True
    return durable.local


def looks_like_dcp(view: memoryview) -> bool:
    """Cheap test on a shard's bytes: a MemStoreWriter shard? (header bytes only; false positives are re-checked)."""
    if len(view) < _PRELUDE.size:
        return False
    magic, _, header_len = _PRELUDE.unpack_from(view, 0)
    if magic != _MAGIC or header_len > len(view) - _PRELUDE.size:
        return False
    return bytes(view[_PRELUDE.size : _PRELUDE.size + header_len]).find(_DCP_MARKER) >= 0


# --------------------------------------------------------------------------------------------
# the hook and the exporter thread
# --------------------------------------------------------------------------------------------


def after_publish(spiller: Spiller, shard: Manifest) -> None:
    """Called by the spiller after ``shard``'s rank of its step is published (or found published)."""
    if not enabled(spiller.durable):
        return
    with spiller.source.pinned_bytes(shard.key) as view:
        if view is None or not looks_like_dcp(view):
            return
    exporter_for(spiller).submit(shard.key.job_id, shard.key.step, shard.key.rank)


_EXPORTERS: weakref.WeakKeyDictionary[Any, Exporter] = weakref.WeakKeyDictionary()
_EXPORTERS_LOCK = threading.Lock()


def exporter_for(spiller: Spiller) -> Exporter:
    with _EXPORTERS_LOCK:
        exporter = _EXPORTERS.get(spiller)
        if exporter is None:
            exporter = Exporter(spiller.durable, stop=spiller.stopping, max_rate=spiller.max_rate)
            _EXPORTERS[spiller] = exporter
        return exporter


@dataclass(order=True)
class _Task:
    due: float
    job_id: str
    step: int
    rank: int  # -1: only (re)check whether .metadata can be written
    attempt: int = 0


class Exporter:
    """Work queue of (job, step, rank) exports, run by one daemon thread that ends with the spiller."""

    def __init__(self, durable: Durable, stop: threading.Event | None = None, max_rate: int = 0) -> None:
        self.durable = durable
        self.max_rate = max_rate  # bytes/s of data files, like --spill-max-rate (0 = unlimited)
        self.stop = stop or threading.Event()
        self._cond = threading.Condition()
        self._heap: list[_Task] = []
        self._queued: set[tuple[str, int, int]] = set()
        self._thread: threading.Thread | None = None
        self.exported = 0  # ranks written by this store (for debugging)
        self.published = 0  # .metadata files written by this store

    def submit(self, job_id: str, step: int, rank: int, delay: float = 0.0, attempt: int = 0) -> None:
        with self._cond:
            if (job_id, step, rank) in self._queued:
                return
            self._queued.add((job_id, step, rank))
            heapq.heappush(self._heap, _Task(time.monotonic() + delay, job_id, step, rank, attempt))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="dcp-export", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _next(self) -> _Task | None:
        with self._cond:
            while not self.stop.is_set():
                if self._heap and self._heap[0].due <= time.monotonic():
                    task = heapq.heappop(self._heap)
                    self._queued.discard((task.job_id, task.step, task.rank))
                    return task
                wait = 0.5 if not self._heap else min(0.5, self._heap[0].due - time.monotonic())
                self._cond.wait(max(0.01, wait))
        return None

    def _loop(self) -> None:
        while (task := self._next()) is not None:
            try:
                self.run(task)
            except Exception as exc:  # never let one step stop the thread
                if isinstance(exc, SpillStorageError) and task.rank >= 0 and task.attempt + 1 < EXPORT_ATTEMPTS:
                    delay = 2.0**task.attempt
                    log.warning("DCP export of %s step %d rank %d failed (retry in %.0fs): %s", task.job_id, task.step, task.rank,
                                delay, exc)  # fmt: skip
                    self.submit(task.job_id, task.step, task.rank, delay=delay, attempt=task.attempt + 1)
                else:
                    log.error("DCP export of %s step %d (rank %d) abandoned: %s", task.job_id, task.step, task.rank, exc,
                              exc_info=not isinstance(exc, (SpillStorageError, SpillExportError, LayoutError)))  # fmt: skip

    def run(self, task: _Task) -> None:
        if task.rank >= 0:
            outcome = export_rank(self.durable, task.job_id, task.step, task.rank, self.max_rate)
            if outcome == "skipped":
                return
            self.exported += outcome == "written"
        state = publish_metadata(self.durable, task.job_id, task.step)
        if state == "written":
            self.published += 1
        elif state == "waiting":
            recheck = 0 if task.rank >= 0 else task.attempt + 1
            if recheck < len(METADATA_RECHECKS):
                self.submit(task.job_id, task.step, -1, delay=METADATA_RECHECKS[recheck], attempt=recheck)
            else:
                log.warning("DCP export of %s step %d: not every rank's index appeared; no .metadata written", task.job_id, task.step)


# --------------------------------------------------------------------------------------------
# reading spilled shards back
# --------------------------------------------------------------------------------------------


def check_dcp_shard(shard: Any, job_id: str, step: int, rank: int) -> dict[str, Any] | None:
    """``shard`` as a MemStoreWriter shard of (job, step, rank); None if it is not one; raises if malformed."""
    if not isinstance(shard, dict) or shard.get("format") != SHARD_FORMAT:
        return None
    where = f"{job_id} step {step} rank {rank}"
    if shard.get("version") != SHARD_VERSION:
        raise SpillExportError(f"{where}: DCP shard version {shard.get('version')!r}, expected {SHARD_VERSION}")
    world = shard.get("world_size")
    if type(world) is not int or not 0 <= rank < world or shard.get("step") != step or shard.get("rank") != rank:
        raise SpillExportError(f"{where}: DCP shard says step {shard.get('step')!r} rank {shard.get('rank')!r} world {world!r}")
    if not isinstance(shard.get("items"), dict) or not all(isinstance(k, str) for k in shard["items"]):
        raise SpillExportError(f"{where}: DCP shard without a str-keyed items dict")
    if rank == 0 and "metadata" not in shard:
        raise SpillExportError(f"{where}: the coordinator's DCP shard carries no metadata")
    return shard


# --------------------------------------------------------------------------------------------
# writing the FileSystemWriter layout
# --------------------------------------------------------------------------------------------


def _item_bytes(value: Any) -> memoryview | bytes:
    """One DCP item exactly as FileSystemWriter's ``_write_item`` stores it: bytes raw, tensors via torch.save."""
    import torch

    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if not isinstance(value, torch.Tensor):
        raise SpillExportError(f"DCP item of type {type(value).__qualname__}: expected a tensor or bytes")
    tensor = value.detach()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size() or not tensor.is_contiguous():
        tensor = tensor.clone(memory_format=torch.contiguous_format)  # torch.save writes a view's whole storage
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getbuffer()


def export_rank(durable: Durable, job_id: str, step: int, rank: int, max_rate: int = 0) -> str:
    """Write ``rank``'s data file and index for a published DCP step: "written", "exists" or "skipped" (nothing to do)."""
    index_file = index_path(durable.root, job_id, step, rank)
    manifest_file = layout.manifest_path(durable.root, job_id, step, rank)
    if not durable.exists(manifest_file):
        return "skipped"  # not published (any more)
    if durable.exists(index_file):
        return "exists"
    from trainer_client import serialization  # torch: imported only once a DCP step is seen

    manifest = read_manifest(durable, job_id, step, rank)
    raw = read_shard(durable, manifest)
    shard = check_dcp_shard(serialization.decode(raw, zero_copy=True), job_id, step, rank)
    if shard is None:
        return "skipped"  # a plain shard that merely contains the marker text
    items: dict[str, Any] = shard["items"]
    offsets: dict[str, list[int]] = {}
    data_name = data_file_name(rank)

    def pieces() -> Iterator[memoryview | bytes]:
        started = time.monotonic()
        position = 0
        for key, value in items.items():
            data = _item_bytes(value)
            offsets[key] = [position, len(data)]
            position += len(data)
            yield data
            if max_rate:
                ahead = position / max_rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)

    target = data_path(durable.root, job_id, step, rank)
    written = durable.write_stream(target, pieces())
    index: dict[str, Any] = {
        "format": INDEX_FORMAT,
        "version": INDEX_VERSION,
        "job_id": job_id,
        "step": step,
        "rank": rank,
        "world_size": shard["world_size"],
        "data_file": data_name,
        "data_bytes": written,
        "items": offsets,
    }
    if rank == 0:
        index["metadata"] = shard["metadata"]
    durable.write_small(index_file, json.dumps(index, separators=(",", ":"), allow_nan=False).encode())
    if not durable.exists(manifest_file):  # retention deleted the step meanwhile: leave nothing behind
        durable.delete([index_file, target])
        durable.remove_empty_dirs([layout.step_dir(durable.root, job_id, step)])
        return "skipped"
    log.info("DCP export of %s step %d rank %d: %d bytes in %s", job_id, step, rank, written, data_name)
    return "written"


def read_index(durable: Durable, job_id: str, step: int, rank: int) -> dict[str, Any]:
    path = index_path(durable.root, job_id, step, rank)
    try:
        index = json.loads(durable.read(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpillExportError(f"{path} is not valid JSON: {exc}") from None
    ok = (
        isinstance(index, dict)
        and index.get("format") == INDEX_FORMAT
        and index.get("version") == INDEX_VERSION
        and (index.get("job_id"), index.get("step"), index.get("rank")) == (job_id, step, rank)
        and type(index.get("world_size")) is int
        and index.get("data_file") == data_file_name(rank)
        and isinstance(index.get("items"), dict)
    )
    if not ok:
        raise SpillExportError(f"{path} is not a DCP export index of {job_id} step {step} rank {rank}")
    return index


def build_metadata(indexes: Mapping[int, Mapping[str, Any]]) -> Any:
    """DCP ``Metadata`` pointing at the data files: MemStoreStorageInfo(rank, key) -> _StorageInfo(file, offset, length)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from trainer_client.dcp import MemStoreStorageInfo, decode_metadata

    metadata = decode_metadata(indexes[0]["metadata"])
    storage: dict[Any, Any] = {}
    for index, info in (metadata.storage_data or {}).items():
        if not isinstance(info, MemStoreStorageInfo) or info.rank not in indexes:
            raise SpillExportError(f"DCP metadata names {info!r} for {index}, which no rank's index holds")
        span = indexes[info.rank]["items"].get(info.key)
        if not (isinstance(span, list) and len(span) == 2 and all(type(v) is int and v >= 0 for v in span)):
            raise SpillExportError(f"rank {info.rank}'s DCP export index has no item {info.key!r}")
        storage[index] = _StorageInfo(relative_path=indexes[info.rank]["data_file"], offset=span[0], length=span[1])
    metadata.storage_data = storage
    return metadata


def publish_metadata(durable: Durable, job_id: str, step: int) -> str:
    """Write the step's ``.metadata`` once every rank's index exists: "written", "exists", "waiting" or "gone"."""
    step_dir = layout.step_dir(durable.root, job_id, step)
    target = metadata_path(durable.root, job_id, step)
    names = {path.rstrip("/").rsplit("/", 1)[-1] for path in durable.list_files(step_dir)}
    if METADATA_FILE in names:
        return "exists"
    if "dcp-index-000000.json" not in names:
        return "waiting" if names else "gone"
    world = read_index(durable, job_id, step, 0)["world_size"]
    if any(f"dcp-index-{r:06d}.json" not in names for r in range(world)):
        return "waiting"
    indexes = {r: read_index(durable, job_id, step, r) for r in range(world)}
    if any(index["world_size"] != world for index in indexes.values()):
        raise SpillExportError(f"{job_id} step {step}: the ranks' DCP export indexes disagree on the world size")
    metadata = build_metadata(indexes)
    durable.write_small(target, pickle.dumps(metadata))  # default protocol, as FileSystemWriter
    if not all(durable.exists(layout.manifest_path(durable.root, job_id, step, r)) for r in range(world)):
        durable.delete([target])  # retention is deleting the step: do not leave a .metadata pointing at nothing
        return "gone"
    log.info("DCP export of %s step %d complete: %s written (%d ranks)", job_id, step, target, world)
    return "written"


# --------------------------------------------------------------------------------------------
# retention
# --------------------------------------------------------------------------------------------


def doomed_paths(durable: Durable, job_id: str, step: int, ranks: set[int]) -> list[str]:
    """Export files to delete with a doomed step: ``ranks``' data files and indexes, and the step's .metadata.

    Only files that exist (a missing one would stop a multi-file delete). Never raises: returns [] instead.
    """
    try:
        found = durable.list_files(layout.step_dir(durable.root, job_id, step))
    except Exception as exc:
        log.warning("listing %s step %d for DCP export files failed: %s", job_id, step, exc)
        return []
    out: list[str] = []
    for path in found:
        m = EXTRA_FILE.fullmatch(path.rstrip("/").rsplit("/", 1)[-1])
        if m is None:
            continue
        rank = m.group(1) or m.group(2)
        if m.group(3) or (rank is not None and int(rank) in ranks):
            out.append(path)
    return out


class DcpExport:
    """The plain-DCP copy of spilled DCP steps, as a ``memstore.spill.port.SpillListener``."""

    def published(self, spiller: Spiller, shard: Manifest) -> None:
        after_publish(spiller, shard)

    def doomed_paths(self, durable: Durable, job_id: str, step: int, ranks: set[int]) -> list[str]:
        return doomed_paths(durable, job_id, step, ranks)
