"""CUDA tensors into the store and back onto a device, against real stores (docs/gpu.md).

Every test here is marked ``gpu``: where torch sees no CUDA device, tests/conftest.py deselects them (they are
reported as deselected, never as passed). Run them on a GPU machine with ``pytest tests/gpu``.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from memstore.testing import wait_for
from tests.harness.listing import own_steps
from tests.states import assert_same, mixed_expected, mixed_tensors
from trainer_client import CheckpointClient
from trainer_client.capture import cuda, device_restore
from trainer_client.capture.ring import CaptureStats
from trainer_client.dcp import MemStoreReader, MemStoreWriter
from trainer_client.knobs import STRICT_PINNING_ENV as STRICT_ENV

pytestmark = [pytest.mark.gpu, pytest.mark.integration]


def devices() -> list[torch.device]:
    return [torch.device("cuda", i) for i in range(min(2, torch.cuda.device_count()))]


def gpu_state(seed: int, scale: int = 1) -> tuple[dict[str, Any], dict[str, Any]]:
    """A state with CUDA tensors (on two devices when there are two) and its expected CPU copy."""
    devs = devices()
    other = devs[-1]
    cpu = mixed_tensors(seed, scale)  # "big": 16 MiB
    state: dict[str, Any] = {
        "w": cpu["w"].to(devs[0]),
        "bf16": cpu["bf16"].to(other),
        "int_t": cpu["int_t"].t().contiguous().to(devs[0]).t(),  # non-contiguous on the device
        "empty": cpu["empty"].to(devs[0]),
        "scalar": cpu["scalar"].to(other),
        "mask": cpu["mask"].to(devs[0]),
        "fp8": cpu["fp8"].to(devs[0]),
        "conj": cpu["complex"].to(devs[0]).conj(),  # a conj view: stored resolved
        "neg": cpu["complex"].to(other).conj().imag,  # a neg view
        "big": cpu["big"].to(other),
        "param": torch.nn.Parameter(cpu["w"][:4].clone().to(devs[0])),
        "on_cpu": cpu["on_cpu"],
        "step": 7,
    }
    expected = mixed_expected(cpu, 7)
    return state, expected


class RecordingRuntime:
    """The real CUDA runtime behind ``trainer_client.capture.cuda``, with every registration recorded."""

    pins_host_states = False

    def __init__(self, real: cuda.CudaRuntime) -> None:
        self.real = real
        self.registered: list[tuple[int, int, int]] = []  # successful registrations, in order
        self.unregistered: list[int] = []
        self.failed: list[tuple[int, int, int, int]] = []
        self.live: dict[int, int] = {}  # address -> size, while registered

    def host_register(self, ptr: int, size: int, flags: int) -> int:
        code = self.real.host_register(ptr, size, flags)
        if code == 0:
            self.registered.append((ptr, size, flags))
            self.live[ptr] = size
        else:
            self.failed.append((ptr, size, flags, code))
        return code

    def host_unregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        self.live.pop(ptr, None)
        return self.real.host_unregister(ptr)

    def get_last_error(self) -> int:
        return self.real.get_last_error()

    def error_text(self, code: int) -> str:
        return self.real.error_text(code)

    def __getattr__(self, name: str) -> Any:
        """Streams, events, device copies and the registrations' lookup: the real runtime's (it sees every
        registration made through this one)."""
        return getattr(self.real, name)


@pytest.fixture(autouse=True)
def strict(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every GPU test runs with fallbacks to pageable memory turned into errors (issue 25: registration never falls back)."""
    monkeypatch.setenv(STRICT_ENV, "1")


@pytest.fixture
def cudart() -> Iterator[RecordingRuntime]:
    recorder = RecordingRuntime(cuda.TorchCudaRuntime())
    with cuda.installed(recorder):
        yield recorder


@pytest.mark.parametrize("shared", [True, False], ids=["shm", "remote"])
@pytest.mark.parametrize("capture", ["copied", "enqueued"])
def test_cuda_state_round_trips_bit_exact(make_cluster, shared: bool, capture: str) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(hosts=1, replicas=1, capacity="1GiB")
    state, expected = gpu_state(1)
    with CheckpointClient(f"gpu-rt-{capture}", 0, 1, store=cluster.address("h0"), use_shared_memory=shared) as client:
        for step in (1, 2, 3):  # the later saves reuse registered memory
            handle = client.save(step, state, capture=capture)
            handle.wait_captured(block=True)
            assert handle.wait(60).state
            assert_same(client.load(step), expected)
            assert_same(client.load(step, zero_copy=False), expected)


def test_the_capture_ring_is_registered_once_and_never_again(make_cluster, cudart: RecordingRuntime) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(hosts=2, replicas=2, capacity="2GiB")
    state, expected = gpu_state(2, scale=8)
    client = CheckpointClient("gpu-pin", 0, 1, store=cluster.address("h0"))
    try:
        assert client.stats().shared_memory
        client.prepare(state)  # fills the ring: every segment mapped and registered now
        warm = len(cudart.registered)
        for step in range(1, 21):
            client.save(step, state, capture="enqueued" if step % 2 else "copied").wait(60)
            # a trainer's cadence: retention has dropped what it drops before the next save (test_capture_ring.py)
            wait_for(lambda: own_steps(cluster, "h0", "gpu-pin", 0) <= 2, timeout=30, what="retention")
        assert cudart.failed == []  # nothing past a file's end (1), nothing registered twice (712)
        assert len(cudart.registered) == warm, "after prepare() no save registers anything"
        assert all(flags == cuda.HOST_REGISTER_PORTABLE for _, _, flags in cudart.registered)
        assert client.stats().capture == CaptureStats(warm, 0, "")
        assert_same(client.load(20), expected)
    finally:
        client.close()
    assert cudart.live == {} and len(cudart.unregistered) == len(cudart.registered), "close() unregisters every mapping"


def test_a_many_tensor_bf16_state_round_trips(make_cluster) -> None:  # type: ignore[no-untyped-def]
    """Hundreds of small and large bf16 tensors: neighbouring small ones are copied as one (issue 25, item 5)."""
    cluster = make_cluster(hosts=1, replicas=1, capacity="2GiB")
    g = torch.Generator().manual_seed(9)
    cpu = {f"p{i}": torch.randn((2048,) if i % 3 else (512, 256), generator=g).to(torch.bfloat16) for i in range(600)}
    state = {k: v.to("cuda") for k, v in cpu.items()}
    with CheckpointClient("gpu-many", 0, 1, store=cluster.address("h0")) as client:
        for step, capture in ((1, "copied"), (2, "enqueued")):
            client.save(step, state, capture=capture).wait(60)
            assert_same(client.load(step), cpu)
            onto = client.load(step, map_location="cuda")
            assert all(torch.equal(onto[k], state[k]) for k in state)


def test_enqueued_capture_is_gated_before_the_optimizer_step(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(hosts=1, replicas=1, capacity="2GiB")
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 4096)).to(device)  # 128 MiB of weights
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(64, 4096, device=device)
    with CheckpointClient("gpu-gate", 0, 1, store=cluster.address("h0")) as client:
        gate = client.gate(opt)
        before = collections.OrderedDict((k, v.detach().cpu().clone()) for k, v in model.state_dict().items())
        model(x).square().mean().backward()  # gradients ready before the save
        t0 = time.perf_counter()
        handle = client.save(1, model.state_dict(), capture="enqueued")
        stall = time.perf_counter() - t0
        calls: list[bool] = []
        assert handle._capture is not None
        real = handle._capture.wait_captured
        handle._capture.wait_captured = lambda timeout, block: (calls.append(block), real(timeout, block))[1]  # type: ignore[method-assign]
        opt.step()  # in place on the weights being copied: the gate orders it after the copies, on the GPU
        assert calls == [False]
        handle.wait(60)
        assert_same(client.load(1), before)  # the state as it was at save(), not after the step
        after = model.state_dict()
        assert not torch.equal(after["0.weight"].cpu(), before["0.weight"])
        gate.remove()
        print(f"enqueued stall {stall * 1e3:.2f} ms")


def test_wait_captured_block_and_the_state_changed_afterwards(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(hosts=1, replicas=1, capacity="1GiB")
    state, expected = gpu_state(3, scale=16)
    with CheckpointClient("gpu-wait", 0, 1, store=cluster.address("h0")) as client:
        handle = client.save(1, state, capture="enqueued")
        handle.wait_captured()  # default: the current streams wait for the copies
        for key in ("w", "big", "bf16"):
            state[key].add_(1)  # enqueued on the current stream: after the copies
        handle2 = client.save(2, state, capture="enqueued")
        handle2.wait_captured(block=True)
        assert handle.wait(60).state and handle2.wait(60).state
        assert_same(client.load(1), expected)
        loaded2 = client.load(2)
        assert torch.equal(loaded2["big"], expected["big"] + 1)


@pytest.mark.parametrize("shared", [True, False], ids=["shm", "remote"])
def test_load_onto_cuda_bit_exact(make_cluster, cudart: RecordingRuntime, shared: bool) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(hosts=1, replicas=1, capacity="1GiB")
    state, expected = gpu_state(4, scale=8)
    with CheckpointClient("gpu-load", 0, 1, store=cluster.address("h0"), use_shared_memory=shared) as client:
        client.prepare(state)  # the ring is full before the save: its fill thread registers nothing during the loads
        client.save(1, state).wait(60)
        cudart.registered.clear()
        cudart.unregistered.clear()
        for where in ("cuda", "cuda:0", torch.device("cuda", 0)):
            out = client.load(1, map_location=where)
            for key, value in expected.items():
                if isinstance(value, torch.Tensor):
                    assert out[key].device == torch.device("cuda", 0), key
            assert type(out["param"]) is torch.nn.Parameter
            assert_same({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in out.items()},
                        {k: v.detach() if isinstance(v, torch.nn.Parameter) else v for k, v in expected.items()})  # fmt: skip
        # Nothing is registered per load: the shard is read in place from the ring (same process) or through the
        # process's bounce ring, whose buffers are registered once.
        assert all(size == device_restore.BOUNCE_CHUNK_BYTES for _, size, _ in cudart.registered), cudart.registered
        assert len(cudart.registered) <= device_restore.BOUNCE_BUFFERS


def test_dcp_save_and_load_of_gpu_tensors(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(hosts=1, replicas=1, capacity="1GiB")
    addr, job = cluster.address("h0"), "gpu-dcp"
    device = torch.device("cuda", 0)
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 256)).to(device).to(torch.bfloat16)
    state = {"model": model.state_dict(), "extra": {"step": 3}}
    dcp.save(state, storage_writer=MemStoreWriter(job, 1, store=addr))
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "extra": {"step": 0}}
    dcp.load(target, storage_reader=MemStoreReader(job, store=addr))
    for key, value in state["model"].items():
        assert target["model"][key].device == device
        assert torch.equal(target["model"][key], value), key
    assert target["extra"]["step"] == 3
