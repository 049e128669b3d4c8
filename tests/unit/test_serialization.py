"""Unit tests of trainer_client.serialization: round-trips, safety, corruption handling."""

from __future__ import annotations

import base64
import builtins
import collections
import copy
import functools
import json
import math
import mmap
import pickle
import random
import struct
import sys
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

from trainer_client import serialization as ser
from trainer_client.errors import CorruptShardError, InvalidArgumentError, SerializationError
from trainer_client.serialization import (
    FORMAT_VERSION,
    MAGIC,
    ShardLayout,
    dtypes,
    encode,
    peek_header,
    plan,
    spec,
)

pytestmark = pytest.mark.unit

SMALL = spec.SMALL_COPY  # blobs up to this size take the memmove path, larger ones torch copy_
UINT4: torch.dtype = getattr(torch, "uint4")  # noqa: B009 - missing from torch's type stubs


def decode(buf: Any) -> Any:
    """``serialization.decode`` typed ``-> Any`` so tests can index the result."""
    return ser.decode(buf)


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's logical contents as flat uint8 (bit-exact comparison incl. NaN payloads)."""
    t = t.detach().resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def assert_same(a: Any, b: Any, path: str = "state") -> None:
    """Deep equality that also demands identical Python types and bit-exact payloads."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} became {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert b.dtype == a.dtype, path
        assert b.shape == a.shape, path
        assert b.requires_grad == a.requires_grad, path
        assert b.device.type == "cpu" and b.is_contiguous(), path
        assert torch.equal(_bits(a), _bits(b)), path
    elif isinstance(a, np.ndarray):
        assert b.dtype == a.dtype and b.shape == a.shape, path
        assert a.tobytes() == b.tobytes(), path
        assert b.flags.owndata or (b.base is not None and b.base.flags.owndata), path
    elif isinstance(a, np.generic):
        assert b.dtype == a.dtype and a.tobytes() == b.tobytes(), path
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, dict):
        assert [type(k) for k in a] == [type(k) for k in b], path
        assert [repr(k) for k in a] == [repr(k) for k in b], path
        for (ka, va), vb in zip(a.items(), b.values(), strict=True):
            assert_same(va, vb, f"{path}[{ka!r}]")
        if hasattr(a, "_metadata"):
            assert_same(a._metadata, b._metadata, f"{path}._metadata")
        else:
            assert not hasattr(b, "_metadata"), path
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def roundtrip(state: Any) -> Any:
    out = decode(encode(state))
    assert_same(state, out)
    return out


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bytes viewed as ``dtype``: covers NaN payloads, subnormals, odd bit patterns."""
    gen = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def _relayout(header: dict[str, Any], data: bytes, version: int, slack: int = 128) -> bytearray:
    """A shard of blob area ``data`` under ``header``, laid out anew for the header's length.

    ``data_offset``, ``nbytes`` and (in the full form) every record's ``offset`` move with
    the data; the header JSON is padded with spaces (JSON allows trailing whitespace) to
    leave ``slack`` bytes of room for edits in place.
    """
    header = copy.deepcopy(header)
    while True:
        text = json.dumps(header, separators=(",", ":")).encode()
        data_offset = spec.align(20 + len(text) + slack)
        shift = data_offset - header["data_offset"]
        if not shift:
            break
        if "kinds" not in header:
            for record in header["blobs"]:
                record["offset"] += shift
        header["data_offset"] += shift
        header["nbytes"] += shift
    text = text.ljust(data_offset - 20)
    return bytearray(MAGIC + struct.pack("<IQ", version, len(text)) + text + data)


def _full_form(buf: bytes | bytearray, version: int = FORMAT_VERSION) -> bytearray:
    """``buf`` with the header peek_header gives (one full record per blob), as a ``version`` shard."""
    header = peek_header(buf)
    header["version"] = version
    return _relayout(header, bytes(buf[header["data_offset"] : header["nbytes"]]), version)


def _edit_header(shard: bytearray, header: dict[str, Any]) -> bytearray:
    """``shard`` (laid out with slack) with ``header`` written over its header, in place: the data area stays."""
    old_len = struct.unpack_from("<Q", shard, 12)[0]
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= old_len, "the edit needs more room than the slack"
    shard[20 : 20 + old_len] = text.ljust(old_len)
    return shard


def _with_header(buf: bytes | bytearray, mutate: Callable[[dict[str, Any]], None], version: int = FORMAT_VERSION) -> bytearray:
    """``buf`` in the full form (one record per blob; see _full_form) whose header went through ``mutate``."""
    out = _full_form(buf, version)
    header = peek_header(out)
    mutate(header)
    return _edit_header(out, header)


def _raw_header(buf: bytes | bytearray) -> dict[str, Any]:
    """The header JSON as stored (the compact blob table of version 2, not peek_header's full form)."""
    header_len = struct.unpack_from("<Q", buf, 12)[0]
    header: dict[str, Any] = json.loads(bytes(buf[20 : 20 + header_len]))
    return header


def _with_raw_header(buf: bytes | bytearray, mutate: Callable[[dict[str, Any]], None]) -> bytearray:
    """``buf`` whose stored (compact) header went through ``mutate``; data area kept."""
    header = _raw_header(buf)
    out = _relayout(header, bytes(buf[header["data_offset"] : header["nbytes"]]), FORMAT_VERSION)
    header = _raw_header(out)
    mutate(header)
    return _edit_header(out, header)


def _sample_state() -> dict[str, Any]:
    return {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": torch.ones(3, dtype=torch.bfloat16),
        "p": torch.nn.Parameter(torch.zeros(2)),
        "n": np.arange(4, dtype=np.int16),
        "raw": b"\x00\x01\x02",
        "meta": {"step": 7, "lr": 0.1, "names": ["a", "b"], 3: (1, 2.5)},
    }


# --------------------------------------------------------------------------------------
# layout
# --------------------------------------------------------------------------------------


def test_layout_matches_the_documented_format() -> None:
    state = {**_sample_state(), "w2": torch.ones(3, 4), "b2": torch.zeros(3, dtype=torch.bfloat16)}
    layout = plan(state)
    assert isinstance(layout, ShardLayout)
    assert layout.num_tensors == 7  # 5 tensors + 1 array + 1 bytes object
    buf = encode(state)
    assert len(buf) == layout.nbytes
    assert bytes(buf[:8]) == MAGIC
    assert struct.unpack_from("<I", buf, 8)[0] == FORMAT_VERSION == 2
    header_len = struct.unpack_from("<Q", buf, 12)[0]
    header = json.loads(bytes(buf[20 : 20 + header_len]))
    assert list(header) == ["version", "byteorder", "nbytes", "data_offset", "kinds", "blobs", "root"]
    assert header["version"] == 2
    assert header["data_offset"] == spec.align(20 + header_len) and header["data_offset"] % 64 == 0
    assert header["nbytes"] == layout.nbytes
    # alike tensors share one record of the compact table
    assert header["kinds"] == [
        {"kind": "tensor", "nbytes": 48, "dtype": "float32", "shape": [3, 4]},
        {"kind": "tensor", "nbytes": 6, "dtype": "bfloat16", "shape": [3]},
        {"kind": "tensor", "nbytes": 8, "dtype": "float32", "shape": [2], "requires_grad": True, "parameter": True},
        {"kind": "ndarray", "nbytes": 8, "dtype": "<i2", "shape": [4]},
        {"kind": "bytes", "nbytes": 3},
    ]
    assert header["blobs"] == [0, 1, 2, 3, 4, 0, 1]
    assert bytes(buf[20 + header_len : header["data_offset"]]) == bytes(header["data_offset"] - 20 - header_len)
    # peek_header: the same header with one full record per blob, at packed 64-byte aligned offsets
    full = peek_header(buf)
    assert "kinds" not in full and {k: v for k, v in header.items() if k not in ("kinds", "blobs")} == {
        k: v for k, v in full.items() if k != "blobs"
    }
    offsets = [blob["offset"] for blob in full["blobs"]]
    assert offsets[0] == header["data_offset"] and all(offset % 64 == 0 for offset in offsets)
    ends = [blob["offset"] + blob["nbytes"] for blob in full["blobs"]]
    assert offsets[1:] == [spec.align(end) for end in ends[:-1]] and ends[-1] == header["nbytes"]
    assert [{k: v for k, v in blob.items() if k != "offset"} for blob in full["blobs"]] == [header["kinds"][i] for i in header["blobs"]]
    assert list(full["blobs"][0]) == ["kind", "offset", "nbytes", "dtype", "shape"]
    # padding between blobs is zero
    for end, offset in zip(ends, offsets[1:], strict=False):
        assert bytes(buf[end:offset]) == bytes(offset - end)


def test_plan_copies_nothing_and_write_into_is_deterministic() -> None:
    state = _sample_state()
    layout = plan(state)
    state["w"].add_(1)  # values may change between plan and write; shapes may not
    dirty = bytearray(b"\xab" * (layout.nbytes + 100))
    layout.write_into(dirty)
    assert dirty[: layout.nbytes] == encode(state)
    assert torch.equal(decode(dirty)["w"], state["w"])


def test_shape_change_between_plan_and_write_is_refused() -> None:
    t = torch.zeros(4)
    layout = plan({"t": t})
    t.resize_(5)
    with pytest.raises(SerializationError, match="between plan"):
        layout.write_into(bytearray(layout.nbytes))


def test_write_into_rejects_small_or_read_only_buffers() -> None:
    layout = plan(_sample_state())
    with pytest.raises(InvalidArgumentError, match="needs"):
        layout.write_into(bytearray(layout.nbytes - 1))
    with pytest.raises(InvalidArgumentError, match="writable"):
        layout.write_into(bytes(layout.nbytes))


def test_write_into_mmap_and_decode_from_read_only_file_mmap(tmp_path: Path) -> None:
    state = {**_sample_state(), "big": torch.randn(300, 300).t()}
    layout = plan(state)
    with mmap.mmap(-1, layout.nbytes + 4096) as anon:
        layout.write_into(anon)
        assert_same(state, decode(anon))
        path = tmp_path / "shard.bin"
        path.write_bytes(anon[: layout.nbytes])
    with path.open("rb") as f:
        ro = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the read-only-buffer warning must not leak out
            out = decode(ro)
        ro.close()  # would raise BufferError if decode left an export of the mmap behind
    assert_same(state, out)


def test_memoryview_and_numpy_buffers_are_accepted() -> None:
    buf = encode(_sample_state())
    assert_same(_sample_state(), decode(memoryview(buf)))
    assert_same(_sample_state(), decode(np.frombuffer(bytes(buf), dtype=np.uint8)))
    padded = bytes(buf) + b"\xff" * 1000  # a shard inside a bigger slab
    assert_same(_sample_state(), decode(padded))


# --------------------------------------------------------------------------------------
# tensors
# --------------------------------------------------------------------------------------

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
    small = _random_tensor(dtype, (3, 5), seed=1)
    big = _random_tensor(dtype, (SMALL // dtype.itemsize + 7,), seed=2)  # torch-copy path
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


# --------------------------------------------------------------------------------------
# real training state
# --------------------------------------------------------------------------------------


@functools.cache
def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """One small model after one AdamW step, shared by tests that only read it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 4)).pow(2).sum().backward()
    opt.step()
    return model, opt


def test_adamw_state_dict_with_int_keys_round_trips_and_loads() -> None:
    _, opt = _trained()
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [0, 1, 2, 3, 4, 5]
    out = roundtrip(sd)
    assert list(out["state"]) == list(sd["state"])
    assert torch.equal(out["state"][3]["exp_avg"], sd["state"][3]["exp_avg"])
    model2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=5.0)
    opt2.load_state_dict(out)
    assert opt2.param_groups[0]["lr"] == 1e-3
    assert torch.equal(opt2.state[next(iter(model2.parameters()))]["exp_avg_sq"], sd["state"][0]["exp_avg_sq"])


def test_model_state_dict_keeps_ordered_dict_and_metadata() -> None:
    model, _ = _trained()
    sd = model.state_dict()
    assert isinstance(sd, collections.OrderedDict) and hasattr(sd, "_metadata")
    out = roundtrip(sd)
    assert type(out) is collections.OrderedDict
    assert out._metadata == sd._metadata  # type: ignore[attr-defined]
    assert list(out) == list(sd)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    fresh.load_state_dict(out)
    assert torch.equal(fresh[1].running_mean, model[1].running_mean)  # type: ignore[index,arg-type]


def test_full_checkpoint_with_rng_states() -> None:
    model, opt = _trained()
    import random as pyrandom

    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "step": 12345,
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.get_state(),
        "numpy_gen": np.random.default_rng(3).bit_generator.state,
        "python_rng": pyrandom.Random(5).getstate(),
    }
    out = roundtrip(state)
    rng = pyrandom.Random()
    rng.setstate(out["python_rng"])
    np.random.set_state(out["numpy_rng"])
    torch.set_rng_state(out["torch_rng"])


# --------------------------------------------------------------------------------------
# plain values, numpy
# --------------------------------------------------------------------------------------


def test_python_scalars_and_containers() -> None:
    nan_payload = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000ABCDEF))[0]
    roundtrip(
        {
            "none": None,
            "bools": [True, False],
            "ints": [0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 2**64, -(2**64) - 1, 10**5000, -(10**5000)],
            "floats": [0.0, -0.0, 1.5, float("inf"), float("-inf"), float("nan"), nan_payload, 5e-324],
            "strs": ["", "héllo ✓ \U0001f600", "\ud800 lone surrogate", "\x00nul"],
            "bytes": [b"", b"\x00\xff" * 10],
            "bytearray": bytearray(b"mutable"),
            "list": [1, [2, [3]]],
            "tuple": (1, (2, 3), []),
            "empty": [(), [], {}, collections.OrderedDict()],
            "size": torch.Size([2, 3, 4]),
            "dtypes": [torch.bfloat16, torch.float8_e4m3fn, torch.qint8, torch.bool],
            "devices": [torch.device("cpu"), torch.device("cuda", 1), torch.device("meta")],
            "sets": [{1, "a", (2, 3.5)}, frozenset({None, False})],
        }
    )


def test_tuple_and_list_stay_distinct() -> None:
    out = decode(encode([(1, 2), [1, 2], ((),), [[]]]))
    assert out == [(1, 2), [1, 2], ((),), [[]]]
    assert [type(x) for x in out] == [tuple, list, tuple, list]
    assert type(out[2][0]) is tuple and type(out[3][0]) is list


def test_non_str_dict_keys() -> None:
    state = {
        0: "int",
        -5: "neg",
        2**70: "bigint",
        1.5: "float",
        True: "bool",
        None: "none",
        ("a", 1, (2.5, None)): "tuple",
        "s": "str",
    }
    out = roundtrip(state)
    assert list(out) == list(state)
    neg_zero = decode(encode({-0.0: 1}))
    assert math.copysign(1.0, next(iter(neg_zero))) == -1.0


@pytest.mark.parametrize(
    "dtype",
    [
        "<f4",
        ">f4",
        "<f2",
        "<f8",
        ">i8",
        "u1",
        "<u2",
        "?",
        "<c16",
        "<U5",
        "S3",
        "<M8[ns]",
        "<m8[s]",
        "V4",
        [("a", "<f4"), ("b", ">i2", (2,))],
    ],
    ids=str,
)
def test_numpy_arrays(dtype: Any) -> None:
    dt = np.dtype(dtype)
    data = np.random.default_rng(0).integers(0, 256, size=24 * dt.itemsize, dtype=np.uint8)
    if dt.kind == "b":
        data = data % 2
    if dt.kind == "U":
        data = np.frombuffer("abcde".encode("utf-32-le") * 24, dtype=np.uint8)
    arr = data.view(dt).reshape(4, 6)
    out = roundtrip({"arr": arr, "nc": arr[:, ::2], "t": arr.T, "zero_d": arr[1, 1].reshape(()), "empty": arr[:0], "scalar": arr[2, 3]})
    assert out["arr"].dtype == dt


def test_numpy_scalars_and_dtypes() -> None:
    values = [
        np.float32(1.5),
        np.float64(-0.0),
        np.float16(3),
        np.int8(-3),
        np.uint64(2**64 - 1),
        np.int64(-(2**63)),
        np.bool_(True),
        np.complex64(1 + 2j),
        np.str_("héllo"),
        np.str_(""),
        np.bytes_(b"ab"),
        np.datetime64("2020-01-01T00:00"),
        np.timedelta64(5, "s"),
        np.dtype("<f4"),
        np.dtype(">i2"),
        np.dtype([("x", "<u1"), ("y", "<f8")]),
    ]
    out = roundtrip(values)
    assert [type(v) for v in out] == [type(v) for v in values]


def test_empty_and_nested_oddities() -> None:
    roundtrip(None)
    roundtrip(torch.randn(3))
    roundtrip([])
    roundtrip({"a": {"b": {"c": {"d": [[[[torch.ones(1)]]]]}}}})


def test_max_depth_is_accepted_one_more_is_not() -> None:
    ok: Any = 1
    for _ in range(ser.MAX_DEPTH):
        ok = [ok]
    assert decode(encode(ok)) == ok
    with pytest.raises(SerializationError, match="nesting deeper"):
        plan([ok])


# --------------------------------------------------------------------------------------
# rejected input
# --------------------------------------------------------------------------------------


class Custom:
    pass


class Point(NamedTuple):
    x: int
    y: int


class MyTensor(torch.Tensor):
    pass


@pytest.mark.parametrize(
    ("make", "type_fragment"),
    [
        (Custom, "Custom"),
        (lambda: lambda: 1, "function"),
        (lambda: Point(1, 2), "namedtuple"),
        (lambda: collections.defaultdict(list), "defaultdict"),
        (lambda: np.array([1, object()], dtype=object), "Python objects"),
        (lambda: torch.zeros(2).to_sparse(), "sparse"),
        (lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8), "quantized"),
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
        (lambda: torch.empty(2, device="meta"), "meta"),
        (lambda: torch.zeros(2).as_subclass(MyTensor), "subclass"),
        (lambda: range(3), "range"),
        (lambda: 1 + 2j, "complex"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_unsupported_values_name_their_path(make: Callable[[], Any], type_fragment: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized / nested tensors warn on creation
        bad = make()
        state = {"optim": {"state": {0: {"step": torch.tensor(1.0)}, 3: {"step": 1, "exp_avg": bad}}}}
        with pytest.raises(SerializationError) as info:
            plan(state)
    assert info.value.path == "state['optim']['state'][3]['exp_avg']"
    assert "state['optim']['state'][3]['exp_avg']" in str(info.value)
    assert type_fragment in str(info.value)
    assert isinstance(info.value, TypeError)


def test_unsupported_keys_and_nested_paths() -> None:
    with pytest.raises(SerializationError, match=r"state\['a'\]\[1\]\[0\]: .*Custom.*convert it"):
        plan({"a": [0, (Custom(),)]})
    with pytest.raises(SerializationError, match="dict key") as info:
        plan({"a": {torch.zeros(1).dtype: 1, Custom(): 2}})
    assert info.value.path.startswith("state['a'][")
    with pytest.raises(SerializationError, match=r"state\._metadata"):
        od: collections.OrderedDict[str, int] = collections.OrderedDict(a=1)
        od._metadata = {"": Custom()}  # type: ignore[attr-defined]
        plan(od)


def test_reference_cycles_are_detected() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    with pytest.raises(SerializationError, match="cycle") as info:
        plan({"x": loop})
    assert info.value.path == "state['x'][1]"
    d: dict[str, Any] = {}
    d["inner"] = {"back": d}
    with pytest.raises(SerializationError, match="cycle"):
        plan(d)
    od: collections.OrderedDict[str, int] = collections.OrderedDict()
    od._metadata = {"self": od}  # type: ignore[attr-defined]
    with pytest.raises(SerializationError, match="cycle"):
        plan(od)


def test_too_deep_for_the_stack_is_a_serialization_error() -> None:
    deep: Any = 0
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(SerializationError):
        plan(deep)


# --------------------------------------------------------------------------------------
# safety and corruption
# --------------------------------------------------------------------------------------


def test_decode_never_unpickles_or_evals(monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _trained()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "np": np.random.get_state(), "scalar": np.float32(2), "set": {1, 2}}
    buf = encode(state)

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("decode reached a code-executing deserializer")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(np, "load", forbidden)
    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    monkeypatch.setattr(builtins, "__import__", forbidden)
    assert_same(state, decode(buf))


def test_module_source_has_no_code_executing_deserializers() -> None:
    sources = sorted(Path(ser.__file__).parent.glob("*.py"))
    assert {p.name for p in sources} >= {"decoder.py", "header.py", "dtypes.py"}
    source = "".join(p.read_text() for p in sources)
    for needle in ("import pickle", "from pickle", "torch.load(", "eval(", "exec(", "allow_pickle=True", "import marshal", "import shelve"):
        assert needle not in source


def test_truncated_buffers() -> None:
    buf = bytes(encode(_sample_state()))
    header = peek_header(buf)
    cuts = {0, 1, 7, 8, 12, 19, 20, 21, 50, header["data_offset"] - 1, header["data_offset"], header["blobs"][-1]["offset"], len(buf) - 1}
    for cut in sorted(cuts):
        with pytest.raises(CorruptShardError):
            decode(buf[:cut])


def test_bad_magic_version_and_header_length() -> None:
    buf = encode(_sample_state())
    bad = bytearray(buf)
    bad[:8] = b"PK\x03\x04xxxx"
    with pytest.raises(CorruptShardError, match="magic"):
        decode(bad)
    for version in (0, 3, 2**32 - 1):
        bad = bytearray(buf)
        struct.pack_into("<I", bad, 8, version)
        with pytest.raises(CorruptShardError, match="version"):
            decode(bad)
    bad = bytearray(buf)
    struct.pack_into("<Q", bad, 12, 2**63)
    with pytest.raises(CorruptShardError, match="header length"):
        decode(bad)
    with pytest.raises(CorruptShardError, match="magic"):
        peek_header(b"\x80\x04\x95" + b"\x00" * 40)  # a pickle is not a shard


def test_garbage_header_json() -> None:
    buf = encode(_sample_state())
    header_len = struct.unpack_from("<Q", buf, 12)[0]
    for garbage in (
        b"{" * header_len,
        b"\xff" * header_len,
        b"[]".ljust(header_len),
        b'{"version":NaN}'.ljust(header_len),
        b"null".ljust(header_len),
    ):
        bad = bytearray(buf)
        bad[20 : 20 + header_len] = garbage
        with pytest.raises(CorruptShardError):
            decode(bad)
        with pytest.raises(CorruptShardError):
            peek_header(bad)
    bad = bytearray(buf)
    bad[20] ^= 0xFF  # flipped first header byte
    with pytest.raises(CorruptShardError, match="JSON"):
        decode(bad)


def _set_blob(index: int, **fields: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(header: dict[str, Any]) -> None:
        header["blobs"][index].update(fields)

    return mutate


def _set(**fields: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(header: dict[str, Any]) -> None:
        header.update(fields)

    return mutate


def _set_root(root: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(header: dict[str, Any]) -> None:
        header["root"] = root

    return mutate


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    def mutate(header: dict[str, Any]) -> None:
        del header[key]

    return mutate


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_set_blob(0, offset=10**9), "past the shard end"),
        (_set_blob(1, offset=65), "aligned"),
        (_set_blob(0, nbytes=4), "do not match"),
        (_set_blob(0, shape=[4, 4]), "do not match"),
        (_set_blob(0, shape=[-1, -48]), "shape"),
        (_set_blob(0, shape="12"), "shape"),
        (_set_blob(0, dtype="float33"), "dtype"),
        (_set_blob(0, dtype="qint8"), "dtype"),
        (_set_blob(0, kind="pickle"), "kind"),
        (_set_blob(0, requires_grad=1), "boolean"),
        (_set_blob(3, dtype="O"), "objects"),
        (_set_blob(3, dtype="<i2", shape=[2]), "do not match"),
        (_set_blob(3, dtype="not a dtype"), "numpy dtype"),
        (_set_blob(3, dtype=[["a", "O"]]), "objects"),
        (_set(nbytes=10**7), "truncated"),
        (_set(data_offset=0), "data_offset"),
        (_set(version=1), "version"),
        (_set(version=3), "version"),
        (_set(byteorder="big" if sys.byteorder == "little" else "little"), "endian"),
        (_set(blobs={}), "list"),
        (_drop("root"), "root"),
        (_set_root(["X", 1]), "unknown tag"),
        (_set_root(["T", 99]), "out of range"),
        (_set_root(["T", 4]), "refers to blob"),
        (_set_root(["d", "k"]), "without a value"),
        (_set_root(["d", [], 1]), "key"),
        (_set_root(1.5), "malformed"),
        (_set_root({"a": 1}), "malformed"),
        (_set_root(["f", "zz"]), "float"),
        (_set_root(["i", "1_0"]), "int"),
        (_set_root(["y", "load"]), "dtype"),
        (_set_root(["v", "no-such-device"]), "device"),
        (_set_root(["n", "<f4", "00"]), "bytes"),
        (_set_root(["s", ["l"]]), "set member"),
        (_set_root(["S", "x"]), "Size"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_inconsistent_headers_raise_corrupt_shard(mutate: Callable[[dict[str, Any]], None], message: str) -> None:
    buf = encode(_sample_state())
    assert_same(_sample_state(), decode(_with_header(buf, lambda header: None)))  # the full form decodes
    bad = _with_header(buf, mutate)
    with pytest.raises(CorruptShardError, match=message):
        decode(bad)
    with pytest.raises(CorruptShardError, match=message):
        peek_header(bad) if message not in _CHECKED_BY_DECODE_ONLY else decode(bad)


_CHECKED_BY_DECODE_ONLY = {"unknown tag", "out of range", "refers to blob", "without a value", "key", "malformed",
                           "float", "int", "dtype", "device", "bytes", "set member", "Size"}  # fmt: skip


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_set_blob(0, offset=10**9), "past the shard end"),
        (_set_blob(1, offset=65), "aligned"),
        (_set_blob(0, nbytes=4), "do not match"),
        (_set_blob(0, dtype="qint8"), "dtype"),
        (_set_blob(3, dtype="O"), "objects"),
        (_set(version=2), "version"),
        (_set(blobs={}), "list"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_version_1_headers_are_still_validated(mutate: Callable[[dict[str, Any]], None], message: str) -> None:
    buf = encode(_sample_state())
    assert_same(_sample_state(), decode(_with_header(buf, lambda header: None, version=1)))
    with pytest.raises(CorruptShardError, match=message):
        decode(_with_header(buf, mutate, version=1))


def _set_kind(index: int, **fields: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(header: dict[str, Any]) -> None:
        header["kinds"][index].update(fields)

    return mutate


def _drop_kind_field(index: int, key: str) -> Callable[[dict[str, Any]], None]:
    def mutate(header: dict[str, Any]) -> None:
        del header["kinds"][index][key]

    return mutate


def _set_ids(ids: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(header: dict[str, Any]) -> None:
        header["blobs"] = ids

    return mutate


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_set(kinds={}), "'kinds' must be a list"),
        (_set(kinds=[]), "indices"),
        (_set(kinds=[1]), "record must be an object"),
        (_set_kind(0, kind="pickle"), "kind"),
        (_set_kind(0, nbytes=-48), "nbytes"),
        (_set_kind(0, nbytes=True), "nbytes"),
        (_drop_kind_field(0, "nbytes"), "nbytes"),
        (_set_kind(0, nbytes=44), "do not match"),
        (_set_kind(0, shape=[4, 4]), "do not match"),
        (_set_kind(0, shape=[3, 4.0]), "shape"),
        (_set_kind(0, shape=[True, 12]), "shape"),
        (_set_kind(0, dtype="float33"), "dtype"),
        (_set_kind(0, dtype="qint8"), "dtype"),
        (_set_kind(0, requires_grad=1), "boolean"),
        (_set_kind(3, dtype="O"), "objects"),
        (_set_kind(3, dtype=[["a", "O"]]), "objects"),
        (_set_kind(3, dtype="<i2", shape=[2]), "do not match"),
        (_set_kind(4, nbytes=4), "blobs end"),
        (_set_ids(None), "'blobs' must be a list"),
        (_set_ids([0, 1, 2, 3]), "blobs end"),
        (_set_ids([0, 1, 2, 3, 4, 4]), "blobs end"),
        (_set_ids([0, 1, 2, 3, 5]), "indices"),
        (_set_ids([0, 1, 2, 3, -1]), "indices"),
        (_set_ids([0, 1, 2, 3, True]), "indices"),
        (_set_ids([0, 1, 2, 3, 4.0]), "indices"),
        (_set_ids([0, 1, 2, 3, "4"]), "indices"),
        (_set_ids([[0], 1, 2, 3, 4]), "indices"),
        (_set_ids([3, 1, 2, 0, 4]), "refers to blob"),  # blob 0 becomes the array, the tree says tensor
        (_set(nbytes=10**7), "truncated"),
        (_set_root(["T", 4]), "refers to blob"),
        (_set_root(["T", 5]), "out of range"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_inconsistent_compact_tables_raise_corrupt_shard(mutate: Callable[[dict[str, Any]], None], message: str) -> None:
    buf = encode(_sample_state())
    assert_same(_sample_state(), decode(_with_raw_header(buf, lambda header: None)))
    bad = _with_raw_header(buf, mutate)
    with pytest.raises(CorruptShardError, match=message):
        decode(bad)
    if message in ("refers to blob", "out of range"):  # the tree: decode's to check
        peek_header(bad)
    else:
        with pytest.raises(CorruptShardError, match=message):
            peek_header(bad)


def test_header_flip_fuzz_only_raises_corrupt_shard() -> None:
    state = _sample_state()
    buf = bytes(encode(state))
    data_offset = peek_header(buf)["data_offset"]
    rng = random.Random(1234)
    outcomes = collections.Counter[str]()
    for _ in range(200):
        bad = bytearray(buf)
        for _ in range(rng.randint(1, 3)):
            bad[rng.randrange(data_offset)] ^= 1 << rng.randrange(8)
        if rng.random() < 0.1:
            bad = bad[: rng.randrange(len(bad))]
        try:
            decode(bad)
            outcomes["ok"] += 1
        except CorruptShardError:
            outcomes["corrupt"] += 1
    assert outcomes["corrupt"] > 100


def test_non_buffer_argument_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        decode("not bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        plan({}).write_into([0] * 100)  # type: ignore[arg-type]


def test_gc_state_is_restored_after_success_and_failure() -> None:
    import gc

    assert gc.isenabled()
    decode(encode(_sample_state()))
    with pytest.raises(SerializationError):
        plan({"x": Custom()})
    with pytest.raises(CorruptShardError):
        decode(b"MSTSHRD1" + b"\x01\x00\x00\x00" + struct.pack("<Q", 2) + b"{]")
    assert gc.isenabled()
    gc.disable()
    try:
        decode(encode(_sample_state()))
        assert not gc.isenabled()  # left as the caller had it
    finally:
        gc.enable()


def test_zero_copy_decode_views_the_buffer() -> None:
    state = {"w": torch.arange(100_000, dtype=torch.float32), "a": np.arange(50_000, dtype=np.int64), "small": torch.ones(3)}
    data = ser.encode(state)
    mm = mmap.mmap(-1, len(data))
    mm[:] = bytes(data)
    out = ser.decode(mm, zero_copy=True)
    assert torch.equal(out["w"], state["w"]) and np.array_equal(out["a"], state["a"]) and torch.equal(out["small"], state["small"])
    out["w"][0] = 42.0  # the views alias the buffer: a fresh decode of it sees the write
    out["a"][1] = 7
    again = ser.decode(mm)
    assert again["w"][0].item() == 42.0 and again["a"][1] == 7 and again["small"][0].item() == 1.0
    with pytest.raises(TypeError, match="writable"):
        ser.decode(bytes(data), zero_copy=True)


# --------------------------------------------------------------------------------------
# format version 1 (one full record per blob), still read
# --------------------------------------------------------------------------------------

# A shard written by the version-1 encoder (before the compact blob table), of _v1_state().
_V1_SHARD = zlib.decompress(base64.b64decode(
    "eNrt18Fym0YYwHHSNGnSvgVnDsuCEPIh9nR66KU9NLlpNB4kllRTDApg15qMZ/IofZQ8Wr/FwkauSmKjW/4rr63d337fsssKjX97++7tr3/84j9zHOfmtdOWj+6Vqep1Wbgnvucut40pq9RU7ombr5smN67nFra3dk/iYOqHnpsmTXJeZlltGvdEh7NIwvJyKQPmH92/1kUqsY0p6rKS2P1xXSZt0zTbjZGhWV4mTaBlbP1nYnvm2gsWN95Arkmk7nP5eijXFzJF9kq6TNF9omWbyY8ekSmO7zMNLm84z3Sij7S22I+OtLY4VkdZ2ywMj7O2QKn4OGsL1FQfY22BH0RHWptW6khr01F4lLUFurfb8eBHd+G5lflwua5Mff6+SiRfU10az90kVXJhGvtgsR3D082+9pb4h6cbzB5OejcqVsrudjfDuniwHMuDexPv51NDV6s8/Zhc/YekXNjejQ+/8IiMg4nunaKgd4rKMv+/E1SkSVUl2/08ce8M6d763qzDXp5JP8/t6H6WKOw/HR8M/e+kU793AvSNvctlKTJ3Uxl3UaZG1jB3ywv723Z1f7vvMs9fSNDftvud6ynbKDfN+m583SSN2TXUrs9cb86Tq/e7GHu0dj3n9Yddpz3edWM2u2Ygef2D0eGh6Ml+dCTR+mD09FB0vB89k+jg8JWrQ+G+vx/v64XdlfZzKR+d8nJTW8m7Hcor+y6Td9kqmWV+qsM00hMVZK6ELU2TtOObbtQqXd0Vs2pH3YJexlM/Smcrk01NZqGbtptQySba73zPlb72U+xlSV6b2wvsrtf63RLt/i7Xd027s+Zi02y7jkg6ilXXsvu57Bp2H4s26+/SmtmzlbQHRUZou3XLxLZ+lpbdsuvdRfq75ah+CUMl6ywu81z2drcdgb35c9ucyC2Wd2uJCtXDItuwuHGeUj6dyq8z+ZH6Seo/Z843U+zau/qEctq+Rs4/qpz16hNmt6/R848JP7uvjy+fT+1r7PxjSjv75xH3/83YE2z/9/pO6nOp30t9IfUlhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEYhmEY9k2b7XklI144r2XMS+dHGfWD85PzteVZm310eXiJj4i88sdMfL39F3+Q2vk="
))  # fmt: skip


def _v1_state() -> dict[str, Any]:
    od: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict(w=torch.arange(6, dtype=torch.float32).reshape(2, 3))
    od._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    return {
        "model": od,
        "optim": {
            "state": {
                i: {
                    "exp_avg": torch.full((3,), float(i)),
                    "exp_avg_sq": torch.full((3,), i * 0.5, dtype=torch.bfloat16),
                    "step": torch.tensor(float(i)),
                }
                for i in range(4)
            },
            "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "params": [0, 1, 2, 3], "amsgrad": False}],
        },
        "p": torch.nn.Parameter(torch.tensor([1.5, -2.0])),
        "g": torch.tensor([0.25], requires_grad=True),
        "big": torch.arange(20000, dtype=torch.int32) % 7,
        "empty": torch.empty(0, 2),
        "nc": torch.arange(12, dtype=torch.int16).reshape(3, 4).t(),
        "b": torch.tensor([True, False, True]),
        "np": np.arange(5, dtype=">i4"),
        "raw": b"\x00\x01v1",
        "ba": bytearray(b"xy"),
        "x": [1, 2.5, None, "s", (3, 4), {5, 6}, 2**70],
    }


def test_version_1_shards_still_decode() -> None:
    assert struct.unpack_from("<I", _V1_SHARD, 8)[0] == 1
    header = peek_header(_V1_SHARD)
    assert header["version"] == 1 and header == _raw_header(_V1_SHARD)  # the full form is what version 1 stores
    assert_same(_v1_state(), decode(_V1_SHARD))
    assert_same(_v1_state(), ser.decode(bytearray(_V1_SHARD), zero_copy=True))
    # re-encoded, it is the same state in the current format, same blob layout
    again = encode(decode(_V1_SHARD))
    assert struct.unpack_from("<I", again, 8)[0] == FORMAT_VERSION
    assert [{k: v for k, v in blob.items() if k != "offset"} for blob in peek_header(again)["blobs"]] == [
        {k: v for k, v in blob.items() if k != "offset"} for blob in header["blobs"]
    ]
    assert bytes(again[peek_header(again)["data_offset"] :]) == _V1_SHARD[header["data_offset"] :]


def test_any_shard_in_version_1_form_decodes_the_same() -> None:
    model, opt = _trained()
    for state in (_sample_state(), {"model": model.state_dict(), "optim": opt.state_dict()}, _v1_state(), {}, [torch.ones(2)] * 3):
        buf = encode(state)
        assert_same(state, decode(_full_form(buf, version=1)))
        assert_same(state, decode(_full_form(buf)))  # the full form is a valid version-2 header too
