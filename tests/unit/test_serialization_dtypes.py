"""Tensors of every dtype, layout and flag through the shard format, bit-exact (trainer_client.serialization.dtypes)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from tests.harness.shards import (
    SMALL,
    UINT4,
    assert_same,
    decode,
    random_tensor,
    roundtrip,
)
from trainer_client.serialization import (
    dtypes,
    encode,
    peek_header,
    plan,
)

pytestmark = pytest.mark.unit


ALL_DTYPES = sorted(dtypes.TENSOR_DTYPES.values(), key=str)


def test_every_interesting_dtype_is_covered() -> None:
    names = set(dtypes.TENSOR_DTYPES)
    for name in (
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "complex64",
        "complex128",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
        "float8_e4m3fn",
        "float8_e5m2",
    ):
        assert name in names
    assert "qint8" not in names


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_round_trips_bit_exact(dtype: torch.dtype) -> None:
    small = random_tensor(dtype, (3, 5), seed=1)
    big = random_tensor(dtype, (SMALL // dtype.itemsize + 7,), seed=2)  # torch-copy path
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 "experimental" warning
        out = roundtrip({"small": small, "big": big, "scalar": small[1, 2], "dtype": dtype})
    assert out["dtype"] is dtype


def test_nan_payloads_and_signed_zero_survive() -> None:
    patterns = [0x7FC00001, 0xFFC12345, 0x7F800001, 0x80000000, 0x00000001]
    f32 = torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)
    f64 = torch.tensor([0x7FF0000000000001, 0x7FF8DEADBEEF0000], dtype=torch.int64).view(torch.float64)
    out = roundtrip({"f32": f32, "f64": f64})
    assert out["f32"].view(torch.int32).tolist() == f32.view(torch.int32).tolist()


@pytest.mark.parametrize("size", [6, 400], ids=["small", "large"])
def test_non_contiguous_tensors(size: int) -> None:
    base = torch.randn(size, size + 1)
    cplx = torch.randn(size, 3, dtype=torch.complex64)
    state = {
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "narrowed": base[1:, 2:],
        "expanded": torch.randn(size, 1).expand(size, 5),
        "conj": cplx.conj(),
        "conj_t": cplx.t().conj(),
        "neg": torch._neg_view(base),
        "channels_last": torch.randn(2, 3, size // 2 + 1, 4).to(memory_format=torch.channels_last),
    }
    out = roundtrip(state)
    for key, value in state.items():
        assert out[key].is_contiguous()
        assert not out[key].is_conj() and not out[key].is_neg()
        assert torch.equal(out[key], value.resolve_conj().resolve_neg()), key


@pytest.mark.parametrize("size", [8, 300], ids=["small", "large"])
def test_non_contiguous_tensor_of_dtype_without_copy_kernel(size: int) -> None:
    raw = torch.randint(0, 256, (size, size), dtype=torch.uint8)
    view = raw.view(UINT4).t()  # copy_ has no uint4 kernel: uses the raw-byte path
    out = decode(encode({"u4": view}))["u4"]
    assert out.dtype == UINT4 and out.shape == view.shape and out.is_contiguous()
    assert torch.equal(out.view(torch.uint8), raw.t().contiguous())


def test_zero_size_and_zero_dim_tensors() -> None:
    roundtrip(
        {
            "empty": torch.empty(0),
            "empty2": torch.empty(3, 0, dtype=torch.int64),
            "empty_bf16": torch.empty(0, 4, dtype=torch.bfloat16),
            "scalar": torch.tensor(2.5),
            "int_scalar": torch.tensor(-7, dtype=torch.int64),
            "bool_scalar": torch.tensor(True),
            "grad_scalar": torch.tensor(1.0, requires_grad=True),
            "size": torch.Size([]),
        }
    )


def test_parameters_and_requires_grad() -> None:
    x = torch.randn(3, requires_grad=True)
    state = {
        "param": torch.nn.Parameter(torch.randn(2, 3)),
        "frozen": torch.nn.Parameter(torch.randn(2), requires_grad=False),
        "int_param": torch.nn.Parameter(torch.arange(3), requires_grad=False),
        "leaf": x,
        "non_leaf": x * 2,
        "plain": torch.randn(2),
    }
    out = decode(encode(state))
    assert type(out["param"]) is torch.nn.Parameter and out["param"].requires_grad
    assert type(out["frozen"]) is torch.nn.Parameter and not out["frozen"].requires_grad
    assert type(out["int_param"]) is torch.nn.Parameter
    assert type(out["leaf"]) is torch.Tensor and out["leaf"].requires_grad and out["leaf"].is_leaf
    assert out["non_leaf"].requires_grad and out["non_leaf"].is_leaf
    assert not out["plain"].requires_grad
    assert torch.equal(out["non_leaf"].detach(), (x * 2).detach())


def test_same_tensor_twice_is_stored_once_and_restored_as_one_object() -> None:
    t = torch.randn(5)
    shared = [1, 2]
    state = {"a": t, "b": t, "l1": shared, "l2": shared}
    assert plan(state).num_tensors == 1
    out = decode(encode(state))
    assert out["a"] is out["b"]
    assert out["l1"] == out["l2"] and out["l1"] is not out["l2"]


def test_decoded_data_does_not_alias_the_buffer() -> None:
    state = {
        "small": torch.arange(10.0),
        "large": torch.randn(SMALL),
        "arr": np.arange(100, dtype=np.float64),
        "raw": b"hello",
        "ba": bytearray(b"world"),
    }
    buf = encode(state)
    out = decode(buf)
    header = peek_header(buf)
    buf[header["data_offset"] :] = b"\xff" * (len(buf) - header["data_offset"])
    assert_same(state, out)
    out["small"].add_(1)  # and they are writable, owned storage
    out["arr"][0] = 5
    assert out["arr"].flags.writeable and out["arr"].flags.owndata
