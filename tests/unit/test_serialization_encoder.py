"""The shard format's encoder: plan(), ShardLayout.write_into() and the documented layout (trainer_client.serialization.encoder)."""

from __future__ import annotations

import json
import mmap
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.harness.shards import (
    assert_same,
    decode,
    sample_state,
)
from trainer_client.errors import InvalidArgumentError, SerializationError
from trainer_client.serialization import (
    FORMAT_VERSION,
    MAGIC,
    ShardLayout,
    encode,
    peek_header,
    plan,
    spec,
)

pytestmark = pytest.mark.unit


def test_layout_matches_the_documented_format() -> None:
    state = {**sample_state(), "w2": torch.ones(3, 4), "b2": torch.zeros(3, dtype=torch.bfloat16)}
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
    state = sample_state()
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
    layout = plan(sample_state())
    with pytest.raises(InvalidArgumentError, match="needs"):
        layout.write_into(bytearray(layout.nbytes - 1))
    with pytest.raises(InvalidArgumentError, match="writable"):
        layout.write_into(bytes(layout.nbytes))


def test_write_into_mmap_and_decode_from_read_only_file_mmap(tmp_path: Path) -> None:
    state = {**sample_state(), "big": torch.randn(300, 300).t()}
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
    buf = encode(sample_state())
    assert_same(sample_state(), decode(memoryview(buf)))
    assert_same(sample_state(), decode(np.frombuffer(bytes(buf), dtype=np.uint8)))
    padded = bytes(buf) + b"\xff" * 1000  # a shard inside a bigger slab
    assert_same(sample_state(), decode(padded))
