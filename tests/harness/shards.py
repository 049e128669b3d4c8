"""Helpers of the shard-format tests (``tests/unit/test_serialization_*.py``): comparing states bit for bit,
rewriting headers, and sample states."""

from __future__ import annotations

import copy
import functools
import json
import math
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from trainer_client import serialization as ser
from trainer_client.serialization import (
    FORMAT_VERSION,
    MAGIC,
    encode,
    peek_header,
    spec,
)

SMALL = spec.SMALL_COPY  # blobs up to this size take the memmove path, larger ones torch copy_
UINT4: torch.dtype = getattr(torch, "uint4")  # noqa: B009 - missing from torch's type stubs


def decode(buf: Any) -> Any:
    """``serialization.decode`` typed ``-> Any`` so tests can index the result."""
    return ser.decode(buf)


def bits(t: torch.Tensor) -> torch.Tensor:
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
        assert torch.equal(bits(a), bits(b)), path
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


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bytes viewed as ``dtype``: covers NaN payloads, subnormals, odd bit patterns."""
    gen = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def relayout(header: dict[str, Any], data: bytes, version: int, slack: int = 128) -> bytearray:
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


def full_form(buf: bytes | bytearray, version: int = FORMAT_VERSION) -> bytearray:
    """``buf`` with the header peek_header gives (one full record per blob), as a ``version`` shard."""
    header = peek_header(buf)
    header["version"] = version
    return relayout(header, bytes(buf[header["data_offset"] : header["nbytes"]]), version)


def edit_header(shard: bytearray, header: dict[str, Any]) -> bytearray:
    """``shard`` (laid out with slack) with ``header`` written over its header, in place: the data area stays."""
    old_len = struct.unpack_from("<Q", shard, 12)[0]
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= old_len, "the edit needs more room than the slack"
    shard[20 : 20 + old_len] = text.ljust(old_len)
    return shard


def with_header(buf: bytes | bytearray, mutate: Callable[[dict[str, Any]], None], version: int = FORMAT_VERSION) -> bytearray:
    """``buf`` in the full form (one record per blob; see full_form) whose header went through ``mutate``."""
    out = full_form(buf, version)
    header = peek_header(out)
    mutate(header)
    return edit_header(out, header)


def raw_header(buf: bytes | bytearray) -> dict[str, Any]:
    """The header JSON as stored (the compact blob table of version 2, not peek_header's full form)."""
    header_len = struct.unpack_from("<Q", buf, 12)[0]
    header: dict[str, Any] = json.loads(bytes(buf[20 : 20 + header_len]))
    return header


def with_raw_header(buf: bytes | bytearray, mutate: Callable[[dict[str, Any]], None]) -> bytearray:
    """``buf`` whose stored (compact) header went through ``mutate``; data area kept."""
    header = raw_header(buf)
    out = relayout(header, bytes(buf[header["data_offset"] : header["nbytes"]]), FORMAT_VERSION)
    header = raw_header(out)
    mutate(header)
    return edit_header(out, header)


def sample_state() -> dict[str, Any]:
    return {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": torch.ones(3, dtype=torch.bfloat16),
        "p": torch.nn.Parameter(torch.zeros(2)),
        "n": np.arange(4, dtype=np.int16),
        "raw": b"\x00\x01\x02",
        "meta": {"step": 7, "lr": 0.1, "names": ["a", "b"], 3: (1, 2.5)},
    }


@functools.cache
def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """One small model after one AdamW step, shared by tests that only read it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 4)).pow(2).sum().backward()
    opt.step()
    return model, opt
