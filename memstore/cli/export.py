"""``memstore export``: one standard ``torch.save`` file of a checkpoint step, e.g. for a model release.

::

    memstore export --job J [--step N|latest] --to model.pt [--force] --store 127.0.0.1:7070
    memstore export --job J [--step N|latest] --to model.pt [--force] --spill file:///data/ckpt [--spill-options ...]

Sources: a running cluster (``--store``: any store of it; every rank's shard of the step is read through it,
from RAM, a peer or durable storage), or durable storage directly (``--spill``: the spill layout's manifests
and shards, every chunk verified against its capture checksum) when no store runs.

What the file holds (``torch.load(path, weights_only=True)`` reads it back):

* a step saved with ``CheckpointClient`` by one rank: that rank's state, as saved;
* a step saved with ``CheckpointClient`` by W > 1 ranks: ``{rank: state}`` for rank 0..W-1 (int keys);
* a step saved through DCP (``trainer_client.dcp.MemStoreWriter``), whatever its world size: the consolidated
  full state dict, as ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` would write it: sharded
  tensors (DTensor / ShardedTensor) assembled into full tensors, the nesting rebuilt from DCP's metadata (so,
  as with any DCP checkpoint, nested dict keys come back as strings, e.g. optimizer ``state`` keys ``"0"``), and
  non-tensor values loaded with ``torch.load(weights_only=True)``: memstore never unpickles arbitrary objects,
  so a value that needs full unpickling makes the export fail with a message naming it.

Everything is assembled in this process's memory (all ranks' shards plus the output), then written to a
temporary file beside ``--to`` and renamed into place; an existing file is never overwritten without ``--force``.
Exit status: 0 on success, 2 with a message naming what was wrong (unknown job or step, unreachable store,
unwritable path, corrupt data).
"""

from __future__ import annotations

import argparse
import errno
import io
import itertools
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memstore.cli import render
from memstore.cli.common import add_credential_arguments
from memstore.errors import ExportFailed
from memstore.v1.keys import job_id_problem

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

HELP = "write one step as a standard torch.save file (from a cluster or durable storage)"


@dataclass
class Step:
    job_id: str
    step: int
    world_size: int
    shards: list[Any]
    source: str


# --------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------


def parse_step(text: str) -> int | None:
    if text == "latest":
        return None
    if text.isascii() and text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"invalid step {text!r}: expected 'latest' or an int >= 0")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", required=True, help="job id of the checkpoint")
    p.add_argument("--step", type=parse_step, default=None, metavar="N|latest", help="step to export (default: latest complete step)")
    p.add_argument("--to", required=True, metavar="PATH", help="output file (torch.save format)")
    p.add_argument("--force", action="store_true", help="overwrite PATH if it exists")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--store", metavar="ADDR", help="read from a running cluster through this store")
    source.add_argument("--spill", metavar="URL", help="read from durable storage (the stores' --spill URL), no store needed")
    p.add_argument("--spill-options", default="", metavar="OPTS", help="fsspec options for --spill (JSON or KEY=VALUE,...)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the store to answer (--store)")
    add_credential_arguments(p)


def run(args: argparse.Namespace) -> int:
    try:
        problem = job_id_problem(args.job)
        if problem:
            raise ExportFailed(f"--job: {problem}")
        check_destination(args.to, args.force)
        if args.store:
            found = read_from_store(args.store, args.job, args.step, args.timeout)
        else:
            found = read_from_durable(args.spill, args.spill_options, args.job, args.step)
        state, kind = build_output(found)
        size = write_atomically(state, args.to, args.force)
    except ExportFailed as exc:
        print(f"memstore export: error: {exc}", file=sys.stderr)
        return 2
    print(f"exported job {args.job} step {found.step} ({found.world_size} rank{'s' if found.world_size > 1 else ''}, {kind}) "
          f"from {found.source} to {args.to} ({size} bytes)")  # fmt: skip
    return 0


# --------------------------------------------------------------------------------------------
# sources
# --------------------------------------------------------------------------------------------


def read_from_store(address: str, job_id: str, step: int | None, timeout: float) -> Step:
    """Every rank's shard of ``step`` (None: the newest complete step) through the store at ``address``."""
    from trainer_client import CheckpointClient, Connection
    from trainer_client.errors import MemstoreClientError, NotFoundError, StoreUnavailableError

    where = f"the cluster of store {address}"
    try:
        with CheckpointClient(job_id, 0, 1, connection=Connection(address, timeout=timeout)) as probe:
            point = probe.restore_point(step)
            if point is None:
                what = f"job {job_id!r} has no complete step" if step is None else f"step {step} of job {job_id!r} is not complete"
                note = f": {probe.stats().last_restore_note}" if probe.stats().last_restore_note else ""
                raise ExportFailed(f"{what} on {where}{note}")
        shards: list[Any] = []
        with (
            CheckpointClient(job_id, 0, point.world_size, connection=Connection(address, timeout=timeout)) as client,
            render.progress(f"reading step {point.step} of {job_id}", point.world_size) as advance,
        ):
            for rank in range(point.world_size):
                try:
                    # zero_copy=False: tensors own their memory, so torch.save writes just them
                    shards.append(client.load(point.step, rank=rank, zero_copy=False, timeline=point.timeline))
                except NotFoundError as exc:
                    raise ExportFailed(
                        f"step {point.step} of job {job_id!r} is incomplete on {where}: rank {rank} of {point.world_size}: {exc}"
                    ) from None
                advance(1)
    except StoreUnavailableError as exc:
        raise ExportFailed(f"store {address} is unreachable: {exc}") from None
    except MemstoreClientError as exc:
        raise ExportFailed(f"reading job {job_id!r} from {where} failed: {exc}") from None
    return Step(job_id, point.step, point.world_size, shards, f"store {address}")


def read_from_durable(url: str, options: str, job_id: str, step: int | None) -> Step:
    """Every rank's shard of ``step`` (None: the newest complete step) from durable storage at ``url``."""
    from memstore.errors import LayoutError, SpillStorageError
    from memstore.spill import layout
    from memstore.spill.reader import read_manifest, read_shard
    from memstore.spill.storage import Durable, parse_options
    from trainer_client import serialization
    from trainer_client.errors import CorruptShardError

    try:
        durable = Durable(url, parse_options(options))
    except (ValueError, SpillStorageError) as exc:
        raise ExportFailed(str(exc)) from None
    try:
        published: dict[int, set[int]] = {}
        for path in durable.list_files(layout.job_dir(durable.root, job_id)):
            parts = path.rstrip("/").split("/")
            m_step = layout.STEP_DIR.match(parts[-2]) if len(parts) >= 2 else None
            m_rank = layout.RANK_FILE.fullmatch(parts[-1])
            if m_step and m_rank and m_rank.group(2) == "json" and not m_rank.group(3):
                published.setdefault(int(m_step.group(1)), set()).add(int(m_rank.group(1)))
        if not published:
            raise ExportFailed(f"job {job_id!r} has no spilled steps in {url}")
        worlds = {s: read_manifest(durable, job_id, s, min(ranks)).world_size for s, ranks in published.items()}
        complete = sorted(s for s, ranks in published.items() if ranks == set(range(worlds[s])))
        if step is None:
            if not complete:
                raise ExportFailed(f"job {job_id!r} has no complete spilled step in {url} (partial: {sorted(published)})")
            step = complete[-1]
        elif step not in published:
            raise ExportFailed(f"step {step} of job {job_id!r} is not in {url} (complete spilled steps: {complete or 'none'})")
        elif step not in complete:
            missing = sorted(set(range(worlds[step])) - published[step])
            raise ExportFailed(f"step {step} of job {job_id!r} is incomplete in {url}: ranks {missing} of {worlds[step]} not published")
        world = worlds[step]
        shards: list[Any] = []
        with render.progress(f"reading step {step} of {job_id}", world) as advance:
            for rank in range(world):
                raw = read_shard(durable, read_manifest(durable, job_id, step, rank))
                shards.append(serialization.decode(raw))  # copies out: the buffer is dropped right after
                del raw
                advance(1)
    except (SpillStorageError, LayoutError, CorruptShardError) as exc:
        raise ExportFailed(f"reading job {job_id!r} from {url} failed: {exc}") from None
    return Step(job_id, step, world, shards, url)


# --------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------


def build_output(found: Step) -> tuple[Any, str]:
    """(object to torch.save, kind): the state for one rank, {rank: state} for several, the full state for DCP."""
    from memstore.errors import SpillExportError
    from memstore.interop.dcp_export import check_dcp_shard

    try:
        dcp = [check_dcp_shard(shard, found.job_id, found.step, rank) for rank, shard in enumerate(found.shards)]
    except SpillExportError as exc:
        raise ExportFailed(str(exc)) from None
    if any(d is not None for d in dcp):
        if not all(d is not None for d in dcp):
            raise ExportFailed(f"step {found.step}: some ranks' shards were written by MemStoreWriter (DCP) and some not")
        return consolidate_dcp(found.shards), "DCP, consolidated"
    if found.world_size == 1:
        return found.shards[0], "one rank's state"
    return dict(enumerate(found.shards)), "{rank: state}"


def consolidate_dcp(shards: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The full state dict of a DCP step from its ranks' MemStoreWriter shards (DCP's metadata says where all is)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

    from trainer_client.dcp import MemStoreStorageInfo, decode_metadata
    from trainer_client.errors import CorruptShardError

    try:
        metadata = decode_metadata(shards[0]["metadata"])
    except CorruptShardError as exc:
        raise ExportFailed(f"rank 0's DCP metadata is corrupt: {exc}") from None
    storage = metadata.storage_data or {}
    planner_data = metadata.planner_data or {}

    def item(index: Any) -> Any:
        info = storage.get(index)
        if not isinstance(info, MemStoreStorageInfo) or not 0 <= info.rank < len(shards):
            raise ExportFailed(f"DCP metadata has no memstore location for {index}")
        items = shards[info.rank]["items"]
        if info.key not in items:
            raise ExportFailed(f"DCP item {info.key!r} is named by the metadata but missing from rank {info.rank}'s shard")
        return items[info.key]

    out: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        value: Any
        if isinstance(md, BytesStorageMetadata):
            value = _load_bytes_value(fqn, item(MetadataIndex(fqn)))
        elif isinstance(md, TensorStorageMetadata):
            value = _assemble_tensor(fqn, md, item)
        else:
            raise ExportFailed(f"DCP entry {fqn!r} has unknown storage metadata {type(md).__qualname__}")
        path = planner_data.get(fqn) or (fqn,)
        _set_element(out, tuple(path), value)
    return out


def _load_bytes_value(fqn: str, raw: Any) -> Any:
    """A non-tensor DCP value, loaded with ``torch.load(weights_only=True)``: never unpickling arbitrary objects."""
    import torch

    if not isinstance(raw, (bytes, bytearray)):
        raise ExportFailed(f"DCP item {fqn!r}: expected bytes, found {type(raw).__qualname__}")
    try:
        return torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as exc:
        raise ExportFailed(
            f"DCP value {fqn!r} cannot be loaded with torch.load(weights_only=True) (memstore never unpickles arbitrary "
            f"objects): {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None


def _assemble_tensor(fqn: str, md: TensorStorageMetadata, item: Callable[[Any], Any]) -> Any:
    """The full tensor of DCP entry ``fqn`` from its chunks (where ``md`` says they go); ``item(index)`` is a stored item."""
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex

    value = torch.empty(md.size, dtype=md.properties.dtype)
    for chunk in md.chunks:
        source = item(MetadataIndex(fqn, chunk.offsets))
        if not isinstance(source, torch.Tensor) or tuple(source.shape) != tuple(chunk.sizes):
            raise ExportFailed(f"DCP chunk {fqn!r} at {list(chunk.offsets)}: stored slice does not have shape {list(chunk.sizes)}")
        target = value
        for dim, (offset, length) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
            target = target.narrow(dim, offset, length)
        target.copy_(source)
    return value


def _set_element(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    """Put ``value`` at ``path`` in ``root``, creating dicts (str keys) and lists (int keys) like DCP's unflattening."""

    def extend(seq: list[Any], index: int) -> None:
        while len(seq) <= index:
            seq.append(None)

    cur: Any = root
    for prev, key in itertools.pairwise(path):
        default: Any = {} if type(key) is str else []
        if isinstance(cur, dict):
            cur = cur.setdefault(prev, default)
        else:
            extend(cur, prev)
            if cur[prev] is None:
                cur[prev] = default
            cur = cur[prev]
    if type(path[-1]) is int:
        extend(cur, path[-1])
    cur[path[-1]] = value


def check_destination(path: str, force: bool) -> None:
    """Fail before reading anything if ``path`` cannot be written (or exists without ``--force``)."""
    if os.path.isdir(path):
        raise ExportFailed(f"--to {path!r} is a directory; name the file to write")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ExportFailed(f"--to {path!r}: directory {parent!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportFailed(f"--to {path!r}: directory {parent!r} is not writable")
    if os.path.lexists(path) and not force:
        raise ExportFailed(f"--to {path!r} exists; pass --force to overwrite it")


def write_atomically(obj: Any, path: str, force: bool) -> int:
    """torch.save ``obj`` to a temporary file beside ``path``, then move it into place. Returns the file size."""
    import torch

    parent = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    except OSError as exc:
        raise ExportFailed(f"--to {path!r} is not writable: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(fh.fileno(), 0o666 & ~umask)  # mkstemp creates 0600; a released model file gets the usual mode
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        size = os.path.getsize(tmp)
        if force:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # fails if path exists, atomically: never clobbers a file created meanwhile
            except FileExistsError:
                raise ExportFailed(f"--to {path!r} exists; pass --force to overwrite it") from None
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                    raise
                if os.path.lexists(path):  # a filesystem without hard links: check, then rename
                    raise ExportFailed(f"--to {path!r} exists; pass --force to overwrite it") from None
                os.replace(tmp, path)
        dir_fd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return size
    except OSError as exc:
        raise ExportFailed(f"writing {path!r} failed: {exc.strerror or exc}") from None
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
