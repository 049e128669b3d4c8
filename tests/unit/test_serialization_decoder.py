"""decode() and its safety: nothing code-executing, truncated and odd buffers, GC state, zero-copy views.

The module under test: trainer_client.serialization.decoder."""

from __future__ import annotations

import builtins
import mmap
import pickle
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.harness.shards import (
    assert_same,
    decode,
    sample_state,
    trained,
)
from trainer_client import serialization as ser
from trainer_client.errors import CorruptShardError, SerializationError
from trainer_client.serialization import (
    encode,
    peek_header,
    plan,
)

pytestmark = pytest.mark.unit


class Unsupported:
    """A value the format refuses."""


def test_decode_never_unpickles_or_evals(monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = trained()
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
    buf = bytes(encode(sample_state()))
    header = peek_header(buf)
    cuts = {0, 1, 7, 8, 12, 19, 20, 21, 50, header["data_offset"] - 1, header["data_offset"], header["blobs"][-1]["offset"], len(buf) - 1}
    for cut in sorted(cuts):
        with pytest.raises(CorruptShardError):
            decode(buf[:cut])


def test_non_buffer_argument_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        decode("not bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        plan({}).write_into([0] * 100)  # type: ignore[arg-type]


def test_gc_state_is_restored_after_success_and_failure() -> None:
    import gc

    assert gc.isenabled()
    decode(encode(sample_state()))
    with pytest.raises(SerializationError):
        plan({"x": Unsupported()})
    with pytest.raises(CorruptShardError):
        decode(b"MSTSHRD1" + b"\x01\x00\x00\x00" + struct.pack("<Q", 2) + b"{]")
    assert gc.isenabled()
    gc.disable()
    try:
        decode(encode(sample_state()))
        assert not gc.isenabled()  # left as the caller had it
    finally:
        gc.enable()


def test_a_decoded_state_is_freed_with_its_last_reference_not_at_the_next_collection() -> None:
    import gc
    import weakref

    data = ser.encode({"w": torch.randn(70_000), "small": torch.ones(3), "list": [torch.zeros(2)]})
    mm = mmap.mmap(-1, len(data))
    mm[:] = bytes(data)
    gc.disable()  # only reference counting frees it
    try:
        for zero_copy in (True, False):
            out = ser.decode(mm, zero_copy=zero_copy)
            refs = [weakref.ref(out["w"]), weakref.ref(out["small"]), weakref.ref(out["list"][0])]
            del out
            assert all(ref() is None for ref in refs)  # no cycle (the decoder's) keeps the tensors, or the mapping, alive
    finally:
        gc.enable()


def test_zero_copy_views_keep_every_dtype_and_shape() -> None:
    # The view path takes shortcuts (a byte string's slice is the tensor; a 1-D tensor is not reshaped): every
    # combination must still come back with its own dtype, shape and flags, aliasing the buffer.
    n = 70_000  # over SMALL_COPY: views, not copies
    state = {
        "bytes1d": torch.arange(n * 4, dtype=torch.int64).to(torch.uint8),
        "bytes2d": torch.arange(n * 4, dtype=torch.int64).to(torch.uint8).reshape(4, n),
        "f32": torch.randn(n),
        "bf16": torch.randn(2, 5, n // 2).to(torch.bfloat16),
        "param": torch.nn.Parameter(torch.randn(n)),
        "grad": torch.randn(4, n).requires_grad_(True),
    }
    data = ser.encode(state)
    mm = mmap.mmap(-1, len(data))
    mm[:] = bytes(data)
    out = ser.decode(mm, zero_copy=True)
    base = torch.frombuffer(mm, dtype=torch.uint8).data_ptr()
    for name, want in state.items():
        got = out[name]
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got.detach(), want.detach()), name
        assert base <= got.data_ptr() < base + len(data), f"{name} is a copy, not a view"
        assert got.requires_grad == want.requires_grad and isinstance(got, torch.nn.Parameter) == (name == "param"), name


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


def test_spans_leave_large_plain_byte_tensors_where_they_lie_and_views_read_tensors_elsewhere() -> None:
    n = 70_000  # over SMALL_COPY
    state = {
        "bytes1d": torch.arange(n, dtype=torch.int64).to(torch.uint8),
        "bytes2d": torch.arange(n, dtype=torch.int64).to(torch.uint8).reshape(2, n // 2),
        "param": torch.nn.Parameter(torch.ones(n, dtype=torch.uint8), requires_grad=False),
        "f32": torch.randn(n),
        "small": torch.arange(100, dtype=torch.uint8),
    }
    data = ser.encode(state)
    mm = mmap.mmap(-1, len(data))
    mm[:] = bytes(data)
    made: list[ser.Span] = []
    out = ser.decode(mm, zero_copy=True, spans=made)
    span = out["bytes1d"]
    assert made == [span] and span.buffer is mm and span.nbytes == n  # only the 1-D byte tensor is left as bytes
    assert mm[span.offset : span.offset + n] == state["bytes1d"].numpy().tobytes()
    assert all(isinstance(out[k], torch.Tensor) and torch.equal(out[k], state[k]) for k in state if k != "bytes1d")
    assert isinstance(out["param"], torch.nn.Parameter)

    base = torch.frombuffer(mm, dtype=torch.uint8).data_ptr()
    at = ser.decode(mm, zero_copy=True)["f32"].data_ptr() - base  # where the tensor lies in the shard
    elsewhere = bytearray(8) + bytearray(state["f32"].numpy().tobytes())
    mm[at : at + 4 * n] = bytes(4 * n)  # the shard's own bytes there are never read
    out = ser.decode(mm, zero_copy=True, views={at: ser.Span(elsewhere, 8, 4 * n)})
    assert torch.equal(out["f32"], state["f32"]) and out["f32"].data_ptr() == torch.frombuffer(elsewhere, dtype=torch.uint8).data_ptr() + 8
    assert torch.equal(out["bytes1d"], state["bytes1d"])
