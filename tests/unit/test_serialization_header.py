"""Header validation: every inconsistency raises CorruptShardError, format version 1 is still read (trainer_client.serialization.header)."""

from __future__ import annotations

import base64
import collections
import random
import struct
import sys
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from tests.harness.shards import (
    assert_same,
    decode,
    full_form,
    raw_header,
    sample_state,
    trained,
    with_header,
    with_raw_header,
)
from trainer_client import serialization as ser
from trainer_client.errors import CorruptShardError
from trainer_client.serialization import (
    FORMAT_VERSION,
    encode,
    peek_header,
)

pytestmark = pytest.mark.unit


def test_bad_magic_version_and_header_length() -> None:
    buf = encode(sample_state())
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
    buf = encode(sample_state())
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
    buf = encode(sample_state())
    assert_same(sample_state(), decode(with_header(buf, lambda header: None)))  # the full form decodes
    bad = with_header(buf, mutate)
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
    buf = encode(sample_state())
    assert_same(sample_state(), decode(with_header(buf, lambda header: None, version=1)))
    with pytest.raises(CorruptShardError, match=message):
        decode(with_header(buf, mutate, version=1))


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
    buf = encode(sample_state())
    assert_same(sample_state(), decode(with_raw_header(buf, lambda header: None)))
    bad = with_raw_header(buf, mutate)
    with pytest.raises(CorruptShardError, match=message):
        decode(bad)
    if message in ("refers to blob", "out of range"):  # the tree: decode's to check
        peek_header(bad)
    else:
        with pytest.raises(CorruptShardError, match=message):
            peek_header(bad)


def test_header_flip_fuzz_only_raises_corrupt_shard() -> None:
    state = sample_state()
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
    assert header["version"] == 1 and header == raw_header(_V1_SHARD)  # the full form is what version 1 stores
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
    model, opt = trained()
    for state in (sample_state(), {"model": model.state_dict(), "optim": opt.state_dict()}, _v1_state(), {}, [torch.ones(2)] * 3):
        buf = encode(state)
        assert_same(state, decode(full_form(buf, version=1)))
        assert_same(state, decode(full_form(buf)))  # the full form is a valid version-2 header too
