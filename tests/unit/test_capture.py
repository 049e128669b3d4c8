"""trainer_client._capture without a GPU: the host part of a write, the registration cache (with a stand-in for
torch's cudart bindings), the capture sequence, map_location parsing and the device walk of a decoded state."""

from __future__ import annotations

import collections
import mmap
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from trainer_client import _capture, serialization
from trainer_client.errors import CapacityExceededError, InvalidArgumentError, SerializationError, StoreUnavailableError

pytestmark = pytest.mark.unit


class FakeCudart:
    """Stands in for ``torch.cuda.cudart()``: records calls, answers ``codes`` (addr -> error) or success."""

    def __init__(self) -> None:
        self.registered: dict[int, tuple[int, int]] = {}  # addr -> (size, flags), while registered
        self.calls: list[tuple[Any, ...]] = []
        self.fail: dict[int, int] = {}  # addr -> CUDA error code cudaHostRegister returns for it

    def cudaHostRegister(self, addr: int, size: int, flags: int) -> int:
        self.calls.append(("register", addr, size, flags))
        if addr in self.fail:
            return self.fail[addr]
        assert addr not in self.registered, "registered twice"
        self.registered[addr] = (size, flags)
        return 0

    def cudaHostUnregister(self, addr: int) -> int:
        self.calls.append(("unregister", addr))
        return 0 if self.registered.pop(addr, None) is not None else 1


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(_capture, "_cudart", lambda: fake)
    cleared: list[bool] = []
    monkeypatch.setattr(_capture, "_clear_cuda_error", lambda: cleared.append(True))
    fake.cleared = cleared  # type: ignore[attr-defined]
    return fake


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
    _capture.host_writer(layout, [index], buf)()
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


def test_a_mapping_is_registered_once_at_its_exact_size(tmp_path: Path, cudart: FakeCudart) -> None:
    seg = tmp_path / "seg"
    seg.write_bytes(b"\0" * (3 * mmap.PAGESIZE + 123))  # no power of two
    with open(seg, "r+b") as fh:
        mm = mmap.mmap(fh.fileno(), 0)
    copier = _capture.DeviceCopier()
    addr = _capture.address_of(mm)
    assert copier.pin_mapping(mm, str(seg)) and copier.pin_mapping(mm, str(seg))
    assert cudart.calls == [("register", addr, len(mm), _capture.HOST_REGISTER_PORTABLE)]
    assert copier.pins.registered == 1

    # The store truncated and regrew the file: the pinned pages are no longer the file's, so it is pinned afresh.
    with open(seg, "r+b") as fh:
        fh.truncate(mmap.PAGESIZE)
        fh.truncate(len(mm))
    assert copier.pin_mapping(mm, str(seg))
    assert cudart.calls[1:] == [("unregister", addr), ("register", addr, len(mm), _capture.HOST_REGISTER_PORTABLE)]

    copier.pins.release(mm)
    copier.pins.release(mm)  # once only
    assert cudart.registered == {} and cudart.calls[-1] == ("unregister", addr)
    mm.close()


def test_a_failed_registration_is_remembered_cleared_and_never_unregistered(cudart: FakeCudart) -> None:
    pins = _capture.HostRegistrations()
    owner = object()
    cudart.fail[4096] = 712  # cudaErrorHostMemoryAlreadyRegistered
    assert not pins.pin(owner, 4096, 8192)
    assert not pins.pin(owner, 4096, 8192)  # not retried every save
    assert [c[0] for c in cudart.calls] == ["register"] and cudart.cleared == [True]  # type: ignore[attr-defined]
    pins.release_all()
    assert [c[0] for c in cudart.calls] == ["register"]
    assert len(pins) == 0


def test_staging_buffers_are_pinned_only_when_large_and_page_aligned(cudart: FakeCudart) -> None:
    from trainer_client._remote import empty_buffer

    copier = _capture.DeviceCopier()
    small = torch.empty(1000, dtype=torch.uint8)
    assert not copier.pin_buffer(small)
    big = empty_buffer(4 << 20)  # an anonymous mapping: page-aligned
    assert copier.pin_buffer(big)
    assert cudart.registered == {big.data_ptr(): (4 << 20, _capture.HOST_REGISTER_PORTABLE)}
    captures = _capture.Captures()
    captures._copier = copier
    captures.unpin(small, big)
    assert cudart.registered == {}


# -- one capture ----------------------------------------------------------------------------


class FakeCopies(_capture.DeviceCopies):
    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def synchronize(self) -> None:
        self.log.append("synchronize")

    def gate(self) -> None:
        self.log.append("gate")


def test_capture_order_and_abort_only_after_the_copies_stopped() -> None:
    log: list[str] = []

    def fail() -> None:
        log.append("write")
        raise OSError("boom")

    job = _capture.Capture(FakeCopies(log), fail, lambda: log.append("finish"), lambda: log.append("abort"))  # type: ignore[func-returns-value]
    with pytest.raises(OSError, match="boom"):
        job.run()
    assert log == ["write", "synchronize", "abort"]  # the destination goes back only once nothing writes into it

    log.clear()
    ok = _capture.Capture(FakeCopies(log), lambda: log.append("write"), lambda: log.append("finish"), lambda: log.append("abort"))  # type: ignore[func-returns-value]
    ok.on_success = lambda: log.append("saved")
    ok.run()
    assert log == ["write", "synchronize", "finish", "saved"]


def test_enqueued_capture_wait_captured_and_errors() -> None:
    log: list[str] = []
    committing = threading.Event()
    release = threading.Event()

    def commit() -> None:
        committing.set()
        assert release.wait(10)
        raise StoreUnavailableError("commit step 1: store gone")

    job = _capture.Capture(FakeCopies(log), lambda: log.append("write"), commit, lambda: log.append("abort"))
    with ThreadPoolExecutor(1) as pool:
        job.start(pool)
        assert committing.wait(10)
        job.wait_captured(None, block=False)  # the host part is done: the device copies gate the streams
        assert log == ["write", "synchronize", "gate"] and not job.done()
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


def test_a_full_store_in_the_background_becomes_a_skipped_save_when_asked() -> None:
    def full() -> None:
        raise CapacityExceededError("put step 1: no room", needed=10, used=5, capacity=12)

    job = _capture.Capture(None, lambda: None, full, lambda: None)
    with pytest.raises(CapacityExceededError):
        job.run()
    skipping = _capture.Capture(None, lambda: None, full, lambda: None)
    skipping.skip_capacity = True
    skipping.run()
    assert "no room" in skipping.skipped_reason


# -- restore onto a device ------------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, "cpu", "cpu:0", torch.device("cpu")])
def test_map_location_cpu_is_the_default_path(value: Any) -> None:
    assert _capture.parse_map_location(value) is None


def test_map_location_meta() -> None:
    assert _capture.parse_map_location("meta") == torch.device("meta")
    assert _capture.parse_map_location(torch.device("meta")) == torch.device("meta")


@pytest.mark.parametrize(
    ("value", "named"),
    [("bogus", "'bogus'"), ("cuda:abc", "'cuda:abc'"), (3, "3 (int)"), (["cuda"], "['cuda'] (list)"), ("xpu", "'xpu'")],
)
def test_bad_map_location_is_named(value: Any, named: str) -> None:
    with pytest.raises(InvalidArgumentError, match="map_location") as err:
        _capture.parse_map_location(value)
    assert named in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_map_location_cuda_without_cuda() -> None:
    with pytest.raises(InvalidArgumentError, match="'cuda:0': CUDA is not available"):
        _capture.parse_map_location("cuda:0")


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
    out = _capture.move_tree(tree, lambda t: t.to("meta"), copy_arrays=True)
    assert out["od"] is od and type(out["od"]) is collections.OrderedDict and out["od"]._metadata == {"": {"version": 1}}
    assert out["od"]["w"].is_meta and out["od"]["w"].shape == (2, 3)
    assert out["list"][0] is out["list"][1]["again"] and out["list"][0].is_meta  # one tensor stays one
    assert type(out["tuple"]) is tuple and out["tuple"][0].is_meta and out["tuple"][1:] == (5, "s")
    assert type(out["param"]) is torch.nn.Parameter and out["param"].is_meta and out["param"].requires_grad
    assert out["grad"].requires_grad and out["grad"].is_leaf
    assert out["arr"] is not arr and np.array_equal(out["arr"], arr)
    assert out["size"] == torch.Size([2, 3])


def test_decode_onto_meta_moves_every_tensor() -> None:
    state = {"w": torch.randn(64, 32), "b": torch.randn(32).to(torch.bfloat16), "t": torch.arange(12).reshape(3, 4).t(), "n": 3}
    buf = serialization.encode(state)
    out: Any = _capture.decode_onto(buf, torch.device("meta"), zero_copy=False)
    for key in ("w", "b", "t"):
        assert out[key].is_meta and out[key].shape == state[key].shape and out[key].dtype == state[key].dtype
    assert out["n"] == 3
