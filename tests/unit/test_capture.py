"""trainer_client.capture.device_save without a GPU: the host part of a write, the registration cache (through the CUDA seam,
with tests.harness.fake_cuda's runtime enforcing cudaHostRegister's rules), the capture sequence, map_location parsing
and the device walk of a decoded state."""

from __future__ import annotations

import collections
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from memstore.v1.pagefaults import address_of
from tests.harness.fake_cuda import FakeCudaRuntime
from trainer_client import serialization
from trainer_client.capture import cuda, device_restore, device_save
from trainer_client.errors import CapacityExceededError, InvalidArgumentError, SerializationError, StoreUnavailableError

pytestmark = pytest.mark.unit

PAGE = mmap.PAGESIZE
PORTABLE = cuda.HOST_REGISTER_PORTABLE


# -- host part -------------------------------------------------------------------------------


def _slot(layout: serialization.ShardLayout, tensor: torch.Tensor) -> tuple[int, int, int]:
    (index,) = [i for i in range(layout.num_tensors) if layout.slot(i)[0] is tensor]
    _, offset, nbytes = layout.slot(index)
    return index, offset, nbytes


def test_host_part_writes_everything_but_the_skipped_blobs() -> None:
    skipped = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48).t()  # non-contiguous: the general copy path
    state = {"a": torch.randn(100), "skipped": skipped, "big": torch.randn(1 << 18), "n": np.arange(7), "b": b"xyz"}
    layout = serialization.plan(state)
    index, start, n = _slot(layout, skipped)
    assert layout.device_tensors() == []  # a CPU state has no blob for the device copier
    buf = bytearray(b"\xab" * layout.nbytes)
    device_save.host_writer(layout, [index], memoryview(buf))()
    assert bytes(buf[start : start + n]) == b"\xab" * n  # left for the DMA
    buf[start : start + n] = skipped.contiguous().numpy().tobytes()
    assert bytes(buf) == bytes(serialization.encode(state))  # and every other byte is what write_into writes
    assert_decodes(buf, state)


def assert_decodes(buf: bytearray, state: dict[str, Any]) -> None:
    out: Any = serialization.decode(buf)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(out[key], value), key
        elif isinstance(value, np.ndarray):
            assert np.array_equal(out[key], value), key
        else:
            assert out[key] == value, key


def test_a_tensor_changed_since_plan_is_refused_by_slot() -> None:
    state = {"x": torch.ones(3, 4).t()}
    layout = serialization.plan(state)
    state["x"].resize_(5)
    with pytest.raises(SerializationError, match="changed dtype or shape"):
        layout.slot(0)


# -- registrations --------------------------------------------------------------------------


def _anonymous(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def test_a_staging_buffer_is_registered_once_at_its_exact_size(fake_cuda: FakeCudaRuntime) -> None:
    size = 3 * PAGE + 123  # no power of two, not whole pages
    mm = _anonymous(size)
    addr = address_of(mm)
    pins = device_save.HostRegistrations()
    assert pins.pin(mm, addr, size) and pins.pin(mm, addr, size)  # the next save finds it registered
    assert fake_cuda.calls == [("register", addr, size, PORTABLE)]
    assert pins.registered == 1 and len(pins) == 1 and fake_cuda.live == {addr: (size, PORTABLE)}

    pins.release(mm)
    pins.release(mm)  # once only
    assert fake_cuda.calls[1:] == [("unregister", addr)] and fake_cuda.live == {} and len(pins) == 0

    assert pins.pin(mm, addr, size)  # released, then kept again: registered afresh
    assert fake_cuda.registrations == 2 and pins.registered == 2
    pins.release_all()
    assert fake_cuda.live == {} and fake_cuda.failures == [] and fake_cuda.last_error == 0
    mm.close()


def test_a_failed_registration_is_remembered_cleared_and_never_unregistered(fake_cuda: FakeCudaRuntime) -> None:
    mm = _anonymous(2 * PAGE)
    addr = address_of(mm)
    pins = device_save.HostRegistrations()
    fake_cuda.fail_next = [cuda.ERROR_HOST_MEMORY_ALREADY_REGISTERED]
    assert not pins.pin(mm, addr, 2 * PAGE)
    assert not pins.pin(mm, addr, 2 * PAGE)  # not retried every save
    assert [c[0] for c in fake_cuda.calls] == ["register"] and fake_cuda.last_error == 0  # the seam cleared the sticky error
    assert "712" in pins.failed and pins.registered == 0 and len(pins) == 1
    pins.release_all()
    assert [c[0] for c in fake_cuda.calls] == ["register"]  # nothing to unregister
    assert len(pins) == 0
    mm.close()


def test_an_overlapping_buffer_fails_alone_and_only_the_registered_one_is_unregistered(fake_cuda: FakeCudaRuntime) -> None:
    mm = _anonymous(4 * PAGE)
    addr = address_of(mm)
    pins = device_save.HostRegistrations()
    assert pins.pin(mm, addr, 4 * PAGE)
    inner = object()  # another owner whose bytes lie inside the first: CUDA refuses the second registration
    assert not pins.pin(inner, addr + PAGE, PAGE)
    assert fake_cuda.failures == [(addr + PAGE, PAGE, cuda.ERROR_HOST_MEMORY_ALREADY_REGISTERED)] and fake_cuda.last_error == 0
    pins.release(inner)  # must not unregister the first owner's range (it never registered anything)
    assert fake_cuda.live == {addr: (4 * PAGE, PORTABLE)}
    pins.release_all()
    assert fake_cuda.live == {} and [c for c in fake_cuda.calls if c[0] == "unregister"] == [("unregister", addr)]
    assert all(code != cuda.ERROR_HOST_MEMORY_NOT_REGISTERED for _, _, code in fake_cuda.failures)
    mm.close()


def test_a_buffer_reaching_past_its_file_is_refused(tmp_path: Path, fake_cuda: FakeCudaRuntime) -> None:
    path = tmp_path / "seg"
    path.write_bytes(b"\0" * (4 * PAGE))
    with open(path, "r+b") as fh:
        mm = mmap.mmap(fh.fileno(), 0)
    os.truncate(path, PAGE)  # the file shrank under the mapping: its last pages cannot be faulted in
    addr = address_of(mm)
    pins = device_save.HostRegistrations()
    assert not pins.pin(mm, addr, 4 * PAGE)
    assert fake_cuda.failures == [(addr, 4 * PAGE, cuda.ERROR_INVALID_VALUE)] and fake_cuda.last_error == 0 and pins.failed
    pins.release_all()
    assert fake_cuda.live == {} and [c[0] for c in fake_cuda.calls] == ["register"]
    mm.close()


def test_staging_buffers_are_pinned_only_when_large_and_page_aligned(fake_cuda: FakeCudaRuntime) -> None:
    from trainer_client.transport.remote import empty_buffer

    copier = device_save.DeviceCopier()
    small = torch.empty(1000, dtype=torch.uint8)
    assert not copier.pin_buffer(small)
    big = empty_buffer(4 << 20)  # an anonymous mapping: page-aligned
    assert copier.pin_buffer(big) and copier.pin_buffer(big)
    assert fake_cuda.live == {big.data_ptr(): (4 << 20, PORTABLE)} and fake_cuda.registrations == 1
    captures = device_save.Captures()
    captures._copier = copier
    captures.unpin(small, big)
    assert fake_cuda.live == {}

    other = empty_buffer(4 << 20)
    assert captures.copier.pin_buffer(other)
    captures.close()  # unregisters the staging buffers it still holds
    assert fake_cuda.live == {} and fake_cuda.failures == []


def test_a_cpu_state_is_pinned_only_under_a_runtime_that_pins_host_states() -> None:
    layout = serialization.plan({"w": torch.ones(4), "n": np.arange(3)})
    target = torch.empty(layout.nbytes, dtype=torch.uint8)
    captures = device_save.Captures()
    with cuda.installed(FakeCudaRuntime()):
        assert cuda.device_part(layout).pin  # the CPU suite's fake_cuda: the pinning logic runs without CUDA
    with cuda.installed(FakeCudaRuntime(pins_host_states=False)):
        assert cuda.device_part(layout) == cuda.DevicePart([], pin=False)  # like real CUDA: a CPU state needs no DMA
    assert captures.device_copies(layout, [], target) is None
    assert captures.device_copies(layout, [], target, deferred=True) is None
    assert not captures.has_copier  # nothing CUDA was made for it


# -- one capture ----------------------------------------------------------------------------


class FakeCopies(device_save.DeviceCopies):
    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def synchronize(self) -> None:
        self.log.append("synchronize")

    def gate(self) -> None:
        self.log.append("gate")


def starter(log: list[str], threads: list[str] | None = None) -> Callable[[], device_save.DeviceCopies]:
    """A ``start_copies``: logs "start" (and the thread it ran on) and hands back FakeCopies."""

    def start() -> device_save.DeviceCopies:
        log.append("start")
        if threads is not None:
            threads.append(threading.current_thread().name)
        return FakeCopies(log)

    return start


def test_capture_order_and_abort_only_after_the_copies_stopped() -> None:
    log: list[str] = []

    def fail() -> None:
        log.append("write")
        raise OSError("boom")

    job = device_save.Capture(starter(log), fail, lambda: log.append("finish"), lambda: log.append("abort"))  # type: ignore[func-returns-value]
    assert job.copies is None  # nothing enqueued before run()
    with pytest.raises(OSError, match="boom"):
        job.run()
    assert log == ["start", "write", "synchronize", "abort"]  # the destination goes back only once nothing writes into it

    log.clear()
    ok = device_save.Capture(starter(log), lambda: log.append("write"), lambda: log.append("finish"), lambda: log.append("abort"))  # type: ignore[func-returns-value]
    ok.on_success = lambda: log.append("saved")
    ok.run()
    assert log == ["start", "write", "synchronize", "finish", "saved"]


def test_copies_that_fail_to_start_abort_without_writing() -> None:
    log: list[str] = []

    def start() -> device_save.DeviceCopies:
        log.append("start")
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    job = device_save.Capture(start, lambda: log.append("write"), lambda: log.append("finish"), lambda: log.append("abort"))  # type: ignore[func-returns-value]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        job.run()
    assert log == ["start", "abort"] and job.copies is None


def test_enqueued_capture_wait_captured_and_errors() -> None:
    log: list[str] = []
    threads: list[str] = []
    committing = threading.Event()
    release = threading.Event()

    def commit() -> None:
        committing.set()
        assert release.wait(10)
        raise StoreUnavailableError("commit step 1: store gone")

    job = device_save.Capture(starter(log, threads), lambda: log.append("write"), commit, lambda: log.append("abort"))
    with ThreadPoolExecutor(1, thread_name_prefix="capture-test") as pool:
        job.start(pool)
        assert committing.wait(10)
        assert threads and threads[0].startswith("capture-test")  # the copies were enqueued on the capture thread
        job.wait_captured(None, block=False)  # the host part is done: the device copies gate the streams
        assert log == ["start", "write", "synchronize", "gate"] and not job.done()
        with pytest.raises(TimeoutError):
            job.wait_captured(0.05, block=True)
        release.set()
        with pytest.raises(StoreUnavailableError, match="store gone"):
            job.wait_captured(None, block=True)
        with pytest.raises(StoreUnavailableError):  # every later wait raises it too: never lost
            job.wait_captured(None, block=False)
        with pytest.raises(StoreUnavailableError):
            job.result()
        assert job.done() and job.failed()
    assert "abort" not in log  # the commit failed after the copies: the store, not abort, owns the destination


def test_a_full_store_in_the_background_becomes_a_skipped_save_when_asked() -> None:
    def full() -> None:
        raise CapacityExceededError("put step 1: no room", needed=10, used=5, capacity=12)

    job = device_save.Capture(None, lambda: None, full, lambda: None)
    with pytest.raises(CapacityExceededError):
        job.run()
    skipping = device_save.Capture(None, lambda: None, full, lambda: None)
    skipping.skip_capacity = True
    skipping.run()
    assert "no room" in skipping.skipped_reason


# -- restore onto a device ------------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, "cpu", "cpu:0", torch.device("cpu")])
def test_map_location_cpu_is_the_default_path(value: Any) -> None:
    assert device_restore.parse_map_location(value) is None


def test_map_location_meta() -> None:
    assert device_restore.parse_map_location("meta") == torch.device("meta")
    assert device_restore.parse_map_location(torch.device("meta")) == torch.device("meta")


@pytest.mark.parametrize(
    ("value", "named"),
    [("bogus", "'bogus'"), ("cuda:abc", "'cuda:abc'"), (3, "3 (int)"), (["cuda"], "['cuda'] (list)"), ("xpu", "'xpu'")],
)
def test_bad_map_location_is_named(value: Any, named: str) -> None:
    with pytest.raises(InvalidArgumentError, match="map_location") as err:
        device_restore.parse_map_location(value)
    assert named in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_map_location_cuda_without_cuda() -> None:
    with pytest.raises(InvalidArgumentError, match="'cuda:0': CUDA is not available"):
        device_restore.parse_map_location("cuda:0")


def test_move_tree_keeps_structure_identity_and_flags() -> None:
    shared = torch.arange(6.0)
    od: collections.OrderedDict[str, Any] = collections.OrderedDict(w=torch.ones(2, 3))
    od._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    arr = np.arange(4)
    tree = {
        "od": od,
        "list": [shared, {"again": shared}],
        "tuple": (torch.zeros(1), 5, "s"),
        "param": torch.nn.Parameter(torch.randn(2)),
        "grad": torch.randn(3).requires_grad_(),
        "arr": arr,
        "size": torch.Size([2, 3]),
    }
    out = device_restore.move_tree(tree, lambda t: t.to("meta"), copy_arrays=True)
    assert out["od"]._metadata == {"": {"version": 1}}
    assert out["od"] is od and type(out["od"]) is collections.OrderedDict
    assert out["od"]["w"].is_meta and out["od"]["w"].shape == (2, 3)
    assert out["list"][0] is out["list"][1]["again"] and out["list"][0].is_meta  # one tensor stays one
    assert type(out["tuple"]) is tuple and out["tuple"][0].is_meta and out["tuple"][1:] == (5, "s")
    assert type(out["param"]) is torch.nn.Parameter and out["param"].is_meta and out["param"].requires_grad
    assert out["grad"].requires_grad and out["grad"].is_leaf
    assert out["arr"] is not arr and np.array_equal(out["arr"], arr)
    assert out["size"] == torch.Size([2, 3])


def test_decode_onto_meta_moves_every_tensor() -> None:
    state: dict[str, Any] = {
        "w": torch.randn(64, 32),
        "b": torch.randn(32).to(torch.bfloat16),
        "t": torch.arange(12).reshape(3, 4).t(),
        "n": 3,
    }
    buf = serialization.encode(state)
    out: Any = device_restore.decode_onto(buf, torch.device("meta"), zero_copy=False)
    for key in ("w", "b", "t"):
        assert out[key].is_meta and out[key].shape == state[key].shape and out[key].dtype == state[key].dtype
    assert out["n"] == 3


def test_the_bounce_ring_is_prepared_before_any_restore(fake_cuda: FakeCudaRuntime) -> None:
    ring = device_restore.BounceRing(buffers=2, chunk=1 << 20)
    assert not ring.prepared
    ring.prepare()
    assert ring.prepared and ring.registered == 2  # both buffers made and registered, before any restore
    ring.close()
