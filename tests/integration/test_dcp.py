"""torch.distributed.checkpoint on memstore: save/load, async (thread + process), resharding 2 -> 1 / 2 -> 4.

Multi-rank cases run real gloo process groups on 127.0.0.1 (processes forked from a forkserver, reaped with a
deadline); DCP's own process-mode checkpoint daemon is spawned by torch and reaped by the worker that owns it.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from memstore.local_cluster import free_ports
from tests.harness.ranks import PROCESS_TIMEOUT, forkserver_preloading, run_ranks
from tests.states import assert_same
from trainer_client import CheckpointClient
from trainer_client.dcp import (
    MemStoreReader,
    MemStoreStorageInfo,
    MemStoreWriter,
    decode_metadata,
    encode_metadata,
    parse_checkpoint_id,
)
from trainer_client.errors import CorruptShardError, InvalidArgumentError, NoCheckpointError, NotFoundError, SerializationError

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


# ---------------------------------------------------------------------------------------------
# states
# ---------------------------------------------------------------------------------------------


def _train_state(seed: int) -> dict[str, Any]:
    """Model + Adam state after one step, plus odd dtypes, NaN payloads and non-tensor values."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(5, 8)).square().mean().backward()
    opt.step()
    g = torch.Generator().manual_seed(seed + 1)
    odd = {
        "bf16": torch.randn(7, 3, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(2**40), 2**40, (6,), generator=g),
        "mask": torch.rand(9, generator=g) > 0.5,
        "specials": torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45]),
        "nan_payload": torch.tensor([0x7FC00001, 0x7F800123], dtype=torch.int32).view(torch.float32),
    }
    return {"model": model.state_dict(), "optim": opt.state_dict(), "odd": odd, "extra": {"epoch": seed, "name": f"run-{seed}"}}


def _blank_like(state: Any) -> Any:
    """Same structure, different values: what a restarted trainer holds before loading."""
    if isinstance(state, torch.Tensor):
        out = torch.empty_like(state)
        if out.is_floating_point():
            out.fill_(123.0)
        else:
            out.zero_()
        return out
    if isinstance(state, dict):
        return type(state)((k, _blank_like(v)) for k, v in state.items())
    if isinstance(state, list):
        return [_blank_like(v) for v in state]
    if isinstance(state, str):
        return "blank"
    if isinstance(state, int) and not isinstance(state, bool):
        return -1
    return state


def _full_tensors() -> dict[str, torch.Tensor]:
    """The logical (unsharded) tensors of the resharding test; uneven over 4 ranks on purpose."""
    g = torch.Generator().manual_seed(2024)
    return {
        "w": torch.randn(10, 6, generator=g),
        "b": torch.randn(4, 7, generator=g).to(torch.bfloat16),
        "rep": torch.arange(12, dtype=torch.int64).reshape(3, 4),
    }


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# ---------------------------------------------------------------------------------------------
# spawned ranks
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def forkserver() -> Iterator[None]:
    with forkserver_preloading(__name__):
        yield


def _init_group(rank: int, world: int, port: int) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # keep gloo (and DCP's checkpoint daemon) on loopback
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _save_sharded_worker(rank: int, addr: str, job: str, step: int, port: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    _init_group(rank, 2, port)
    try:
        mesh = init_device_mesh("cpu", (2,))
        full = _full_tensors()
        state: dict[str, Any] = {
            "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
            "b": distribute_tensor(full["b"], mesh, [Shard(1)]),  # loaded sharded on dim 0: a real re-layout
            "rep": full["rep"].clone(),  # replicated plain tensor: DCP dedups it to one rank
            "extra": {"epoch": 7, "tag": "two-ranks"},
        }
        assert state["w"].to_local().shape == (5, 6)
        dcp.save(state, storage_writer=MemStoreWriter(job, step, store=addr))  # world_size/rank from the process group
    finally:
        dist.destroy_process_group()


def _load_sharded_worker(rank: int, addr: str, job: str, port: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    _init_group(rank, 4, port)
    try:
        mesh = init_device_mesh("cpu", (4,))
        full = _full_tensors()
        state: dict[str, Any] = {
            "w": distribute_tensor(torch.zeros_like(full["w"]), mesh, [Shard(0)]),
            "b": distribute_tensor(torch.zeros_like(full["b"]), mesh, [Shard(0)]),
            "rep": torch.zeros_like(full["rep"]),
            "extra": {"epoch": 0, "tag": ""},
        }
        dcp.load(state, storage_reader=MemStoreReader(job, store=addr))  # newest complete step, saved by 2 ranks
        rows = [3, 3, 3, 1][rank]  # torch.chunk layout of 10 rows over 4 ranks
        local_w = state["w"].to_local()
        assert local_w.shape == (rows, 6), local_w.shape
        assert _bits_equal(local_w, full["w"][3 * rank : 3 * rank + rows]), f"rank {rank}: w shard differs"
        assert _bits_equal(state["b"].to_local(), full["b"][rank : rank + 1]), f"rank {rank}: b shard differs"
        assert _bits_equal(state["w"].full_tensor(), full["w"])
        assert _bits_equal(state["b"].full_tensor(), full["b"])
        assert _bits_equal(state["rep"], full["rep"])
        assert state["extra"] == {"epoch": 7, "tag": "two-ranks"}, state["extra"]
    finally:
        dist.destroy_process_group()


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


def _async_process_worker(rank: int, addr: str, job: str, step: int, port: int) -> None:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

    _init_group(rank, 1, port)
    try:
        writer = MemStoreWriter(job, step, store=addr)
        result = dcp.async_save(_train_state(11), storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        future = result.upload_completion if isinstance(result, AsyncSaveResponse) else result
        future.result(timeout=PROCESS_TIMEOUT)
        assert writer._client is None, "the writer was pickled to the daemon; this process never connected"
    finally:
        _stop_checkpoint_daemon()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# single-process DCP protocol driver: N "ranks" in this process, each step of dcp.save by hand
# ---------------------------------------------------------------------------------------------


def _drive_save(job: str, step: int, addr: str, states: list[dict[str, Any]], *, finish: bool = True) -> None:
    world = len(states)
    planners = [DefaultSavePlanner() for _ in range(world)]
    writers = [MemStoreWriter(job, step, store=addr, world_size=world, rank=r) for r in range(world)]
    local_plans = []
    for r in range(world):
        planners[r].set_up_planner(states[r], storage_meta=writers[r].storage_meta(), is_coordinator=r == 0)
        writers[r].set_up_storage_writer(r == 0, rank=r, use_collectives=True)
        local_plans.append(writers[r].prepare_local_plan(planners[r].create_local_plan()))
    global_plans, metadata = planners[0].create_global_plan(local_plans)
    global_plans = writers[0].prepare_global_plan(global_plans)
    results = []
    for r in range(world):
        fut = writers[r].write_data(planners[r].finish_plan(global_plans[r]), planners[r])
        fut.wait()
        results.append(fut.value())
    if finish:
        writers[0].finish(metadata, results)
    for w in writers:
        w.close()


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------


def test_save_load_round_trip_bit_exact(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(hosts=2, replicas=2)
    addr, job = cluster.address("h0"), "dcp-roundtrip"
    state = _train_state(3)
    writer = MemStoreWriter(job, store=addr)
    dcp.save(state, storage_writer=writer, checkpoint_id=4)  # the step comes through reset(checkpoint_id)
    assert writer.checkpoint_id == f"memstore://{job}/4"
    writer.close()

    with CheckpointClient(job, 0, 1, store=addr) as client:
        assert client.latest_step() == 4
        raw = client.load(4, rank=0)  # the shard itself: tensors stay tensors, metadata is plain data
    assert raw["format"] == "memstore-dcp" and raw["world_size"] == 1
    assert any(isinstance(v, torch.Tensor) for v in raw["items"].values())
    assert any(isinstance(v, bytes) for v in raw["items"].values())
    json.dumps(raw["metadata"])  # no objects in there: pure JSON-able data

    loaded = _blank_like(state)
    dcp.load(loaded, storage_reader=MemStoreReader(job, store=addr))  # step=None: newest complete step
    assert_same(state, loaded)

    again = _blank_like(state)
    dcp.load(again, storage_reader=MemStoreReader(job, store=addr), checkpoint_id=f"memstore://{job}/4")
    assert_same(state, again)

    # the optimizer state really restores into a live optimizer
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optim"])
    assert opt.param_groups[0]["lr"] == 1e-3


def test_metadata_safe_encoding_round_trip_and_rejection() -> None:
    idx = MetadataIndex("model.w", [4, 0], index=1)
    md = Metadata(
        state_dict_metadata={
            "model.w": TensorStorageMetadata(
                properties=TensorProperties(dtype=torch.bfloat16, requires_grad=True, memory_format=torch.channels_last),
                size=torch.Size([8, 3]),
                chunks=[
                    ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([4, 3])),
                    ChunkStorageMetadata(offsets=torch.Size([4, 0]), sizes=torch.Size([4, 3])),
                ],
            ),
            "extra": BytesStorageMetadata(),
        },
        planner_data={"model.w": ("model", "w"), "extra": ("extra",), "opt.0": ("opt", 0)},
        storage_data={idx: MemStoreStorageInfo(1, "model.w|4,0|1"), MetadataIndex("extra"): MemStoreStorageInfo(0, "extra||")},
        storage_meta=StorageMeta(checkpoint_id="memstore://j/3", save_id="abc", modules=["m"]),
        version="1.0.0",
    )
    encoded = encode_metadata(md)
    decoded = decode_metadata(json.loads(json.dumps(encoded)))  # survives a pure-JSON trip
    assert decoded == md
    assert decoded.state_dict_metadata["model.w"].properties.memory_format == torch.channels_last  # type: ignore[union-attr]
    assert [k.index for k in decoded.storage_data] == [1, None]
    assert decoded.planner_data["opt.0"] == ("opt", 0)

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, ("echo pwned",))

    md.planner_data = {"x": [1, Evil()]}
    with pytest.raises(SerializationError, match=r"metadata\.planner_data\['x'\]\[1\].*unsupported type .*Evil"):
        encode_metadata(md)
    md.planner_data = {"x": {1, 2}}
    with pytest.raises(SerializationError, match=r"unsupported type builtins\.set"):
        encode_metadata(md)
    with pytest.raises(CorruptShardError, match="not allowed"):
        decode_metadata({"__dcp__": "os.system", "command": "echo pwned"})
    with pytest.raises(CorruptShardError, match="unknown dtype"):
        decode_metadata({**encoded, "state_dict_metadata": {"__dcp__": "dict", "items": [["w", {"__dcp__": "dtype", "name": "eval"}]]}})

    # checkpoint ids and picklability (process-mode async_save ships the writer to another process)
    assert parse_checkpoint_id(5, "j") == 5 and parse_checkpoint_id("6", "j") == 6 and parse_checkpoint_id("memstore://j/7", "j") == 7
    with pytest.raises(InvalidArgumentError, match="names job 'other'"):
        parse_checkpoint_id("memstore://other/7", "j")
    assert MemStoreWriter.validate_checkpoint_id("memstore://j/7") and not MemStoreReader.validate_checkpoint_id("/tmp/ckpt")
    clone = pickle.loads(pickle.dumps(MemStoreWriter("j", 3, store="127.0.0.1:1", world_size=4, rank=2)))
    assert (clone.job_id, clone.step, clone.world_size, clone.rank, clone._client) == ("j", 3, 4, 2, None)


def test_only_a_complete_step_is_visible(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(hosts=2, replicas=2)
    addr, job = cluster.address("h0"), "dcp-incomplete"
    old, new = _train_state(1), _train_state(2)
    _drive_save(job, 1, addr, [old, old])  # two ranks, dcp.save's protocol by hand
    _drive_save(job, 2, addr, [new, new], finish=False)  # both wrote; the coordinator's finish() never ran

    with CheckpointClient(job, 1, 2, store=addr) as client:
        assert client.latest_step() == 1
        client.load(2, rank=1)  # rank 1's half of step 2 does exist...
        with pytest.raises(NotFoundError):
            client.load(2, rank=0)  # ...but the coordinator's shard (data + metadata) does not

    reader = MemStoreReader(job, store=addr)
    loaded = _blank_like(old)
    dcp.load(loaded, storage_reader=reader)
    assert reader.resolved_step == 1 and reader.saved_world_size == 2
    assert_same(old, loaded)

    with pytest.raises(NotFoundError, match=r"step 2 of job 'dcp-incomplete' has no DCP metadata.*did not finish"):
        MemStoreReader(job, 2, store=addr).read_metadata()
    with pytest.raises(CheckpointException, match="has no DCP metadata"):  # how dcp.load reports a rank's error
        dcp.load(_blank_like(new), storage_reader=MemStoreReader(job, store=addr), checkpoint_id=2)

    # finishing the save makes step 2 the newest complete step
    _drive_save(job, 2, addr, [new, new])
    loaded = _blank_like(new)
    dcp.load(loaded, storage_reader=MemStoreReader(job, store=addr))
    assert_same(new, loaded)

    with pytest.raises(NoCheckpointError, match="'no-such-job'"):
        MemStoreReader("no-such-job", store=addr).read_metadata()
    with CheckpointClient("plain-job", 0, 1, store=addr) as plain:
        plain.save(9, {"w": torch.ones(2)}).wait(30)
    with pytest.raises(NotFoundError, match="not written by MemStoreWriter"):
        MemStoreReader("plain-job", store=addr).read_metadata()


def test_async_save_thread_mode(make_cluster) -> None:  # type: ignore[no-untyped-def]
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    cluster = make_cluster(hosts=2, replicas=2)
    addr, job = cluster.address("h1"), "dcp-async-thread"
    state = _train_state(5)
    result = dcp.async_save(state, storage_writer=MemStoreWriter(job, 8, store=addr))
    future = result.upload_completion if isinstance(result, AsyncSaveResponse) else result
    future.result(timeout=60)
    loaded = _blank_like(state)
    dcp.load(loaded, storage_reader=MemStoreReader(job, store=cluster.address("h0")))  # through the other host
    assert_same(state, loaded)


def test_async_save_process_mode(make_cluster, forkserver) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(hosts=2, replicas=2)
    addr, job = cluster.address("h0"), "dcp-async-process"
    run_ranks(_async_process_worker, 1, addr, job, 6, free_ports(1)[0])
    expected = _train_state(11)
    loaded = _blank_like(expected)
    dcp.load(loaded, storage_reader=MemStoreReader(job, store=addr))
    assert_same(expected, loaded)


def test_resharding_two_ranks_to_one_and_four(make_cluster, forkserver) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(hosts=2, replicas=2)
    addr, job = cluster.address("h0"), "dcp-reshard"
    run_ranks(_save_sharded_worker, 2, addr, job, 3, free_ports(1)[0])

    with CheckpointClient(job, 0, 2, store=addr) as client:
        assert client.latest_step() == 3
        sizes = [sum(v.numel() for v in client.load(3, rank=r)["items"].values() if isinstance(v, torch.Tensor)) for r in (0, 1)]
    assert all(s > 0 for s in sizes), sizes  # each rank stored its own half

    # 2 -> 1: a single process (no process group) loads the full tensors
    full = _full_tensors()
    state = {k: torch.zeros_like(v) for k, v in full.items()} | {"extra": {"epoch": 0, "tag": ""}}
    reader = MemStoreReader(job, 3, store=cluster.address("h1"))  # explicit step: its world size comes from rank 0's shard
    dcp.load(state, storage_reader=reader)
    assert reader.saved_world_size == 2
    for k, v in full.items():
        assert _bits_equal(state[k], v), k  # type: ignore[arg-type]
    assert state["extra"] == {"epoch": 7, "tag": "two-ranks"}

    # 2 -> 4: DTensor Shard(0) over four gloo ranks (uneven: 3, 3, 3, 1 rows)
    run_ranks(_load_sharded_worker, 4, addr, job, free_ports(1)[0])
