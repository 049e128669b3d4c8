"""save(capture=...), handle.wait_captured(), client.gate(optimizer) and load(map_location=...) against real stores,
with CPU tensors (the CUDA side is in tests/gpu/). Commit delays and failures come from the store's fault points."""

from __future__ import annotations

import collections
import copy
import time
from typing import Any

import pytest
import torch

from memstore.testing import wait_for
from tests.states import assert_same, rank_state
from trainer_client import CheckpointClient
from trainer_client.errors import CapacityExceededError, InvalidArgumentError, ReplicationError, StoreUnavailableError

pytestmark = pytest.mark.integration


def big_state(seed: int, mib: int = 48) -> dict[str, Any]:
    state = rank_state(0, seed, scale=16)
    state["big"] = torch.randn(mib << 18, generator=torch.Generator().manual_seed(seed))  # mib MiB of float32
    return state


def test_enqueued_save_returns_before_the_commit_and_round_trips(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(hosts=1, replicas=1, capacity="512MiB", env={"MEMSTORE_FAULTS": "commit.before_ack=stall:3"})
    state = big_state(1)
    expected = copy.deepcopy(state)
    with CheckpointClient("cap-enq", 0, 1, store=cluster.address("h0")) as client:
        t0 = time.monotonic()
        handle = client.save(1, state, capture="enqueued")
        assert time.monotonic() - t0 < 1.5  # the store holds Commit for 3 s
        assert not handle.done()
        handle.wait_captured()  # the CPU tensors are copied: the state may change now
        assert time.monotonic() - t0 < 1.5 and not handle.done()
        for value in (state["big"], state["model"]["weight"], state["optim"]["state"][0]["exp_avg"]):
            value.add_(1)
        handle.wait_captured(block=True)  # the commit too
        assert time.monotonic() - t0 > 2.5
        assert handle.wait(30).copies == 1
        assert_same(client.load(1), expected)  # what save() saw, not what the trainer did afterwards

        # capture="copied" (the default) on the same store: returns once committed (this commit is not delayed)
        client.save(2, state).wait(30)
        assert_same(client.load(2), state)


def test_saves_in_a_row_wait_for_the_capture_in_flight(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(hosts=1, replicas=1, capacity="512MiB", env={"MEMSTORE_FAULTS": "commit.before_ack=stall:2"})
    with CheckpointClient("cap-row", 0, 1, store=cluster.address("h0")) as client:
        states = [big_state(s, mib=8) for s in (1, 2, 3)]
        first = client.save(1, states[0], capture="enqueued")
        t0 = time.monotonic()
        second = client.save(2, states[1], capture="enqueued")  # waits for the first capture (held 2 s in Commit)
        assert time.monotonic() - t0 > 1.0 and first.done()
        third = client.save(3, states[2], capture="enqueued")
        for step, handle in ((1, first), (2, second), (3, third)):
            handle.wait(30)
            if step > 1:  # --keep 2: step 1 went once step 3 came (its segment serves step 3 when retention is late)
                assert_same(client.load(step), states[step - 1])
        # The background saves counted as saved: saving step 2 again is a rollback, on a new epoch of the timeline.
        assert client.timeline.endswith(".0")
        client.save(2, states[2], capture="enqueued").wait(30)
        assert client.timeline.endswith(".1")
        assert_same(client.load(2), states[2])


def test_a_failed_background_commit_surfaces_from_wait_captured_and_wait(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(hosts=1, replicas=1, capacity="512MiB", env={"MEMSTORE_FAULTS": "commit.before_ack=error"})
    state = rank_state(0, 1, scale=4)
    with CheckpointClient("cap-err", 0, 1, store=cluster.address("h0")) as client:
        handle = client.save(1, state, capture="enqueued")
        with pytest.raises(StoreUnavailableError, match="commit step 1"):
            handle.wait_captured(block=True)
        with pytest.raises(StoreUnavailableError, match="commit step 1"):
            handle.wait(30)
        assert handle.done()
        # the client goes on: the next save (the fault fires once) commits
        client.save(2, state, capture="enqueued").wait(30)
        assert_same(client.load(2), state)


def test_a_full_store_in_the_background_surfaces_from_wait(make_inprocess_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_inprocess_cluster(hosts=1, replicas=1, capacity="4MiB")
    state = big_state(1, mib=16)
    addr = cluster.address("h0")
    # Without shared memory the store sees the size only when the bytes arrive: the send fails in the background.
    with CheckpointClient("cap-full", 0, 1, store=addr, use_shared_memory=False) as client:
        handle = client.save(1, state, capture="enqueued")
        with pytest.raises(CapacityExceededError) as err:
            handle.wait(30)
        assert err.value.capacity == 4 << 20 and err.value.needed > err.value.capacity
        with pytest.raises(CapacityExceededError):
            handle.wait_captured()
    with CheckpointClient("cap-skip", 0, 1, store=addr, use_shared_memory=False, on_capacity="skip") as client:
        handle = client.save(1, state, capture="enqueued")
        handle.wait_captured(block=True)  # a skipped save is not an error here ...
        assert handle.skipped and "capacity" in handle.skipped_reason.lower()
        with pytest.raises(ReplicationError, match="skipped"):  # ... but it never reaches R copies
            handle.wait(30)
    # With shared memory the store refuses at Allocate, before any copy: save() itself raises.
    with CheckpointClient("cap-full-shm", 0, 1, store=addr) as client, pytest.raises(CapacityExceededError):
        client.save(1, state, capture="enqueued")


def test_invalid_capture_value_is_named(make_inprocess_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_inprocess_cluster(hosts=1, replicas=1, capacity="64MiB")
    with CheckpointClient("cap-bad", 0, 1, store=cluster.address("h0")) as client:
        with pytest.raises(InvalidArgumentError, match="capture 'later' is invalid: expected 'copied' or 'enqueued'"):
            client.save(1, {"x": torch.ones(2)}, capture="later")
        assert client.latest_step() is None  # nothing was saved


def test_gate_calls_wait_captured_before_each_optimizer_step(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(hosts=1, replicas=1, capacity="512MiB", env={"MEMSTORE_FAULTS": "commit.before_ack=stall:2"})
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(8, 1024)
    with CheckpointClient("cap-gate", 0, 1, store=cluster.address("h0")) as client:
        gate = client.gate(opt)
        before = collections.OrderedDict((k, v.clone()) for k, v in model.state_dict().items())
        model(x).square().mean().backward()
        handle = client.save(1, model.state_dict(), capture="enqueued")
        capture = handle._capture
        assert capture is not None
        calls: list[bool] = []
        real = capture.wait_captured
        capture.wait_captured = lambda timeout, block: (calls.append(block), real(timeout, block))[1]  # type: ignore[method-assign]
        opt.step()  # updates the weights in place, after the hook waited for their copy
        assert calls == [False] and not handle.done()  # the commit is still held by the store
        handle.wait(30)
        assert_same(client.load(1), before)
        assert not torch.equal(model.weight, before["weight"])
        gate.remove()
        opt.step()
        assert calls == [False]  # removed: not called again


def test_gate_raises_a_failed_capture_once(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(hosts=1, replicas=1, capacity="512MiB", env={"MEMSTORE_FAULTS": "commit.before_ack=error"})
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with CheckpointClient("cap-gate-err", 0, 1, store=cluster.address("h0")) as client:
        client.gate(opt)
        handle = client.save(1, model.state_dict(), capture="enqueued")
        wait_for(handle.done, timeout=30, what="the background commit to fail")
        model(torch.randn(2, 16)).sum().backward()
        with pytest.raises(StoreUnavailableError, match="commit step 1"):
            opt.step()
        opt.step()  # raised once; the handle keeps the error for wait()
        with pytest.raises(StoreUnavailableError):
            handle.wait(10)


@pytest.mark.parametrize("shared", [True, False], ids=["shm", "remote"])
def test_map_location_meta_puts_every_tensor_there(make_inprocess_cluster, shared: bool) -> None:  # type: ignore[no-untyped-def]
    cluster = make_inprocess_cluster(hosts=1, replicas=1, capacity="256MiB")
    state = big_state(3, mib=4)
    state["param"] = torch.nn.Parameter(torch.randn(3, 3))
    with CheckpointClient("cap-meta", 0, 1, store=cluster.address("h0"), use_shared_memory=shared) as client:
        client.save(1, state).wait(30)
        for where in ("meta", torch.device("meta")):
            out = client.load(1, map_location=where)
            assert type(out["model"]) is collections.OrderedDict and type(out["param"]) is torch.nn.Parameter
            _assert_meta_like(out, state)
        assert_same(client.load(1, map_location="cpu"), state)


def _assert_meta_like(out: Any, ref: Any, path: str = "state") -> None:
    if isinstance(ref, torch.Tensor):
        assert out.is_meta and out.shape == ref.shape and out.dtype == ref.dtype, path
        assert out.requires_grad == ref.requires_grad, path
    elif isinstance(ref, dict):
        assert list(out) == list(ref), path
        for key in ref:
            _assert_meta_like(out[key], ref[key], f"{path}[{key!r}]")
    elif isinstance(ref, (list, tuple)):
        assert type(out) is type(ref) and len(out) == len(ref), path
        for i, (a, b) in enumerate(zip(out, ref, strict=True)):
            _assert_meta_like(a, b, f"{path}[{i}]")
    else:
        assert out == ref, path


def test_bad_map_location_fails_before_anything_is_read(make_inprocess_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_inprocess_cluster(hosts=1, replicas=1, capacity="64MiB")
    with CheckpointClient("cap-badloc", 0, 1, store=cluster.address("h0")) as client:
        for bad, named in (("gpu:0", "'gpu:0'"), (0, "0 (int)"), ("cuda:x", "'cuda:x'")):
            with pytest.raises(InvalidArgumentError, match="map_location") as err:
                client.load(map_location=bad)  # the job has no checkpoint at all: the argument is checked first
            assert named in str(err.value)
