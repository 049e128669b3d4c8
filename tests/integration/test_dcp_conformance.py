"""DCP conformance: MemStoreWriter/MemStoreReader behave exactly like torch's FileSystemWriter/FileSystemReader.

Cases are ported (rewritten for CPU, gloo and this suite's time budget) from PyTorch's own DCP tests:
test_file_system_checkpoint_cpu.py (tensors + blobs, ShardedTensor save and reshard, bytes), test_dtensor_resharding.py
(placement and mesh changes, here also world-size changes 4 -> 2, 4 -> 1, 2 -> 4), test_compatibility.py (storage_meta
ids, legacy ShardedTensor TensorProperties), test_planner.py (missing keys, partial loads, dtype casts) and
e2e/test_e2e_save_and_load.py (Stateful objects, overwrite, async_save in process mode, empty state).

Every test runs once per backend (``file`` in the slow stage): ``file`` (FileSystemWriter/Reader under tmp_path) and ``memstore``
(MemStoreWriter/Reader on a LocalCluster of two stores, shared by the module), and asserts the same outcome:
bit-exact values, the same exception types and messages where DCP reports them. A difference between the two
backends fails one of the two runs. Rank processes are forked from a forkserver (tests/harness/ranks.py), gloo on
127.0.0.1.
"""

from __future__ import annotations

import io
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from unittest.mock import patch

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from memstore.testing import LocalCluster, free_ports
from tests.harness.inprocess import InProcessCluster
from tests.harness.ranks import PROCESS_TIMEOUT, forkserver_fixture, run_ranks
from tests.harness.torch_versions import LOAD_SAYS_METADATA_IS_NONE, LOAD_WRAPS_READER_ERROR
from trainer_client.dcp import MemStoreReader, MemStoreWriter
from trainer_client.errors import NotFoundError

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:Detected an existing checkpoint"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

# The ``file`` runs check the cases themselves against torch's own backend (what DCP does): the slow stage runs them, the
# default suite only memstore's (about half of this file's minute).
BACKENDS = (pytest.param("file", marks=pytest.mark.slow), "memstore")
OVERWRITE_WARNING = r"Detected an existing checkpoint.*overwriting since self\.overwrite=True"


# ---------------------------------------------------------------------------------------------
# the two backends behind one interface (picklable: rank processes get it as an argument)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Backend:
    """Checkpoint ``(name, step)``: a directory ``root/name/step`` (file) or step ``step`` of job ``prefix-name`` (memstore)."""

    kind: str
    root: str  # file: a directory; memstore: the prefix of the job ids
    stores: tuple[str, ...] = ()  # memstore: store addresses; rank r saves and loads through stores[r % len]

    def _store(self, rank: int) -> str:
        return self.stores[rank % len(self.stores)]

    def job(self, name: str) -> str:
        return f"{self.root}-{name}"

    def writer(self, name: str, step: int, rank: int = 0, **kwargs: Any) -> StorageWriter:
        if self.kind == "file":
            return FileSystemWriter(os.path.join(self.root, name, str(step)), **kwargs)
        return MemStoreWriter(self.job(name), step, store=self._store(rank), **kwargs)

    def reader(self, name: str, step: int, rank: int = 0) -> StorageReader:
        if self.kind == "file":
            return FileSystemReader(os.path.join(self.root, name, str(step)))
        return MemStoreReader(self.job(name), step, store=self._store(rank))

    def checkpoint_id(self, name: str, step: int) -> str:
        """What ``dcp.save/load(checkpoint_id=...)`` takes for this checkpoint (goes through ``reset``)."""
        if self.kind == "file":
            return os.path.join(self.root, name, str(step))
        return f"memstore://{self.job(name)}/{step}"

    def unnamed_writer(self, name: str, rank: int = 0) -> StorageWriter:
        """A writer whose checkpoint comes from ``checkpoint_id`` only."""
        if self.kind == "file":
            return FileSystemWriter(os.path.join(self.root, "unused"))
        return MemStoreWriter(self.job(name), store=self._store(rank))

    def unnamed_reader(self, name: str, rank: int = 0) -> StorageReader:
        if self.kind == "file":
            return FileSystemReader(os.path.join(self.root, "unused"))
        return MemStoreReader(self.job(name), store=self._store(rank))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[LocalCluster]:  # type: ignore[no-untyped-def]
    c = InProcessCluster(workdir=tmp_path_factory.mktemp("dcp-conformance"), hosts=2, replicas=2)
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path) -> Backend:  # type: ignore[no-untyped-def]
    if request.param == "file":
        return Backend("file", str(tmp_path))
    c: LocalCluster = request.getfixturevalue("cluster")
    prefix = re.sub(r"[^A-Za-z0-9._-]", "-", request.node.name)[:80]  # one job namespace per test
    return Backend("memstore", prefix, (c.address("h0"), c.address("h1")))


forkserver = forkserver_fixture(__name__)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _bits_equal(a: Any, b: Any) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    )


def _assert_same(expected: Any, actual: Any, path: str = "state") -> None:
    """Bit-exact equality of nested state (tensors by bytes, NaN payloads included)."""
    if isinstance(expected, torch.Tensor):
        assert _bits_equal(expected, actual), f"{path}: {expected!r} != {actual!r}"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and list(expected) == list(actual), f"{path}: keys {list(expected)} != {list(actual)}"
        for k in expected:
            _assert_same(expected[k], actual[k], f"{path}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(expected) is type(actual) and len(expected) == len(actual), f"{path}: {expected!r} != {actual!r}"
        for i, (x, y) in enumerate(zip(expected, actual, strict=True)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert type(expected) is type(actual) and expected == actual, f"{path}: {expected!r} != {actual!r}"


def _failure_types(exc: CheckpointException) -> dict[int, type]:
    """Rank -> type of the exception DCP collected from it (DCP keeps (exception, traceback) pairs)."""
    return {rank: type(failure[0] if isinstance(failure, tuple) else failure) for rank, failure in exc.failures.items()}


def _init_group(rank: int, world: int, port: int) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # keep gloo (and DCP's checkpoint daemon) on loopback
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


class BlobState:
    """A Stateful holding raw bytes (test_file_system_checkpoint_cpu's BlobState)."""

    def __init__(self, value: bytes) -> None:
        self.state = {"blob": value}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = state_dict


class TrainState:
    """A Stateful mixing tensors and a BytesIO of torch.save'd losses (e2e's TestTrainState)."""

    def __init__(self, step: int = 0, losses: list[float] | None = None) -> None:
        self.step, self.losses = step, list(losses or [])
        self.loaded_in_place = False

    def state_dict(self) -> dict[str, Any]:
        buf = io.BytesIO()
        torch.save(self.losses, buf)
        return {"step": torch.tensor(self.step, dtype=torch.int32), "losses": buf}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"].item())
        state_dict["losses"].seek(0)
        self.losses = torch.load(state_dict["losses"])
        self.loaded_in_place = True


def _rich_state(seed: int) -> dict[str, Any]:
    """Nested dicts of tensors of many dtypes and layouts, non-tensor values, bytes and Stateful objects."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "linear_1": {"weight": torch.randn(5, 5, generator=g), "bias": torch.randn(5, generator=g)},
            "emb": torch.randn(5, 10, generator=g).to(torch.bfloat16),
        },
        "odd": {
            "f16": torch.randn(3, 4, generator=g).to(torch.float16),
            "i8": torch.randint(-128, 127, (7,), generator=g, dtype=torch.int8),
            "u8": torch.randint(0, 255, (2, 3), generator=g, dtype=torch.uint8),
            "i64": torch.randint(-(2**40), 2**40, (6,), generator=g),
            "mask": torch.rand(9, generator=g) > 0.5,
            "c64": torch.randn(3, generator=g, dtype=torch.complex64),
            "scalar": torch.tensor(3.25, dtype=torch.float64),
            "transposed": torch.randn(4, 6, generator=g).t(),
            "empty": torch.zeros(0, 3),
            "nan_payload": torch.tensor([0x7FC00001, 0x7F800123, -(2**31)], dtype=torch.int32).view(torch.float32),
        },
        "extra": {"epoch": seed, "lr": 0.1, "name": f"run-{seed}", "ids": [1, 2, 3], "pair": (1, "a"), "nothing": None},
        "raw": io.BytesIO(b"raw bytes \x00\xff" * seed),
        "blob": BlobState(b"SomeBlobForTesting" * seed),
        "train_state": TrainState(seed, [0.5 * seed, float(seed)]),
    }


def _blank_like(state: Any) -> Any:
    """Same structure, other values: what a restarted trainer holds before loading."""
    if isinstance(state, torch.Tensor):
        out = torch.empty_like(state) if state.is_contiguous() else torch.empty_like(state.t()).t()
        return out.fill_(7) if out.numel() else out
    if isinstance(state, dict):
        return {k: _blank_like(v) for k, v in state.items()}
    if isinstance(state, io.BytesIO):
        return io.BytesIO(b"")
    if isinstance(state, BlobState):
        return BlobState(b"")
    if isinstance(state, TrainState):
        return TrainState()
    if isinstance(state, tuple):
        return (0, "")
    if isinstance(state, list):
        return []
    if isinstance(state, str):
        return "blank"
    if isinstance(state, (int, float)) and not isinstance(state, bool):
        return type(state)(-1)
    return state


def _plain(state: Any) -> Any:
    """Comparable form: Stateful objects as their state, BytesIO as bytes."""
    if isinstance(state, dict):
        return {k: _plain(v) for k, v in state.items()}
    if isinstance(state, io.BytesIO):
        return state.getvalue()
    if isinstance(state, BlobState):
        return {"blob": state.state["blob"]}
    if isinstance(state, TrainState):
        return {"step": state.step, "losses": state.losses}
    return state


# ---------------------------------------------------------------------------------------------
# single process (no process group)
# ---------------------------------------------------------------------------------------------


def test_round_trip_nested_tensors_bytes_and_stateful(backend: Backend) -> None:
    """test_read_write_tensor_and_blob + e2e's Stateful / BytesIO train state + test_no_dist (an empty state)."""
    state = _rich_state(3)
    expected = _plain(_rich_state(3))
    dcp.save(state, storage_writer=backend.writer("rich", 1))

    loaded = _blank_like(_rich_state(3))
    blob, train_state, model = loaded["blob"], loaded["train_state"], loaded["model"]
    dcp.load(loaded, storage_reader=backend.reader("rich", 1))
    _assert_same(expected, _plain(loaded))
    assert loaded["blob"] is blob and loaded["train_state"] is train_state and train_state.loaded_in_place  # Stateful: in place
    assert loaded["model"] is model  # dicts of tensors are loaded in place too

    # the checkpoint named only through checkpoint_id (DCP calls reset(checkpoint_id) on the storage layer)
    dcp.save(_rich_state(4), storage_writer=backend.unnamed_writer("rich"), checkpoint_id=backend.checkpoint_id("rich", 2))
    again = _blank_like(_rich_state(4))
    dcp.load(again, storage_reader=backend.unnamed_reader("rich"), checkpoint_id=backend.checkpoint_id("rich", 2))
    _assert_same(_plain(_rich_state(4)), _plain(again))

    dcp.save({}, storage_writer=backend.writer("empty", 1))
    empty: dict[str, Any] = {}
    dcp.load(empty, storage_reader=backend.reader("empty", 1))
    assert empty == {}


def test_storage_meta_ids_and_metadata(backend: Backend) -> None:
    """test_compatibility.test_storage_meta: checkpoint_id, save_id and load_id come back in the metadata."""
    writer = backend.writer("meta", 4)
    dcp.save({"a": torch.zeros(4, 4), "b": [1, 2]}, storage_writer=writer)
    reader = backend.reader("meta", 4)
    md = reader.read_metadata()
    assert md.storage_meta is not None
    assert str(md.storage_meta.checkpoint_id) == str(writer.checkpoint_id)  # type: ignore[attr-defined]
    assert md.storage_meta.save_id == writer.save_id  # type: ignore[attr-defined]
    assert md.storage_meta.load_id == reader.load_id  # type: ignore[attr-defined]
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    if hasattr(filesystem, "CURRENT_DCP_VERSION"):  # torch 2.9+ stamps a version on its metadata
        assert md.version == filesystem.CURRENT_DCP_VERSION
    assert sorted(md.state_dict_metadata) == ["a", "b"]
    a_md = md.state_dict_metadata["a"]
    assert isinstance(a_md, TensorStorageMetadata) and a_md.size == torch.Size([4, 4]) and a_md.properties.dtype == torch.float32
    assert isinstance(md.state_dict_metadata["b"], BytesStorageMetadata)


def test_legacy_sharded_tensor_properties_metadata(backend: Backend) -> None:
    """test_compatibility.test_sharded_tensor_dependency: metadata holding _shard's TensorProperties saves and loads."""
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as LegacyTensorProperties
    from torch.distributed.checkpoint import planner_helpers

    value = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    # planner_helpers binds the name at import: patch it there, or the legacy class never reaches the metadata
    with (
        patch("torch.distributed.checkpoint.metadata.TensorProperties", LegacyTensorProperties),
        patch.object(planner_helpers, "TensorProperties", LegacyTensorProperties),
    ):
        dcp.save({"a": value}, storage_writer=backend.writer("legacy", 1))
    md = backend.reader("legacy", 1).read_metadata()
    assert type(md.state_dict_metadata["a"].properties) is LegacyTensorProperties  # type: ignore[union-attr]
    loaded = {"a": torch.zeros(4, 4)}
    dcp.load(loaded, storage_reader=backend.reader("legacy", 1))
    assert _bits_equal(loaded["a"], value)


def test_missing_keys_partial_load_and_dtype_casts(backend: Backend) -> None:
    """test_planner / e2e test_partial_load / test_dtype_mismatch_casting (torch 2.13's default: silent casts)."""
    g = torch.Generator().manual_seed(5)
    saved: dict[str, Any] = {
        "model": {"w": torch.rand(4, 3, generator=g)},
        "optim": {"m": torch.rand(4, 3, generator=g)},
        "half": torch.rand(5, generator=g).bfloat16(),
    }
    dcp.save(saved, storage_writer=backend.writer("partial", 1))

    with pytest.raises(CheckpointException, match=r"Missing key in checkpoint state_dict: model\.nope") as info:
        dcp.load({"model": {"w": torch.zeros(4, 3), "nope": torch.zeros(1)}}, storage_reader=backend.reader("partial", 1))
    assert set(_failure_types(info.value).values()) == {RuntimeError}

    partial = {"model": {"w": torch.zeros(4, 3), "nope": torch.full((1,), 9.0)}}
    dcp.load(partial, storage_reader=backend.reader("partial", 1), planner=DefaultLoadPlanner(allow_partial_load=True))
    assert _bits_equal(partial["model"]["w"], saved["model"]["w"]) and partial["model"]["nope"].item() == 9.0

    only_model = {"model": {"w": torch.zeros(4, 3)}}  # a subset of the checkpoint's keys
    dcp.load(only_model, storage_reader=backend.reader("partial", 1))
    assert _bits_equal(only_model["model"]["w"], saved["model"]["w"])

    casts: dict[str, Any] = {"model": {"w": torch.zeros(4, 3, dtype=torch.bfloat16)}, "half": torch.zeros(5, dtype=torch.float32)}
    dcp.load(casts, storage_reader=backend.reader("partial", 1))  # narrowing fp32 -> bf16, widening bf16 -> fp32
    assert _bits_equal(casts["model"]["w"], saved["model"]["w"].to(torch.bfloat16))
    assert _bits_equal(casts["half"], saved["half"].float())

    # No such checkpoint: each torch fails as it does for FileSystemReader (tests/harness/torch_versions.py)
    with pytest.raises(CheckpointException, match="metadata is None" if LOAD_SAYS_METADATA_IS_NONE else None) as info:
        dcp.load({"w": torch.zeros(1)}, storage_reader=backend.reader("partial", 2))
    reader_error = FileNotFoundError if backend.kind == "file" else NotFoundError
    assert set(_failure_types(info.value).values()) == ({AssertionError} if LOAD_WRAPS_READER_ERROR else {reader_error})


def test_overwrite_single_process(backend: Backend) -> None:
    """e2e test_overwrite: default and overwrite=True replace (with a warning), overwrite=False raises and keeps the old values."""
    t1, t2, t3 = torch.randn(10), torch.randn(10), torch.randn(10)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dcp.save({"random": t1}, storage_writer=backend.writer("ow", 1, overwrite=False))  # nothing there yet: no error
    assert not [w for w in seen if "existing checkpoint" in str(w.message)]
    with pytest.warns(UserWarning, match=OVERWRITE_WARNING):
        dcp.save({"random": t2}, storage_writer=backend.writer("ow", 1))  # the default is overwrite=True
    with pytest.warns(UserWarning, match=OVERWRITE_WARNING):
        dcp.save({"random": t3}, storage_writer=backend.writer("ow", 1, overwrite=True))
    sd = {"random": torch.zeros(10)}
    dcp.load(sd, storage_reader=backend.reader("ow", 1))
    assert _bits_equal(sd["random"], t3)

    with pytest.raises(CheckpointException, match=r"Checkpoint already exists and self\.overwrite=False") as info:
        dcp.save({"random": t1}, storage_writer=backend.writer("ow", 1, overwrite=False))
    assert _failure_types(info.value) == {0: _failure_types(info.value)[0]} and issubclass(_failure_types(info.value)[0], RuntimeError)
    dcp.load(sd, storage_reader=backend.reader("ow", 1))
    assert _bits_equal(sd["random"], t3)  # the refused save changed nothing


# ---------------------------------------------------------------------------------------------
# DTensor resharding across world sizes: 4 -> 2, 4 -> 1, 2 -> 4
# ---------------------------------------------------------------------------------------------


def _full(step: int) -> dict[str, torch.Tensor]:
    """The logical tensors of a step; sizes uneven over 4 ranks on purpose."""
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "w": torch.randn(10, 6, generator=g),
        "b": torch.randn(4, 7, generator=g).to(torch.bfloat16),
        "m": torch.arange(48, dtype=torch.int64).reshape(8, 6) * (step + 1),
        "r": torch.randn(3, 3, generator=g, dtype=torch.float64),
        "plain": torch.randn(5, generator=g),
    }


def _check_full(state: dict[str, Any], step: int, where: str) -> None:
    from torch.distributed.tensor import DTensor

    for k, v in _full(step).items():
        got = state[k].full_tensor() if isinstance(state[k], DTensor) else state[k]
        assert _bits_equal(got, v), f"{where}: {k} differs"
    assert state["extra"] == {"step": step, "tags": ["a", "b"]}, f"{where}: {state['extra']}"


def _reshard_save4_worker(rank: int, backend: Backend, port: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    _init_group(rank, 4, port)
    try:
        mesh, mesh2d = init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2))
        full = _full(1)
        state = {
            "w": distribute_tensor(full["w"], mesh, [Shard(0)]),  # rows 3, 3, 3, 1
            "b": distribute_tensor(full["b"], mesh, [Shard(1)]),  # columns 2, 2, 2, 1
            "m": distribute_tensor(full["m"], mesh2d, [Shard(0), Shard(1)]),
            "r": distribute_tensor(full["r"], mesh, [Replicate()]),
            "plain": full["plain"].clone(),  # a replicated plain tensor: DCP keeps one rank's copy
            "extra": {"step": 1, "tags": ["a", "b"]},
        }
        dcp.save(state, storage_writer=backend.writer("reshard", 1, rank))
    finally:
        dist.destroy_process_group()


def _reshard_load2_save2_worker(rank: int, backend: Backend, port: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, zeros

    _init_group(rank, 2, port)
    try:
        mesh = init_device_mesh("cpu", (2,))
        shapes = {k: v for k, v in _full(1).items()}
        state: dict[str, Any] = {
            "w": zeros(10, 6, device_mesh=mesh, placements=[Shard(1)]),  # other placements than the save
            "b": zeros(4, 7, dtype=torch.bfloat16, device_mesh=mesh, placements=[Replicate()]),
            "m": zeros(8, 6, dtype=torch.int64, device_mesh=mesh, placements=[Shard(0)]),  # 2-D mesh -> 1-D mesh
            "r": zeros(3, 3, dtype=torch.float64, device_mesh=mesh, placements=[Shard(0)]),
            "plain": torch.zeros_like(shapes["plain"]),
            "extra": {"step": 0, "tags": []},
        }
        dcp.load(state, storage_reader=backend.reader("reshard", 1, rank))  # 4 -> 2
        _check_full(state, 1, f"4->2 rank {rank}")
        assert state["w"].to_local().shape == (10, 3)

        full = _full(2)
        state = {
            "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
            "b": distribute_tensor(full["b"], mesh, [Shard(1)]),
            "m": distribute_tensor(full["m"], mesh, [Shard(1)]),
            "r": distribute_tensor(full["r"], mesh, [Shard(0)]),
            "plain": full["plain"].clone(),
            "extra": {"step": 2, "tags": ["a", "b"]},
        }
        dcp.save(state, storage_writer=backend.writer("reshard", 2, rank))
    finally:
        dist.destroy_process_group()


def _reshard_load4_worker(rank: int, backend: Backend, port: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, zeros

    _init_group(rank, 4, port)
    try:
        mesh, mesh2d = init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2))
        state: dict[str, Any] = {
            "w": zeros(10, 6, device_mesh=mesh, placements=[Shard(0)]),
            "b": zeros(4, 7, dtype=torch.bfloat16, device_mesh=mesh, placements=[Shard(0)]),
            "m": zeros(8, 6, dtype=torch.int64, device_mesh=mesh2d, placements=[Shard(1), Shard(0)]),  # 1-D mesh -> 2-D mesh
            "r": zeros(3, 3, dtype=torch.float64, device_mesh=mesh, placements=[Replicate()]),
            "plain": torch.zeros(5),
            "extra": {"step": 0, "tags": []},
        }
        dcp.load(state, storage_reader=backend.reader("reshard", 2, rank))  # 2 -> 4
        _check_full(state, 2, f"2->4 rank {rank}")
        rows = [3, 3, 3, 1][rank]
        assert _bits_equal(state["w"].to_local(), _full(2)["w"][3 * rank : 3 * rank + rows])
    finally:
        dist.destroy_process_group()


# In the slow stage: ~10 s of a core. The default suite keeps test_dcp's resharding (2 -> 1 and 2 -> 4, DTensor).
@pytest.mark.slow
def test_dtensor_resharding_across_world_sizes(backend: Backend, forkserver: None) -> None:
    """test_dtensor_resharding (placement and 1-D/2-D mesh changes) with the world size changing 4 -> 2, 4 -> 1, 2 -> 4."""
    run_ranks(_reshard_save4_worker, 4, backend, free_ports(1)[0])
    run_ranks(_reshard_load2_save2_worker, 2, backend, free_ports(1)[0])

    state: dict[str, Any] = {k: torch.zeros_like(v) for k, v in _full(1).items()} | {"extra": {"step": 0, "tags": []}}
    dcp.load(state, storage_reader=backend.reader("reshard", 1))  # 4 -> 1: this process, no process group
    _check_full(state, 1, "4->1")

    run_ranks(_reshard_load4_worker, 4, backend, free_ports(1)[0])


# ---------------------------------------------------------------------------------------------
# ShardedTensor (legacy sharding) save and reshard, 2 ranks
# ---------------------------------------------------------------------------------------------


def _fill_sharded(st: Any, full: torch.Tensor) -> None:
    for shard in st.local_shards():
        index = tuple(slice(o, o + s) for o, s in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes, strict=True))
        shard.tensor.copy_(full[index])


def _check_sharded(st: Any, full: torch.Tensor, where: str) -> None:
    shards = st.local_shards()
    assert shards, f"{where}: no local shards"
    for shard in shards:
        index = tuple(slice(o, o + s) for o, s in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes, strict=True))
        assert _bits_equal(shard.tensor, full[index]), f"{where}: shard at {shard.metadata.shard_offsets} differs"


def _sharded_tensor_worker(rank: int, backend: Backend, port: int) -> None:
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec, ShardMetadata

    _init_group(rank, 2, port)
    try:
        g = torch.Generator().manual_seed(77)
        full, rep = torch.randn(10, 20, generator=g), torch.randn(32, generator=g)
        save_spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"])
        load_spec = EnumerableShardingSpec(
            shards=[
                ShardMetadata(shard_offsets=[0, 0], shard_sizes=[2, 20], placement="rank:0/cpu"),
                ShardMetadata(shard_offsets=[2, 0], shard_sizes=[1, 20], placement="rank:1/cpu"),
                ShardMetadata(shard_offsets=[3, 0], shard_sizes=[3, 20], placement="rank:0/cpu"),
                ShardMetadata(shard_offsets=[6, 0], shard_sizes=[4, 20], placement="rank:1/cpu"),
            ]
        )
        col_spec = ChunkShardingSpec(dim=0, placements=["rank:1/cpu", "rank:0/cpu", "rank:0/cpu", "rank:1/cpu"])

        st = sharded_tensor.zeros(save_spec, 10, 20)
        _fill_sharded(st, full)
        saved = {"sharded": st, "replicated": rep.clone(), "bytes0": [1], "bytes1": "string"}
        dcp.save(saved, storage_writer=backend.writer("st", 1, rank))

        into = sharded_tensor.zeros(load_spec, 10, 20)  # test_load_with_different_shard_plan
        state: dict[str, Any] = {"sharded": into, "replicated": sharded_tensor.zeros(col_spec, 32), "bytes0": [2], "bytes1": "other"}
        dcp.load(state, storage_reader=backend.reader("st", 1, rank))
        _check_sharded(state["sharded"], full, f"rank {rank} sharded -> other shard plan")
        _check_sharded(state["replicated"], rep, f"rank {rank} tensor -> sharded")  # test_switch_between_sharded_tensor_to_tensor
        assert state["bytes0"] == [1] and state["bytes1"] == "string"  # test_save_load_bytes

        whole: dict[str, Any] = {"sharded": torch.zeros(10, 20)}  # sharded -> one plain tensor on every rank
        dcp.load(whole, storage_reader=backend.reader("st", 1, rank))
        assert _bits_equal(whole["sharded"], full), f"rank {rank}: sharded -> tensor differs"
    finally:
        dist.destroy_process_group()


def test_sharded_tensor_save_and_reshard(backend: Backend, forkserver: None) -> None:
    """test_read_write_shard_tensor / test_load_with_different_shard_plan / test_switch_between_sharded_tensor_to_tensor."""
    run_ranks(_sharded_tensor_worker, 2, backend, free_ports(1)[0])
    md = backend.reader("st", 1).read_metadata()
    chunks = md.state_dict_metadata["sharded"].chunks  # type: ignore[union-attr]
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks) == [((0, 0), (5, 20)), ((5, 0), (5, 20))]


# ---------------------------------------------------------------------------------------------
# saving with a subgroup; overwrite across ranks
# ---------------------------------------------------------------------------------------------


def _own(global_rank: int, version: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32) + 100 * global_rank + 1000 * version


def _subgroup_worker(rank: int, backend: Backend, port: int) -> None:
    _init_group(rank, 4, port)
    try:
        groups = {"sub-a": dist.new_group([0, 2]), "sub-b": dist.new_group([1, 3])}  # every rank creates both
        name = "sub-a" if rank in (0, 2) else "sub-b"
        group = groups[name]
        me = dist.get_rank(group)  # rank 1 is the coordinator (rank 0) of sub-b

        def state(version: int) -> dict[str, Any]:
            return {f"own{me}": _own(rank, version), "common": torch.full((3,), float(version)), "group": {"name": name, "v": version}}

        dcp.save(state(1), storage_writer=backend.writer(name, 1, rank), process_group=group)
        loaded = {f"own{me}": torch.zeros(6), "common": torch.zeros(3), "group": {"name": "", "v": 0}}
        dcp.load(loaded, storage_reader=backend.reader(name, 1, rank), process_group=group)
        assert _bits_equal(loaded[f"own{me}"], _own(rank, 1)) and loaded["group"] == {"name": name, "v": 1}, (rank, loaded)

        with pytest.raises(CheckpointException, match=r"Checkpoint already exists and self\.overwrite=False") as info:
            dcp.save(state(2), storage_writer=backend.writer(name, 1, rank, overwrite=False), process_group=group)
        types = _failure_types(info.value)
        assert sorted(types) == [0, 1] and all(issubclass(t, RuntimeError) for t in types.values()), types  # every rank refused
        dist.barrier()
        dcp.save(state(3), storage_writer=backend.writer(name, 1, rank, overwrite=True), process_group=group)
    finally:
        dist.destroy_process_group()


def test_subgroup_saves_and_overwrite(backend: Backend, forkserver: None) -> None:
    """dcp.save(process_group=<2 of 4 ranks>): two groups save two checkpoints at once; group ranks, not global ones."""
    run_ranks(_subgroup_worker, 4, backend, free_ports(1)[0])
    for name, ranks in (("sub-a", (0, 2)), ("sub-b", (1, 3))):
        loaded = {"own0": torch.zeros(6), "own1": torch.zeros(6), "common": torch.zeros(3), "group": {"name": "", "v": 0}}
        dcp.load(loaded, storage_reader=backend.reader(name, 1))  # 2 -> 1
        assert _bits_equal(loaded["own0"], _own(ranks[0], 3)) and _bits_equal(loaded["own1"], _own(ranks[1], 3)), name
        assert _bits_equal(loaded["common"], torch.full((3,), 3.0)) and loaded["group"] == {"name": name, "v": 3}
        md = backend.reader(name, 1).read_metadata()
        assert sorted(md.state_dict_metadata) == ["common", "group.name", "group.v", "own0", "own1"]


# ---------------------------------------------------------------------------------------------
# async_save: process mode (DCP's checkpoint daemon) and thread mode
# ---------------------------------------------------------------------------------------------


def _stop_checkpoint_daemon() -> None:
    """Terminate and reap DCP's process-mode checkpoint daemon (torch keeps it in a module global)."""
    from torch.distributed.checkpoint import _async_process_executor as ape

    proc = getattr(ape, "_CHECKPOINT_PROCESS", None)
    if proc is None:
        return
    ape._CHECKPOINT_PROCESS = None
    proc.__del__()  # sends TERMINATE, joins, SIGTERMs if needed
    child = proc._save_process
    child.join(10)
    if child.is_alive():
        child.kill()
        child.join(10)


def _async_worker(rank: int, backend: Backend, port: int) -> None:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor, zeros

    _init_group(rank, 2, port)
    try:
        mesh = init_device_mesh("cpu", (2,))

        def state(step: int) -> dict[str, Any]:
            return {"w": distribute_tensor(_full(step)["w"], mesh, [Shard(0)]), "extra": {"step": step}}

        def wait(result: Any) -> None:
            future = getattr(result, "upload_completion", result)  # AsyncSaveResponse (torch 2.9+) or a Future
            future.result(timeout=PROCESS_TIMEOUT)

        process = AsyncCheckpointerType.PROCESS
        wait(dcp.async_save(state(1), storage_writer=backend.writer("async1", 1, rank), async_checkpointer_type=process))
        wait(dcp.async_save(state(2), storage_writer=backend.writer("async2", 2, rank), async_checkpointer_type=process))  # daemon reused
        wait(dcp.async_save(state(3), storage_writer=backend.writer("async3", 3, rank)))  # thread mode
        for step in (1, 2, 3):
            loaded: dict[str, Any] = {"w": zeros(10, 6, device_mesh=mesh, placements=[Shard(0)]), "extra": {"step": 0}}
            dcp.load(loaded, storage_reader=backend.reader(f"async{step}", step, rank))
            assert _bits_equal(loaded["w"].full_tensor(), _full(step)["w"]) and loaded["extra"] == {"step": step}, (rank, step)
    finally:
        _stop_checkpoint_daemon()
        dist.destroy_process_group()


def test_async_save_process_and_thread_modes(backend: Backend, forkserver: None) -> None:
    """e2e test_e2e_async_cached: async_save with AsyncCheckpointerType.PROCESS (storage writer and plans pickled to the daemon)."""
    run_ranks(_async_worker, 2, backend, free_ports(1)[0])
    loaded = {"w": torch.zeros(10, 6), "extra": {"step": 0}}
    dcp.load(loaded, storage_reader=backend.reader("async2", 2))
    assert _bits_equal(loaded["w"], _full(2)["w"]) and loaded["extra"] == {"step": 2}
