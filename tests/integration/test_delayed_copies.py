"""The device-copy path of saves, run on the CPU against real in-process stores with the CUDA runtime replaced by the
fake's **delayed copy engine** (``tests/harness/fake_cuda.py``): CPU tensors marked as device tensors are copied
through side streams and events like CUDA ones, each asynchronous copy written only when its event is synchronized,
and refused if its destination was unmapped or unregistered meanwhile (issue 39, item 1: "no device copy outlives
its destination").

The state is the CPU analogue of ``tests/gpu``'s mixed state (``gpu_state``): small tensors, views, fp8, complex
conj/neg views, empty, 0-d, bool, a parameter, a CPU tensor beside them. Saves alternate ``capture="copied"`` and
``capture="enqueued"`` under ring churn: a store too small for the whole ring (its fill thread runs during
captures), a failed registration (the ring re-maps the segment and retries), a store restart. Every step is
restored bit-exact.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.harness.fake_cuda import FakeCudaRuntime, FakeEvent, FakeStream
from tests.states import assert_same, mixed_expected, mixed_tensors
from trainer_client import CheckpointClient
from trainer_client.capture import cuda
from trainer_client.capture.device_save import DeviceCopier
from trainer_client.errors import CaptureError, MemstoreClientError
from trainer_client.knobs import STRICT_PINNING_ENV as STRICT_ENV
from trainer_client.serialization import plan

pytestmark = pytest.mark.integration


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCudaRuntime]:
    """The fake CUDA runtime with its delayed copy engine, in strict mode (as tests/gpu runs): a copy that would go
    through pageable memory is an error."""
    monkeypatch.setenv(STRICT_ENV, "1")
    with cuda.installed(FakeCudaRuntime()) as runtime:
        assert isinstance(runtime, FakeCudaRuntime)
        yield runtime


def mixed_state(fake: FakeCudaRuntime, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``gpu_state`` of tests/gpu/test_gpu_capture.py on the CPU: the tensors ``fake`` counts as device tensors, and the
    expected state, built apart."""
    cpu = mixed_tensors(seed, big=1 << 18, scalar=3.5 + seed)  # "big": 1 MiB, past the batching threshold
    dev = fake.device
    state: dict[str, Any] = {
        "w": dev(cpu["w"].clone()),
        "bf16": dev(cpu["bf16"].clone()),
        "int_t": dev(cpu["int_t"].t().contiguous().t()),  # non-contiguous
        "empty": dev(cpu["empty"].clone()),
        "scalar": dev(cpu["scalar"].clone()),
        "mask": dev(cpu["mask"].clone()),
        "fp8": dev(cpu["fp8"].clone()),
        "conj": dev(cpu["complex"].clone().conj()),  # a conj view: stored resolved
        "neg": dev(cpu["complex"].clone().conj().imag),  # a neg view
        "big": dev(cpu["big"].clone()),
        "param": dev(torch.nn.Parameter(cpu["w"][:4].clone())),
        "on_cpu": cpu["on_cpu"].clone(),  # not a device tensor: the host writer copies it
        "step": seed,
    }
    expected = mixed_expected(cpu, seed)
    return state, expected


def test_the_mixed_state_goes_through_the_device_copies(engine: FakeCudaRuntime) -> None:
    state, _ = mixed_state(engine, 1)
    layout = plan(state)
    assert len(cuda.device_part(layout).blobs) == 11  # every marked tensor; "on_cpu" and "step" are the host writer's


def save_and_check(client: CheckpointClient, step: int, state: dict[str, Any], expected: dict[str, Any], capture: str) -> None:
    client.save(step, state, capture=capture).wait(60)  # verified (R=1): restorable
    assert_same(client.load(step), expected)


def save_until_it_lands(client: CheckpointClient, step: int, state: dict[str, Any], expected: dict[str, Any], capture: str) -> int:
    """``save_and_check`` after a store restart, retried until it lands (within 30 s); the attempts that failed."""
    deadline = time.monotonic() + 30
    for failed in itertools.count():
        try:
            save_and_check(client, step, state, expected, capture)
            return failed
        except MemstoreClientError:  # the lease reserved before the restart, the control socket: gone with the store
            if time.monotonic() > deadline:
                raise
    raise AssertionError("unreachable")


@pytest.mark.parametrize("saves", [pytest.param(60, id="60"), pytest.param(200, id="200", marks=pytest.mark.slow)])
def test_saves_alternating_capture_modes_under_ring_churn_restore_bit_exact(
    make_inprocess_cluster: Any, engine: FakeCudaRuntime, saves: int
) -> None:
    """Copied and enqueued saves in turn, while the ring's fill thread maps, registers and prunes (a store too small for
    the whole ring), a registration fails once (the segment is re-mapped) and the store restarts: every copy lands in
    memory mapped and registered from its queueing to its synchronize, and every step restores bit-exact."""
    cluster = make_inprocess_cluster(hosts=1, replicas=1, capacity="6MiB")
    restart_at, fail_at = saves // 2, saves // 4
    retried = 0
    with CheckpointClient("delayed", 0, 1, store=cluster.address("h0")) as client:
        for step in range(1, saves + 1):
            capture = "enqueued" if step % 2 else "copied"
            state, expected = mixed_state(engine, step)
            if step == fail_at:
                engine.fail_next = [cuda.ERROR_INVALID_VALUE]  # the next registration fails once: re-mapped and retried
            if step == restart_at:
                cluster.restart("h0")  # its segments go: the ring's mappings of them are dropped as the next answers come
                retried += save_until_it_lands(client, step, state, expected, capture)
            else:
                save_and_check(client, step, state, expected, capture)
        assert client.stats().capture.fallbacks == 0
    assert retried >= 1  # the lease reserved before the restart was gone
    assert engine.copy_errors == [] and engine.pending_copies == 0
    assert engine.async_copies >= 2 * saves and engine.written == engine.async_copies and engine.sync_copies == 0
    assert [code for _, _, code in engine.failures] == [cuda.ERROR_INVALID_VALUE]  # the forced one, and nothing else
    assert engine.live == {}  # every registration undone once nothing copied into it
    assert engine.registrations >= saves  # churn: segments left the ring and new ones were registered all along


def test_saves_without_shared_memory_copy_through_the_delayed_engine(make_inprocess_cluster: Any, engine: FakeCudaRuntime) -> None:
    """Staging buffers (no shared memory): the large one is registered, copied into asynchronously and restored."""
    cluster = make_inprocess_cluster(hosts=1, replicas=1, capacity="64MiB")
    with CheckpointClient("delayed-remote", 0, 1, store=cluster.address("h0"), use_shared_memory=False) as client:
        for step in range(1, 7):
            state, expected = mixed_state(engine, step)
            state["pad"] = expected["pad"] = torch.zeros(1 << 20)  # 4 MiB: the staging buffer is large enough to register
            save_and_check(client, step, state, expected, "enqueued" if step % 2 else "copied")
    assert engine.copy_errors == [] and engine.pending_copies == 0
    assert engine.async_copies > 0 and engine.sync_copies == 0


def test_a_close_racing_a_save_leaves_its_segment_until_the_copies_land(
    make_inprocess_cluster: Any, engine: FakeCudaRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``client.close()`` on another thread (a shutdown hook) while the trainer's ``capture="copied"`` save has its
    copies queued: the ring must not unregister or unmap that segment before the copies land."""
    cluster = make_inprocess_cluster(hosts=1, replicas=1, capacity="64MiB")
    client = CheckpointClient("delayed-close", 0, 1, store=cluster.address("h0"))
    queued, go = threading.Event(), threading.Event()
    synchronize = engine.synchronize

    def held(waitable: FakeStream | FakeEvent) -> None:
        if isinstance(waitable, FakeEvent) and engine.pending_copies:
            queued.set()
            go.wait(30)
        synchronize(waitable)

    monkeypatch.setattr(engine, "synchronize", held)
    state, _ = mixed_state(engine, 1)
    outcome: list[BaseException | None] = []

    def save() -> None:
        try:
            client.save(1, state).wait(30)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    trainer = threading.Thread(target=save)
    trainer.start()
    try:
        assert queued.wait(30), "the save's copies were never queued"
        client.close()
        assert engine.live, "the segment the copies are queued into was unregistered under them"
    finally:
        go.set()
        trainer.join(30)
    assert not trainer.is_alive() and len(outcome) == 1
    assert not isinstance(outcome[0], CaptureError), outcome  # the copies landed; the commit may find the client closed
    assert engine.copy_errors == [] and engine.pending_copies == 0 and engine.written > 0
    assert engine.live == {}  # unregistered and unmapped once the copies landed


def test_strict_mode_refuses_copies_into_unregistered_memory_before_queueing_any(
    engine: FakeCudaRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, _ = mixed_state(engine, 3)
    layout = plan(state)
    target = torch.zeros(layout.nbytes, dtype=torch.uint8)  # not registered
    copier = DeviceCopier()
    with pytest.raises(CaptureError, match=STRICT_ENV):
        copier.start(layout, cuda.device_part(layout).blobs, target)
    assert engine.async_copies == engine.sync_copies == 0
    monkeypatch.delenv(STRICT_ENV)
    copier.start(layout, cuda.device_part(layout).blobs, target).synchronize()  # synchronous copies, never non_blocking
    assert engine.sync_copies > 0 and engine.async_copies == 0 and engine.copy_errors == []
