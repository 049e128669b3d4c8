"""Many small tensors: the batched paths of plan / write_into / decode stay exact and strict.

plan() reads the metadata of all tensors at once with C-level maps and describes alike
tensors once; write_into() re-checks and memmoves the small CPU tensors all at once;
decode() validates the compact blob table and makes the small tensors with mapped
empty_like + memmove. These tests interleave every kind of value that those fast paths
must either handle or hand on to the general path, and compare bytes bit-exactly.
No timing is asserted (benchmarks/per_tensor.py measures).
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from tests.harness.shards import SMALL, UINT4, assert_same, full_form, random_tensor, raw_header
from trainer_client import serialization as ser
from trainer_client.errors import CorruptShardError, SerializationError

pytestmark = pytest.mark.unit


def decode(buf: Any, zero_copy: bool = False) -> Any:
    """``serialization.decode`` typed ``-> Any`` so tests can index the result."""
    return ser.decode(buf, zero_copy=zero_copy)


def _makers(seed: int) -> list[Callable[[int], Any]]:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(40, 41, generator=gen)
    cplx = torch.randn(8, 3, dtype=torch.complex64, generator=gen)
    shared = torch.randn(5, generator=gen)
    return [
        lambda i: torch.randn(1024, generator=gen),
        lambda i: torch.randn(1024, generator=gen),
        lambda i: random_tensor(torch.bfloat16, (7,), i),
        lambda i: random_tensor(torch.float16, (3, 5), i),
        lambda i: torch.tensor(float(i)),  # 0-d, 4 bytes: its slot has 60 bytes of padding
        lambda i: random_tensor(torch.int64, (), i),
        lambda i: random_tensor(torch.bool, (13,), i),
        lambda i: random_tensor(torch.uint8, (65,), i),
        lambda i: random_tensor(torch.complex64, (4,), i),
        lambda i: random_tensor(torch.float8_e4m3fn, (9,), i),
        lambda i: random_tensor(torch.float64, (2, 2, 2), i),  # NaN payloads, subnormals
        lambda i: random_tensor(torch.uint8, (6,), i).view(UINT4),  # copy_ has no kernel for it
        lambda i: base[i % 40 :: 7, 1::3],  # strided view
        lambda i: base.t()[:3],  # transposed view
        lambda i: torch._neg_view(torch.randn(6, generator=gen)),  # neg bit: bytes are not the values
        lambda i: cplx[i % 8].conj(),  # conj bit
        lambda i: torch.empty(0),
        lambda i: torch.empty(3, 0, dtype=torch.int32),
        lambda i: torch.randn(SMALL // 4 + 1 + i % 3, generator=gen),  # large: parallel memmove
        lambda i: torch.randn(300, 200, generator=gen).t(),  # large and strided: copy_
        lambda i: torch.nn.Parameter(torch.randn(4, generator=gen)),
        lambda i: torch.nn.Parameter(torch.arange(3), requires_grad=False),
        lambda i: torch.randn(3, generator=gen, requires_grad=True),
        lambda i: shared,  # the same object again: one blob
        lambda i: np.arange(i % 5 + 1, dtype=np.float32),
        lambda i: bytes([i % 256]) * (i % 70 + 1),  # (b"" is one object in CPython: it would be one blob)
        lambda i: bytearray(b"x" * (i % 3)),
        lambda i: i,
        lambda i: float(i) / 3,
        lambda i: [torch.ones(2), (torch.zeros(()), None)],
        lambda i: {"exp_avg": torch.randn(8, generator=gen), "exp_avg_sq": torch.randn(8, generator=gen), "step": torch.tensor(3.0)},
    ]


def _mixed_state(seed: int, count: int = 600) -> dict[str, Any]:
    rng = random.Random(seed)
    makers = _makers(seed)
    return {f"k{i}": rng.choice(makers)(i) for i in range(count)}


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else ()
    return [t for item in items for t in _tensors(item)]


def _check_round_trip(state: Any) -> bytearray:
    """Every way of writing and reading ``state`` gives it back bit-exactly; returns its shard."""
    layout = ser.plan(state)
    expected = ser.encode(state)
    for garbage in (0xAB, 0x00, 0xFF):  # a reused buffer: every padding byte is written too
        dirty = bytearray([garbage]) * (layout.nbytes + 100)
        layout.write_into(dirty)
        assert dirty[: layout.nbytes] == expected
    assert_same(state, decode(bytes(expected)))
    assert_same(state, decode(bytearray(expected), zero_copy=True))
    assert_same(state, decode(full_form(expected, version=1)))  # as version 1 would store it
    assert ser.encode(decode(expected)) == expected  # canonical
    return expected


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_many_mixed_values_round_trip_bit_exact(seed: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float8 / uint4 creation warnings on some torch builds
        state = _mixed_state(seed)
        _check_round_trip(state)


def test_restored_small_tensors_own_their_memory() -> None:
    state = _mixed_state(3)
    buf = ser.encode(state)
    for zero_copy in (False, True):
        source = bytearray(buf)
        lo = torch.frombuffer(source, dtype=torch.uint8).data_ptr()
        out = decode(source, zero_copy=zero_copy)
        storages = set()
        for t in {id(t): t for t in _tensors(out)}.values():  # (a tensor stored twice comes back as one)
            own = t.numel() * t.element_size()
            if own <= SMALL or not zero_copy:
                assert t.untyped_storage().nbytes() == own  # a copy of exactly its bytes
                assert t.data_ptr() not in storages or own == 0
                storages.add(t.data_ptr())
            else:
                assert lo <= t.data_ptr() and t.data_ptr() + own <= lo + len(source)  # a view of the buffer
                assert t.untyped_storage().nbytes() == own  # holding only its bytes: saving it saves only those
        first = out["k0"] if isinstance(out["k0"], torch.Tensor) else None
        if first is not None and first.numel():
            first.view(-1)[0:1].zero_()  # writable


@pytest.mark.parametrize("count", [1, 2, 1000])
def test_benchmark_shapes_round_trip(count: int) -> None:
    flat = {f"p{i}": torch.randn(1024) for i in range(count)}
    optim = {
        "state": {i: {"exp_avg": torch.randn(1024), "exp_avg_sq": torch.randn(1024), "step": torch.tensor(float(i))} for i in range(count)},
        "param_groups": [{"lr": 1e-3, "params": list(range(count))}],
    }
    buf = _check_round_trip(flat)
    assert len(raw_header(buf)["kinds"]) == 1  # alike tensors: one record
    buf = _check_round_trip(optim)
    assert len(raw_header(buf)["kinds"]) == 2 if count else 0
    assert raw_header(buf)["blobs"] == [0, 0, 1] * count


def test_same_tensor_many_times_is_one_blob_and_one_object() -> None:
    t = torch.randn(3)
    state = {"list": [t] * 500, "again": t, "other": [torch.randn(3) for _ in range(500)]}
    assert ser.plan(state).num_tensors == 501
    out = decode(ser.encode(state))
    assert all(x is out["again"] for x in out["list"])
    assert len({id(x) for x in out["other"]}) == 500


def test_a_tensor_changed_between_plan_and_write_is_named() -> None:
    state = {f"p{i}": torch.zeros(4) for i in range(500)}
    layout = ser.plan(state)
    state["p321"].resize_(5)
    with pytest.raises(SerializationError, match="between plan") as info:
        layout.write_into(bytearray(layout.nbytes))
    assert info.value.path == "blob #321"

    state = {f"p{i}": torch.zeros(4) for i in range(500)}
    layout = ser.plan(state)
    state["p100"].data = state["p100"].data.double()
    with pytest.raises(SerializationError, match="between plan") as info:
        layout.write_into(bytearray(layout.nbytes))
    assert info.value.path == "blob #100"


def test_a_tensor_made_strided_between_plan_and_write_is_still_copied_right() -> None:
    state = {f"p{i}": torch.randn(4, 4) for i in range(300)}
    layout = ser.plan(state)
    state["p7"].t_()  # same shape, no longer contiguous: its bytes are not its values in order
    buf = bytearray(layout.nbytes)
    layout.write_into(buf)
    assert buf == ser.encode(state)
    assert_same(state, decode(buf))


class Custom:
    pass


def _bad_tensors() -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized / nested tensors warn on creation
        return {
            "quantized": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8),
            "sparse": torch.zeros(2).to_sparse(),
            "meta": torch.empty(2, device="meta"),
            "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        }


@pytest.mark.parametrize("kind", ["quantized", "sparse", "meta", "nested"])
def test_the_first_value_that_cannot_be_stored_is_named(kind: str) -> None:
    bad = _bad_tensors()[kind]
    good = {f"g{i}": torch.ones(2) for i in range(300)}
    later = {f"h{i}": torch.ones(2) for i in range(50)}
    # the bad tensor comes first in walk order: its error, though tensors are checked after the walk
    for state in ({**good, "bad": bad, "more": later, "custom": Custom()}, {**good, "x": {"y": [bad]}, "deep": [[[Custom()]]]}):
        with pytest.raises(SerializationError) as info:
            ser.plan(state)
        assert kind in str(info.value)
        assert info.value.path in ("state['bad']", "state['x']['y'][0]")
    # the other value comes first: its error
    with pytest.raises(SerializationError, match="Custom") as info:
        ser.plan({**good, "custom": Custom(), "bad": bad})
    assert info.value.path == "state['custom']"
    loop: list[Any] = [torch.ones(1)]
    loop.append(loop)
    with pytest.raises(SerializationError, match="cycle"):
        ser.plan({**good, "loop": loop, "bad": bad})


def test_header_fuzz_of_a_many_tensor_shard_only_raises_corrupt_shard() -> None:
    buf = bytes(ser.encode(_mixed_state(4, count=200)))
    data_offset = ser.peek_header(buf)["data_offset"]
    rng = random.Random(99)
    outcomes = {"ok": 0, "corrupt": 0}
    for _ in range(150):
        bad = bytearray(buf)
        for _ in range(rng.randint(1, 3)):
            bad[rng.randrange(data_offset)] ^= 1 << rng.randrange(8)
        try:
            decode(bad)
            outcomes["ok"] += 1
        except CorruptShardError:
            outcomes["corrupt"] += 1
    assert outcomes["corrupt"] > 50


def test_a_table_of_many_empty_blobs_is_bounded_by_the_header() -> None:
    """Zero-size blobs all share one slot; a header can declare many, each costs header bytes."""
    buf = ser.encode({"e": [torch.empty(0) for _ in range(2000)], "x": torch.ones(3)})
    header = raw_header(buf)
    assert header["blobs"] == [0] * 2000 + [1]
    out = decode(buf)
    assert len(out["e"]) == 2000 and all(t.shape == (0,) for t in out["e"])
    assert torch.equal(out["x"], torch.ones(3))
