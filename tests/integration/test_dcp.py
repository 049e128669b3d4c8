"""torch.distributed.checkpoint on memstore: save/load, async (thread + process), resharding 2 -> 1 / 2 -> 4,
per-save timelines (an interrupted re-save never mixes with the complete version), world size from the saving
group, overwrite, legacy ShardedTensor metadata. Behaviour shared with FileSystemWriter/Reader is checked side by
side in test_dcp_conformance.py.

Multi-rank cases run real gloo process groups on 127.0.0.1 (processes forked from a forkserver, reaped with a
deadline); DCP's own process-mode checkpoint daemon is spawned by torch and reaped by the worker that owns it.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from memstore.testing import free_ports
from tests.harness.allocations import allocations_now
from tests.harness.ranks import PROCESS_TIMEOUT, forkserver_fixture, run_ranks
from tests.harness.torch_versions import LOAD_KEEPS_READER_MESSAGE
from tests.states import assert_same
from trainer_client import CheckpointClient, Connection
from trainer_client.dcp import (
    CheckpointExistsError,
    MemStoreReader,
    MemStoreSavePlanInfo,
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


forkserver = forkserver_fixture(__name__)


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
        writer = MemStoreWriter(job, step, connection=Connection(addr))
        assert writer.prepare(state) is True  # at set-up: every rank plans the save as DCP will (rep written by one rank)
        assert writer._client is not None and (writer._client.rank, writer._client.world_size) == (rank, 2)
        allocations = allocations_now(writer._client)
        dcp.save(state, storage_writer=writer)  # world_size/rank from the process group
        assert allocations == [], allocations  # each rank's shard fit in the memory prepared for it
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
        reader = MemStoreReader(job, connection=Connection(addr), group=dist.group.WORLD)
        dcp.load(state, storage_reader=reader)  # newest complete step, saved by 2 ranks
        # Agreed over the loading group: saved by 2 ranks, loaded by 4, so the scoped views cannot decide and rank 0
        # alone asked the whole cluster; every other rank made one call, to its own store.
        stats = reader.agreement_stats
        assert stats is not None and stats.fallback and stats.rpcs == (2 if rank == 0 else 1), stats
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
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    _init_group(rank, 1, port)
    try:
        writer = MemStoreWriter(job, step, connection=Connection(addr))
        result = dcp.async_save(_train_state(11), storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        future = getattr(result, "upload_completion", result)  # AsyncSaveResponse (torch 2.9+) or a Future
        future.result(timeout=PROCESS_TIMEOUT)
        assert writer._client is None, "the writer was pickled to the daemon; this process never connected"
    finally:
        _stop_checkpoint_daemon()
        dist.destroy_process_group()


class _CoordinatorDiesInFinish(MemStoreWriter):
    """Every rank writes its shard of the new save, then the coordinator fails in finish(): rank 0's shard never lands."""

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
        if self.is_coordinator:
            raise RuntimeError("coordinator lost in finish()")
        super().finish(metadata, results)


def _resave_worker(rank: int, addr: str, job: str, port: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    _init_group(rank, 2, port)
    try:
        mesh = init_device_mesh("cpu", (2,))
        old = torch.arange(12, dtype=torch.float32).reshape(6, 2)
        new = -old - 1

        def state(full: torch.Tensor) -> dict[str, Any]:  # rows 0-2 in rank 0's shard, rows 3-5 in rank 1's
            return {"w": distribute_tensor(full, mesh, [Shard(0)]), "tag": f"rank{rank}"}

        def load_full() -> tuple[torch.Tensor, MemStoreReader]:
            target: dict[str, Any] = {"w": distribute_tensor(torch.zeros(6, 2), mesh, [Shard(0)]), "tag": ""}
            reader = MemStoreReader(job, 5, connection=Connection(addr))
            dcp.load(target, storage_reader=reader)
            return target["w"].full_tensor(), reader

        first = MemStoreWriter(job, 5, connection=Connection(addr))
        dcp.save(state(old), storage_writer=first)
        interrupted = _CoordinatorDiesInFinish(job, 5, connection=Connection(addr))
        with pytest.raises(CheckpointException, match="coordinator lost in finish"):
            dcp.save(state(new), storage_writer=interrupted)  # every rank sees the coordinator's failure
        assert first.timeline and interrupted.timeline and first.timeline != interrupted.timeline

        full, reader = load_full()
        assert reader.resolved_timeline == first.timeline, (reader.resolved_timeline, first.timeline)
        assert _bits_equal(full, old), f"rank {rank}: a load of step 5 mixed saves:\n{full}"  # never rank 0 old + rank 1 new
        with CheckpointClient(job, rank, 2, connection=Connection(addr)) as client:
            point = client.restore_point(5)
            assert point is not None and point.timeline == first.timeline
            if rank == 1:  # the interrupted save's half is in the store, under its own timeline only
                mine = client.load(5, rank=1, timeline=interrupted.timeline)
                assert all(_bits_equal(v, new[3:]) for v in mine["items"].values() if isinstance(v, torch.Tensor))
        dist.barrier()

        completed = MemStoreWriter(job, 5, connection=Connection(addr))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overwriting since overwrite=True": that is the point here
            dcp.save(state(new), storage_writer=completed)
        full, reader = load_full()
        assert reader.resolved_timeline == completed.timeline and _bits_equal(full, new), f"rank {rank}: newest complete save not read"
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# single-process DCP protocol driver: N "ranks" in this process, each step of dcp.save by hand
# ---------------------------------------------------------------------------------------------


def _drive_save(
    job: str, step: int, addr: str, states: list[dict[str, Any]], *, finish: bool = True, explicit: bool = False, **writer_kwargs: Any
) -> str:
    """Run dcp.save's protocol for ``len(states)`` ranks; returns the save's timeline.

    ``explicit``: writers get ``world_size=`` / ``rank=``; else they learn both from the coordinator's plan.
    """
    world = len(states)
    planners = [DefaultSavePlanner() for _ in range(world)]
    if explicit:
        writers = [MemStoreWriter(job, step, connection=Connection(addr), world_size=world, rank=r, **writer_kwargs) for r in range(world)]
    else:
        writers = [MemStoreWriter(job, step, connection=Connection(addr), **writer_kwargs) for r in range(world)]
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
        assert (writers[r].world_size, writers[r].rank) == (world, r)
    if finish:
        writers[0].finish(metadata, results)
    for w in writers:
        w.close()
    timeline = writers[0].timeline
    assert timeline is not None and all(w.timeline == timeline for w in writers)
    return timeline


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------


def test_save_load_round_trip_bit_exact(make_inprocess_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_inprocess_cluster(hosts=2, replicas=2)
    addr, job = cluster.address("h0"), "dcp-roundtrip"
    state = _train_state(3)
    writer = MemStoreWriter(job, connection=Connection(addr))
    dcp.save(state, storage_writer=writer, checkpoint_id=4)  # the step comes through reset(checkpoint_id)
    assert writer.checkpoint_id == f"memstore://{job}/4"
    writer.close()

    with CheckpointClient(job, 0, 1, connection=Connection(addr)) as client:
        assert client.latest_step() == 4
        point = client.restore_point(4)
        raw = client.load(4, rank=0)  # the shard itself: tensors stay tensors, metadata is plain data
    assert point is not None and point.timeline == writer.timeline and point.timeline.startswith("dcp-")
    assert raw["format"] == "memstore-dcp" and raw["world_size"] == 1 and raw["timeline"] == writer.timeline
    assert any(isinstance(v, torch.Tensor) for v in raw["items"].values())
    assert any(isinstance(v, bytes) for v in raw["items"].values())
    json.dumps(raw["metadata"])  # no objects in there: pure JSON-able data

    loaded = _blank_like(state)
    dcp.load(loaded, storage_reader=MemStoreReader(job, connection=Connection(addr)))  # step=None: newest complete step
    assert_same(state, loaded)

    again = _blank_like(state)
    dcp.load(again, storage_reader=MemStoreReader(job, connection=Connection(addr)), checkpoint_id=f"memstore://{job}/4")
    assert_same(state, again)

    # the optimizer state really restores into a live optimizer
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optim"])
    assert opt.param_groups[0]["lr"] == 1e-3


@pytest.mark.parametrize("cls", [MemStoreWriter, MemStoreReader])
def test_an_option_the_client_would_refuse_fails_when_the_writer_or_reader_is_made(cls: type) -> None:
    """Checked at construction (no store is dialled until the first save or read), naming the option or its replacement."""
    with pytest.raises(TypeError, match=rf"{cls.__name__}\(\) got an unexpected keyword argument 'stroe'"):
        cls("job", 1, stroe="127.0.0.1:7070")
    with pytest.raises(TypeError, match=rf"{cls.__name__}\(\) got both connection= and the deprecated store=: pass only connection="):
        cls("job", 1, "127.0.0.1:7070", connection=Connection("127.0.0.1:7070"))
    with pytest.raises(TypeError, match=rf"{cls.__name__}\(connection=...\) expects a trainer_client.Connection, got a str"):
        cls("job", 1, connection="127.0.0.1:7070")


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
    )
    md.version = "1.0.0"  # a field from torch 2.9 on, an attribute before it: the encoding keeps it either way
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
    clone = pickle.loads(pickle.dumps(MemStoreWriter("j", 3, connection=Connection("127.0.0.1:1"), world_size=4, rank=2, overwrite=False)))
    assert (clone.job_id, clone.step, clone.world_size, clone.rank, clone.overwrite, clone._client) == ("j", 3, 4, 2, False, None)
    info = MemStoreSavePlanInfo("j", 3, 4, 2, "dcp-0123456789abcdef-00ff00ff")  # DCP pickles plans (collectives, checkpoint daemon)
    assert pickle.loads(pickle.dumps(info)) == info
    with pytest.raises(InvalidArgumentError, match=r"rank 4 is invalid.*world_size \(4\)"):
        MemStoreWriter("j", 3, world_size=4, rank=4)


def test_metadata_with_legacy_sharded_tensor_properties_round_trips() -> None:
    """DCP metadata of older torch holds _shard.sharded_tensor.metadata.TensorProperties: never pickled, the same class back."""
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as LegacyTensorProperties

    legacy = LegacyTensorProperties(dtype=torch.float16, requires_grad=True, memory_format=torch.channels_last, pin_memory=False)
    md = Metadata(
        state_dict_metadata={
            "st": TensorStorageMetadata(
                properties=legacy,  # type: ignore[arg-type]
                size=torch.Size([4, 2]),
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([4, 2]))],
            ),
            "t": TensorStorageMetadata(properties=TensorProperties(dtype=torch.int8), size=torch.Size([1]), chunks=[]),
        },
        storage_data={MetadataIndex("st", [0, 0]): MemStoreStorageInfo(0, "st|0,0|")},
    )
    encoded = encode_metadata(md)
    assert encoded["state_dict_metadata"]["items"][0][1]["properties"]["__dcp__"] == "ShardedTensorProperties"
    decoded = decode_metadata(json.loads(json.dumps(encoded)))
    assert decoded == md
    props = decoded.state_dict_metadata["st"].properties  # type: ignore[union-attr]
    assert type(props) is LegacyTensorProperties and props.memory_format == torch.channels_last and props.requires_grad
    assert type(decoded.state_dict_metadata["t"].properties) is TensorProperties  # type: ignore[union-attr]
    # the tag builds that class only, with exactly its fields
    bad = json.loads(json.dumps(encoded))
    bad["state_dict_metadata"]["items"][0][1]["properties"]["extra"] = 1
    with pytest.raises(CorruptShardError, match="ShardedTensorProperties has fields"):
        decode_metadata(bad)


def test_world_size_and_rank_come_from_the_saving_group(make_inprocess_cluster) -> None:  # type: ignore[no-untyped-def]
    """Writers without world_size/rank learn them from the coordinator's plans; explicit ones must agree with the group."""
    cluster = make_inprocess_cluster(hosts=2, replicas=2)
    addr, job = cluster.address("h0"), "dcp-world"
    states = [_train_state(r) for r in range(3)]
    timeline = _drive_save(job, 5, addr, states)  # three "ranks" in a process without a process group
    with CheckpointClient(job, 0, 3, connection=Connection(addr)) as client:
        point = client.restore_point()
        assert point is not None and (point.step, point.world_size, point.timeline) == (5, 3, timeline)
        assert [client.load(5, rank=r)["rank"] for r in range(3)] == [0, 1, 2]

    with pytest.raises(InvalidArgumentError, match=r"MemStoreWriter\(world_size=4\) but DCP saves with 3 ranks"):
        _drive_save(job, 6, addr, states, world_size=4)  # the coordinator checks the number of plans
    writer = MemStoreWriter(job, 6, connection=Connection(addr), world_size=2)  # a non-coordinator checks the plan it is handed
    writer.set_up_storage_writer(False, rank=1, use_collectives=True)
    plan = SavePlan([], storage_data=MemStoreSavePlanInfo(job, 6, 3, 1, "dcp-x"))
    with pytest.raises(InvalidArgumentError, match=r"MemStoreWriter\(world_size=2\) but DCP saves with 3 ranks"):
        writer.write_data(plan, DefaultSavePlanner())
    other = MemStoreWriter(job, 7, connection=Connection(addr))
    other.set_up_storage_writer(False, rank=1, use_collectives=True)
    with pytest.raises(InvalidArgumentError, match=r"coordinator saves step 6 .* this rank's MemStoreWriter saves step 7"):
        other.write_data(plan, DefaultSavePlanner())


def test_overwrite_false_refuses_a_restorable_step(make_inprocess_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_inprocess_cluster(hosts=2, replicas=2)
    addr, job = cluster.address("h1"), "dcp-overwrite"
    first, second = {"w": torch.arange(6.0)}, {"w": torch.arange(6.0) * 2}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dcp.save(first, storage_writer=MemStoreWriter(job, 3, connection=Connection(addr), overwrite=False))
    assert not [w for w in seen if "existing checkpoint" in str(w.message)]  # nothing to warn about: the step is new
    with pytest.raises(CheckpointException) as info:
        dcp.save(second, storage_writer=MemStoreWriter(job, 3, connection=Connection(addr), overwrite=False))
    ((failure, _traceback),) = info.value.failures.values()  # DCP keeps (exception, traceback) per failed rank
    assert isinstance(failure, CheckpointExistsError) and isinstance(failure, RuntimeError)
    assert "Checkpoint already exists" in str(failure) and "step 3 of job 'dcp-overwrite'" in str(failure)
    loaded = {"w": torch.zeros(6)}
    dcp.load(loaded, storage_reader=MemStoreReader(job, 3, connection=Connection(addr)))
    assert torch.equal(loaded["w"], first["w"])  # the refused save wrote nothing

    with pytest.warns(UserWarning, match=r"existing checkpoint: step 3 of job 'dcp-overwrite'"):
        dcp.save(second, storage_writer=MemStoreWriter(job, 3, connection=Connection(addr)))  # overwrite=True, FileSystemWriter's default
    dcp.load(loaded, storage_reader=MemStoreReader(job, 3, connection=Connection(addr)))
    assert torch.equal(loaded["w"], second["w"])
    _drive_save(job, 4, addr, [{"x": torch.ones(2)}, {"x": torch.ones(2)}], overwrite=False)
    with pytest.raises(CheckpointExistsError, match="step 4 of job 'dcp-overwrite'"):
        _drive_save(job, 4, addr, [{"x": torch.ones(2)}, {"x": torch.ones(2)}], overwrite=False)


@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")
def test_ranks_that_resolved_different_saves_read_nothing(make_inprocess_cluster) -> None:  # type: ignore[no-untyped-def]
    """A re-save completing between two ranks' read_metadata: the coordinator's version wins, the other rank reads nothing."""
    cluster = make_inprocess_cluster(hosts=1, replicas=1)
    addr, job = cluster.address("h0"), "dcp-load-race"
    dcp.save({"w": torch.ones(4)}, storage_writer=MemStoreWriter(job, 3, connection=Connection(addr)))
    readers = [MemStoreReader(job, 3, connection=Connection(addr)), MemStoreReader(job, 3, connection=Connection(addr))]
    metadata = [readers[0].read_metadata()]  # rank 0 (the coordinator) resolves the first save...
    dcp.save({"w": torch.full((4,), 2.0)}, storage_writer=MemStoreWriter(job, 3, connection=Connection(addr)))
    metadata.append(readers[1].read_metadata())  # ...rank 1 the second
    assert readers[0].resolved_timeline != readers[1].resolved_timeline

    states = [{"w": torch.zeros(4)}, {"w": torch.zeros(4)}]
    planners = [DefaultLoadPlanner(), DefaultLoadPlanner()]
    for r in range(2):
        planners[r].set_up_planner(states[r], metadata[r], r == 0)
        readers[r].set_up_storage_reader(metadata[r], r == 0, rank=r)
    plans = planners[0].create_global_plan([p.create_local_plan() for p in planners])
    plans = readers[0].prepare_global_plan(plans)
    readers[0].read_data(planners[0].finish_plan(plans[0]), planners[0]).wait()
    assert torch.equal(states[0]["w"], torch.ones(4))
    with pytest.raises(NotFoundError, match=r"a save completed while the ranks started dcp\.load"):
        readers[1].read_data(planners[1].finish_plan(plans[1]), planners[1])
    assert torch.equal(states[1]["w"], torch.zeros(4))  # nothing of the other save was read
    for reader in readers:
        reader.close()


@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")
def test_replayed_save_plan_is_refused(make_inprocess_cluster) -> None:  # type: ignore[no-untyped-def]
    """DefaultSavePlanner(enable_plan_caching=True) replays an earlier save's plan (its timeline): refused, never mixed."""
    cluster = make_inprocess_cluster(hosts=1, replicas=1)
    conn, job = Connection(cluster.address("h0")), "dcp-plan-cache"
    state = {"w": torch.arange(4.0)}
    try:
        dcp.save(state, storage_writer=MemStoreWriter(job, 1, connection=conn), planner=DefaultSavePlanner(enable_plan_caching=True))
        with pytest.raises(CheckpointException, match="enable_plan_caching"):  # same step: the earlier save's timeline
            dcp.save(state, storage_writer=MemStoreWriter(job, 1, connection=conn), planner=DefaultSavePlanner(enable_plan_caching=True))
        with pytest.raises(CheckpointException, match="enable_plan_caching"):  # another step: the earlier save's step
            dcp.save(state, storage_writer=MemStoreWriter(job, 2, connection=conn), planner=DefaultSavePlanner(enable_plan_caching=True))
    finally:
        for cache in (SavePlanner._cached_save_plan, SavePlanner._cached_all_plans, SavePlanner._cached_global_plan,
                      SavePlanner._cached_metadata, SavePlanner._cached_final_save_plan):  # fmt: skip
            cache.pop(DefaultSavePlanner.__name__, None)
    with CheckpointClient(job, 0, 1, connection=conn) as client:
        point = client.restore_point()
        assert point is not None and point.step == 1


def test_only_a_complete_step_is_visible(make_inprocess_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_inprocess_cluster(hosts=2, replicas=2)
    addr, job = cluster.address("h0"), "dcp-incomplete"
    old, new = _train_state(1), _train_state(2)
    _drive_save(job, 1, addr, [old, old], explicit=True)  # two ranks, dcp.save's protocol by hand
    unfinished = _drive_save(job, 2, addr, [new, new], finish=False)  # both wrote; the coordinator's finish() never ran

    with CheckpointClient(job, 1, 2, connection=Connection(addr)) as client:
        assert client.latest_step() == 1
        assert client.restore_point(2) is None
        client.load(2, rank=1, timeline=unfinished)  # rank 1's half of step 2 does exist...
        with pytest.raises(NotFoundError):
            client.load(2, rank=0, timeline=unfinished)  # ...but the coordinator's shard (data + metadata) does not

    reader = MemStoreReader(job, connection=Connection(addr))
    loaded = _blank_like(old)
    dcp.load(loaded, storage_reader=reader)
    assert reader.resolved_step == 1 and reader.saved_world_size == 2
    assert_same(old, loaded)

    with pytest.raises(NotFoundError, match=r"step 2 of job 'dcp-incomplete' has no DCP metadata.*did not finish"):
        MemStoreReader(job, 2, connection=Connection(addr)).read_metadata()
    # how dcp.load reports a rank's error: with the reader's message, where this torch keeps it
    with pytest.raises(CheckpointException, match="has no DCP metadata" if LOAD_KEEPS_READER_MESSAGE else None):
        dcp.load(_blank_like(new), storage_reader=MemStoreReader(job, connection=Connection(addr)), checkpoint_id=2)

    # finishing the save makes step 2 the newest complete step
    _drive_save(job, 2, addr, [new, new])
    loaded = _blank_like(new)
    dcp.load(loaded, storage_reader=MemStoreReader(job, connection=Connection(addr)))
    assert_same(new, loaded)

    with pytest.raises(NoCheckpointError, match="'no-such-job'"):
        MemStoreReader("no-such-job", connection=Connection(addr)).read_metadata()
    with CheckpointClient("plain-job", 0, 1, connection=Connection(addr)) as plain:
        plain.save(9, {"w": torch.ones(2)}).wait(30)
    with pytest.raises(NotFoundError, match="not written by MemStoreWriter"):
        MemStoreReader("plain-job", connection=Connection(addr)).read_metadata()


def test_a_writer_prepared_at_set_up_saves_into_the_memory_it_reserved(make_inprocess_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_inprocess_cluster(hosts=1, replicas=1)
    addr, job = cluster.address("h0"), "dcp-prepared"
    state = _train_state(3)
    writer = MemStoreWriter(job, connection=Connection(addr))
    assert writer.prepare(state) is True
    client = writer._client
    assert client is not None and client._ring.ahead_path() in client._ring.mapped_paths  # reserved and mapped before any save
    assert writer.prepare(state) is False  # once per client
    allocations = allocations_now(client)
    for step in (1, 2):  # one writer for every save: its client, and the memory it prepared, are kept
        dcp.save(state, storage_writer=writer, checkpoint_id=step)
        assert writer._client is client
    assert allocations == [], allocations  # the first save (the coordinator's, metadata included) fit in what was prepared
    loaded = _blank_like(state)
    dcp.load(loaded, storage_reader=MemStoreReader(job, connection=Connection(addr)))
    assert_same(state, loaded)
    writer.close()


def test_async_save_thread_mode(make_inprocess_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_inprocess_cluster(hosts=2, replicas=2)
    addr, job = cluster.address("h1"), "dcp-async-thread"
    state = _train_state(5)
    result = dcp.async_save(state, storage_writer=MemStoreWriter(job, 8, connection=Connection(addr)))
    future = getattr(result, "upload_completion", result)  # AsyncSaveResponse (torch 2.9+) or a Future
    future.result(timeout=60)
    loaded = _blank_like(state)
    dcp.load(loaded, storage_reader=MemStoreReader(job, connection=Connection(cluster.address("h0"))))  # through the other host
    assert_same(state, loaded)


# Process-mode async saves: test_dcp_conformance's async test runs them on two ranks, the daemon reused; this one-rank
# case (the writer pickled to the daemon, never connected here) runs in the slow stage.
@pytest.mark.slow
def test_async_save_process_mode(make_inprocess_cluster, forkserver) -> None:  # type: ignore[no-untyped-def]
    cluster = make_inprocess_cluster(hosts=2, replicas=2)
    addr, job = cluster.address("h0"), "dcp-async-process"
    run_ranks(_async_process_worker, 1, addr, job, 6, free_ports(1)[0])
    expected = _train_state(11)
    loaded = _blank_like(expected)
    dcp.load(loaded, storage_reader=MemStoreReader(job, connection=Connection(addr)))
    assert_same(expected, loaded)


def _load_same_size_worker(rank: int, addr: str, job: str, port: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    _init_group(rank, 2, port)
    try:
        mesh = init_device_mesh("cpu", (2,))
        full = _full_tensors()
        state: dict[str, Any] = {
            "w": distribute_tensor(torch.zeros_like(full["w"]), mesh, [Shard(0)]),
            "b": distribute_tensor(torch.zeros_like(full["b"]), mesh, [Shard(1)]),
            "rep": torch.zeros_like(full["rep"]),
            "extra": {"epoch": 0, "tag": ""},
        }
        reader = MemStoreReader(job, connection=Connection(addr), group=dist.group.WORLD)
        dcp.load(state, storage_reader=reader)
        stats = reader.agreement_stats
        assert stats is not None and not stats.fallback and stats.rpcs == 1, stats  # one scoped call per rank, no listing
        assert reader.resolved_step == 3 and reader.saved_world_size == 2
        assert _bits_equal(state["w"].full_tensor(), full["w"]) and _bits_equal(state["rep"], full["rep"])
        reader.close()
    finally:
        dist.destroy_process_group()


def test_resharding_two_ranks_to_one_and_four(make_inprocess_cluster, forkserver) -> None:  # type: ignore[no-untyped-def]
    cluster = make_inprocess_cluster(hosts=2, replicas=2)
    addr, job = cluster.address("h0"), "dcp-reshard"
    run_ranks(_save_sharded_worker, 2, addr, job, 3, free_ports(1)[0])

    with CheckpointClient(job, 0, 2, connection=Connection(addr)) as client:
        assert client.latest_step() == 3
        sizes = [sum(v.numel() for v in client.load(3, rank=r)["items"].values() if isinstance(v, torch.Tensor)) for r in (0, 1)]
    assert all(s > 0 for s in sizes), sizes  # each rank stored its own half

    # 2 -> 1: a single process (no process group) loads the full tensors
    full = _full_tensors()
    state = {k: torch.zeros_like(v) for k, v in full.items()} | {"extra": {"epoch": 0, "tag": ""}}
    reader = MemStoreReader(job, 3, connection=Connection(cluster.address("h1")))  # explicit step: its world size comes from rank 0's shard
    dcp.load(state, storage_reader=reader)
    assert reader.saved_world_size == 2
    for k, v in full.items():
        assert _bits_equal(state[k], v), k  # type: ignore[arg-type]
    assert state["extra"] == {"epoch": 7, "tag": "two-ranks"}

    # 2 -> 4: DTensor Shard(0) over four gloo ranks (uneven: 3, 3, 3, 1 rows), agreed over the loading group
    run_ranks(_load_sharded_worker, 4, addr, job, free_ports(1)[0])
    # 2 -> 2 agreed over the group: the ranks' own stores decide, nobody lists the cluster
    run_ranks(_load_same_size_worker, 2, addr, job, free_ports(1)[0])


def test_interrupted_resave_keeps_the_complete_version(make_inprocess_cluster, forkserver) -> None:  # type: ignore[no-untyped-def]
    """Two gloo ranks re-save step 5, the coordinator fails in finish(): every rank still loads the old values of step 5."""
    cluster = make_inprocess_cluster(hosts=2, replicas=2)
    run_ranks(_resave_worker, 2, cluster.address("h0"), "dcp-resave", free_ports(1)[0])
