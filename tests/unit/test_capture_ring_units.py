"""The pieces of trainer_client.capture.device_save that GPU saves and restores are built from, checked on the CPU: grouping of
small blobs into one copy (copy_runs, gather_run against the real shard encoding), the restore's bounce ring and the
routing of host->device copies (HostToDevice), and decode_onto through them (tests.harness.fake_cuda stands in
for cudaHostRegister)."""

from __future__ import annotations

import collections
import ctypes
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from tests.harness.fake_cuda import FakeCudaRuntime
from trainer_client import serialization
from trainer_client.capture import cuda, device_restore, device_save
from trainer_client.capture.device_restore import BounceRing, HostToDevice
from trainer_client.capture.device_save import CopyRun, copy_runs, gather_run, raw_bytes

pytestmark = pytest.mark.unit

ALIGN = 64
CPU = torch.device("cpu")


def staged(target: torch.Tensor) -> bool:
    return True  # CPU targets take the device path


@pytest.fixture
def ring(fake_cuda: FakeCudaRuntime, monkeypatch: pytest.MonkeyPatch) -> Iterator[BounceRing]:
    """A small bounce ring standing in for the process's (4 KiB chunks, 2 buffers), closed after the test."""
    small = BounceRing(buffers=2, chunk=4096)
    monkeypatch.setattr(device_restore, "_bounce", small)
    yield small
    small.close()
    assert fake_cuda.live == {}


def blobs(runs: list[CopyRun]) -> list[list[int]]:
    return [[index for index, _, _ in run.blobs] for run in runs]


# -- copy_runs --------------------------------------------------------------------------------


def test_adjacent_small_blobs_form_one_run() -> None:
    slots = [(0, 0, 10), (1, 64, 64), (2, 128, 1), (3, 192, 100)]  # each starts where the last ends, aligned up to 64
    (run,) = copy_runs(slots, small=1000)
    assert run.blobs == tuple(slots) and (run.start, run.end) == (0, 292)


def test_a_gap_breaks_the_run() -> None:
    slots = [(0, 0, 10), (1, 128, 10), (2, 192, 10)]  # 64..128 lies between blob 0 and blob 1: not adjacent
    assert blobs(copy_runs(slots, small=1000)) == [[0], [1, 2]]
    assert blobs(copy_runs([(0, 0, 65), (1, 64, 10)], small=1000)) == [[0], [1]]  # overlapping offsets are no neighbours
    assert blobs(copy_runs([(0, 0, 65), (1, 128, 10)], small=1000)) == [[0, 1]]  # 65 aligns up to 128


def test_a_large_blob_stands_alone_and_breaks_the_run() -> None:
    slots = [(0, 0, 10), (1, 64, 2000), (2, 2112, 10), (3, 2176, 10), (4, 2240, 1000), (5, 3264, 999)]
    # blob 1 is large; blob 4 is exactly `small` (not under it): both alone, and nothing joins them on either side
    assert blobs(copy_runs(slots, small=1000)) == [[0], [1], [2, 3], [4], [5]]
    runs = copy_runs(slots, small=1000)
    assert [(r.start, r.end) for r in runs] == [(0, 10), (64, 2064), (2112, 2186), (2240, 3240), (3264, 4263)]


def test_runs_are_ordered_by_offset_whatever_the_input_order() -> None:
    slots = [(7, 192, 5), (3, 0, 10), (9, 1024, 3), (1, 64, 20), (4, 128, 30)]
    runs = copy_runs(slots, small=100)
    assert blobs(runs) == [[3, 1, 4, 7], [9]]
    assert runs[0].blobs == ((3, 0, 10), (1, 64, 20), (4, 128, 30), (7, 192, 5))
    assert copy_runs([], small=100) == []


def test_the_default_threshold_is_small_copy_bytes() -> None:
    n = device_save.SMALL_COPY_BYTES
    assert blobs(copy_runs([(0, 0, n - 64), (1, n - 64, 64)])) == [[0, 1]]
    assert blobs(copy_runs([(0, 0, n), (1, n, 64)])) == [[0], [1]]


# -- gather_run against the shard encoding ------------------------------------------------------


def _mixed_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    state: dict[str, Any] = {
        "f32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(17, generator=g).to(torch.bfloat16),
        "f16": torch.randn(2, 3, generator=g).half(),
        "mask": torch.rand(13, generator=g) > 0.5,
        "i64": torch.arange(-5, 6, dtype=torch.int64),
        "i8": torch.arange(-3, 4, dtype=torch.int8),
        "u8": torch.arange(200, 211, dtype=torch.uint8),
        "step": torch.tensor(12345, dtype=torch.int64),  # 0-dim
        "lr": torch.tensor(3e-4),  # 0-dim
        "flag": torch.tensor(True),  # 0-dim bool
        "c64": torch.randn(3, dtype=torch.complex64, generator=g),
        "t": torch.arange(24, dtype=torch.float64).reshape(4, 6).t(),  # non-contiguous
        "big": torch.randn(600, generator=g),  # 2400 bytes: over the test's threshold
        "layers": [{"w": torch.randn(i + 1, 3, generator=g), "b": torch.full((i + 2,), i, dtype=torch.int32)} for i in range(6)],
    }
    return state


def test_gather_run_packs_exactly_the_bytes_encode_writes() -> None:
    state = _mixed_state()
    layout = serialization.plan(state)
    encoded = bytes(serialization.encode(state))
    slots = [(i, offset, nbytes) for i in range(layout.num_tensors) for _, offset, nbytes in [layout.slot(i)]]
    runs = copy_runs(slots, small=1024)
    assert max(len(run.blobs) for run in runs) >= 8  # most small tensors were merged
    assert any(len(run.blobs) == 1 and run.end - run.start >= 1024 for run in runs)  # "big" stands alone
    assert sum(len(run.blobs) for run in runs) == layout.num_tensors
    for run in runs:
        sources = [raw_bytes(layout.slot(index)[0]) for index, _, _ in run.blobs]
        packed = gather_run(run, sources)
        assert packed.dtype == torch.uint8 and packed.device == CPU and packed.numel() == run.end - run.start
        assert bytes(packed.numpy()) == encoded[run.start : run.end], [i for i, _, _ in run.blobs]
    # ... so the runs, copied into their ranges of a dirty buffer, rebuild every data byte of the shard
    buf = bytearray(b"\xee" * layout.nbytes)
    layout.write_into(buf, skip=frozenset(range(layout.num_tensors)))  # header and padding, no tensor data
    for run in runs:
        sources = [raw_bytes(layout.slot(index)[0]) for index, _, _ in run.blobs]
        buf[run.start : run.end] = bytes(gather_run(run, sources).numpy())
    assert bytes(buf) == encoded


def test_raw_bytes_resolves_neg_and_conj_views() -> None:
    x = torch.randn(4, dtype=torch.complex64)
    for view in (x.conj(), torch.randn(5)._neg_view()):
        assert view.is_conj() or view.is_neg()
        assert bytes(raw_bytes(view).numpy()) == view.resolve_conj().resolve_neg().numpy().tobytes()


# -- the bounce ring -----------------------------------------------------------------------------


def test_bounce_ring_copies_chunk_by_chunk_bit_exactly(fake_cuda: FakeCudaRuntime) -> None:
    bounce = BounceRing(buffers=2, chunk=4096)
    g = torch.Generator().manual_seed(3)
    sizes = [5 * 4096 + 17, 4096, 3, 2 * 4096]  # several chunks, a partial last one, exactly one, one tiny
    for n in sizes:
        source = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        target = torch.zeros(n, dtype=torch.uint8)
        bounce.copy(target, source)
        bounce.drain()
        assert torch.equal(target, source), n
    assert fake_cuda.registrations == 2 == bounce.registered  # each buffer once, not per chunk or per copy
    assert len(fake_cuda.live) == 2 and all(size == 4096 for size, _ in fake_cuda.live.values())
    assert all(flags == cuda.HOST_REGISTER_PORTABLE for _, flags in fake_cuda.live.values())
    bounce.close()
    assert fake_cuda.live == {} and fake_cuda.failures == [] and fake_cuda.last_error == 0


def test_bounce_ring_whose_registration_fails_still_copies(fake_cuda: FakeCudaRuntime) -> None:
    fake_cuda.fail_next = [cuda.ERROR_INVALID_VALUE]
    bounce = BounceRing(buffers=2, chunk=4096)
    source = torch.randint(0, 256, (3 * 4096,), dtype=torch.uint8)
    target = torch.zeros_like(source)
    bounce.copy(target, source)
    assert torch.equal(target, source) and bounce.registered == 1 and fake_cuda.last_error == 0
    bounce.close()
    assert fake_cuda.live == {}


# -- HostToDevice routing ------------------------------------------------------------------------


def _ptr_range(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def test_host_to_device_routes_registered_large_small_and_strided_sources(ring: BounceRing, fake_cuda: FakeCudaRuntime) -> None:
    g = torch.Generator().manual_seed(11)
    pinned = torch.randn(1 << 16, generator=g)  # 256 KiB: small, but in registered memory
    large = torch.randn(1 << 20, generator=g)  # 4 MiB, contiguous, not registered
    large_bf16 = torch.randn(3 << 19, generator=g).to(torch.bfloat16)  # 3 MiB
    small = torch.randn(1000, generator=g)
    strided = torch.randn(1024, 1024, generator=g).t()  # 4 MiB but not contiguous
    lo, hi = _ptr_range(pinned)
    asked: list[tuple[int, int]] = []

    def registered(addr: int, nbytes: int) -> bool:
        asked.append((addr, nbytes))
        return lo <= addr and addr + nbytes <= hi

    copies = HostToDevice(registered=registered, staged=staged)
    out = [copies.to(t, CPU) for t in (pinned, large, large_bf16, small, strided)]
    assert copies.direct == 1 and copies.bounced == 2
    assert (pinned.data_ptr(), pinned.numel() * 4) in asked
    assert ring.lock.locked()  # held by this restore until finish()
    copies.finish()
    assert not ring.lock.locked()
    for src, dst in zip((pinned, large, large_bf16, small, strided), out, strict=True):
        assert dst is not src and dst.data_ptr() != src.data_ptr()
        assert dst.dtype == src.dtype and dst.shape == src.shape
        assert bytes(raw_bytes(dst).numpy()) == bytes(raw_bytes(src).numpy())
    assert ring.registered == 2 and fake_cuda.registrations == 2  # the ring's buffers only: no source is registered per restore


def test_host_to_device_copy_into_a_strided_target_and_a_dtype_change(ring: BounceRing) -> None:
    copies = HostToDevice(staged=staged)
    source = torch.randn(1024, 1024)  # 4 MiB contiguous source
    target = torch.empty(1024, 1024).t()  # a transposed target
    copies.copy_into(target, source)
    as_half = torch.empty(1024, 1024, dtype=torch.float16)
    copies.copy_into(as_half, source)  # another dtype: converted by torch, never bounced as bytes
    copies.finish()
    assert copies.bounced == 0 and copies.direct == 0
    assert torch.equal(target, source) and torch.equal(as_half, source.half())


def test_host_to_device_leaves_unstaged_cpu_targets_to_torch() -> None:
    source = torch.randn(1 << 20)
    copies = HostToDevice()  # the default: only CUDA targets take the device path
    out = copies.to(source, CPU)
    copies.finish()
    assert torch.equal(out, source) and copies.bounced == 0 and copies.direct == 0


# -- decode_onto -----------------------------------------------------------------------------------


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    shared = torch.randn(10, generator=g)
    od: collections.OrderedDict[str, Any] = collections.OrderedDict(
        weight=torch.nn.Parameter(torch.randn(64, 32, generator=g)),
        frozen=torch.nn.Parameter(torch.randn(3, generator=g), requires_grad=False),
    )
    od._metadata = {"": {"version": 2}}  # type: ignore[attr-defined]
    return {
        "model": od,
        "big": torch.randn(1 << 20, generator=g),  # 4 MiB: through the bounce ring
        "bf16": torch.randn(3 << 19, generator=g).to(torch.bfloat16),  # 3 MiB, bounced as bytes
        "mask": torch.rand(100, generator=g) > 0.5,
        "i64": torch.arange(10, dtype=torch.int64),
        "step": torch.tensor(7),
        "t": torch.arange(12.0).reshape(3, 4).t(),
        "shared": [shared, shared],
        "arr": np.arange(20, dtype=np.float32).reshape(4, 5),
        "meta": {"epoch": 3, "name": "run", "tuple": (1, torch.ones(2))},
        "raw": b"xyz",
    }


def _assert_equal(out: Any, ref: Any, path: str = "state") -> None:
    assert type(out) is type(ref), path
    if isinstance(ref, torch.Tensor):
        assert out.dtype == ref.dtype and out.shape == ref.shape and torch.equal(out, ref), path
        assert out.requires_grad == ref.requires_grad, path
    elif isinstance(ref, np.ndarray):
        assert out.dtype == ref.dtype and np.array_equal(out, ref), path
    elif isinstance(ref, dict):
        assert list(out) == list(ref), path
        for key in ref:
            _assert_equal(out[key], ref[key], f"{path}[{key!r}]")
    elif isinstance(ref, list | tuple):
        assert len(out) == len(ref), path
        for i, (a, b) in enumerate(zip(out, ref, strict=True)):
            _assert_equal(a, b, f"{path}[{i}]")
    else:
        assert out == ref, path


def _inside(buf: bytearray, ptr: int) -> bool:
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    return base <= ptr < base + len(buf)


def test_decode_onto_through_the_bounce_ring_equals_the_state(ring: BounceRing, fake_cuda: FakeCudaRuntime) -> None:
    state = _state()
    buf = serialization.encode(state)
    copies = HostToDevice(staged=staged)
    out: Any = device_restore.decode_onto(buf, CPU, zero_copy=False, copies=copies)
    assert copies.bounced == 2 and copies.direct == 0 and not ring.lock.locked()
    _assert_equal(out, state)
    assert out["model"]._metadata == {"": {"version": 2}}
    assert type(out["model"]["weight"]) is torch.nn.Parameter and out["model"]["weight"].requires_grad
    assert type(out["model"]["frozen"]) is torch.nn.Parameter and not out["model"]["frozen"].requires_grad
    assert out["shared"][0] is out["shared"][1]  # one tensor stays one
    # nothing refers to the shard's memory any more: tensors and arrays are copies
    tensors = [out["big"], out["bf16"], out["mask"], out["i64"], out["step"], out["t"], out["shared"][0], out["model"]["weight"]]
    assert not any(_inside(buf, t.data_ptr()) for t in tensors)
    assert not _inside(buf, out["arr"].ctypes.data)
    buf[:] = bytes(len(buf))
    _assert_equal(out, state)  # unchanged by the shard's bytes changing
    assert fake_cuda.registrations == 2  # the ring's two buffers, nothing per load


def test_decode_onto_out_of_registered_memory_copies_direct(ring: BounceRing, fake_cuda: FakeCudaRuntime) -> None:
    state = _state()
    buf = serialization.encode(state)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    copies = HostToDevice(registered=lambda addr, n: base <= addr and addr + n <= base + len(buf), staged=staged)
    out: Any = device_restore.decode_onto(buf, CPU, zero_copy=False, copies=copies)
    # the large tensors are views of the "ring segment": straight out of it (decode copies small ones out already)
    assert copies.bounced == 0 and copies.direct == 2
    assert fake_cuda.registrations == 0  # the bounce ring was never needed
    buf[:] = bytes(len(buf))
    _assert_equal(out, state)
