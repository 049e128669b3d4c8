"""ShardLayout.write_into(sums=): every chunk hashed as it is copied, exactly as the store would hash the shard."""

from __future__ import annotations

import ctypes

import pytest
import torch

from memstore.v1.integrity import compute_checksums
from trainer_client import serialization
from trainer_client.errors import InvalidArgumentError
from trainer_client.serialization import memory

pytestmark = pytest.mark.unit


def mixed_state() -> dict[str, object]:
    torch.manual_seed(1)
    return {
        "big": [torch.randn(300_000) for _ in range(3)],  # memmove pieces that cross chunk boundaries
        "half": [torch.randn(50, 7).to(torch.bfloat16) for _ in range(40)],  # small blobs, written before the copies
        "strided": torch.randn(640, 32).t(),  # Tensor.copy_ path
        "meta": {"step": 7, "name": "x"},
    }


@pytest.mark.parametrize("chunk", [4 << 20, 1 << 20, 4096, 1_000_003])
def test_the_sums_of_a_copy_are_the_stores_checksums_of_its_bytes(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "HASH_PIECE", 64 << 10)  # many hashed pieces per chunk
    layout = serialization.plan(mixed_state())
    expected = bytearray(layout.nbytes)
    layout.write_into(expected)
    out = bytearray(b"\xaa" * layout.nbytes)  # a reused buffer: its old bytes must not reach a checksum
    sums = serialization.ChunkSums(chunk)
    layout.write_into(out, sums=sums)
    assert out == expected
    assert sums.values == compute_checksums(memoryview(out), layout.nbytes, chunk)


def test_a_copy_that_leaves_bytes_to_come_hashes_nothing() -> None:
    layout = serialization.plan(mixed_state())
    out = bytearray(layout.nbytes)
    left_to_a_device_copy = serialization.ChunkSums(4096)
    layout.write_into(out, skip=frozenset({0}), sums=left_to_a_device_copy)
    in_marks = serialization.ChunkSums(4096)
    layout.write_into(out, mark=lambda n: None, sums=in_marks)
    assert left_to_a_device_copy.values is None and in_marks.values is None


def test_a_copy_outside_the_shard_is_refused_before_anything_is_copied() -> None:
    dst, src = bytearray(8192), bytes(range(256)) * 64
    base = ctypes.addressof((ctypes.c_char * len(dst)).from_buffer(dst))
    keep = ctypes.c_char_p(src)
    src_addr = ctypes.cast(keep, ctypes.c_void_p).value
    assert src_addr is not None
    with pytest.raises(InvalidArgumentError, match="outside the 8192-byte shard"):
        memory.memmove_hashing([(base, src_addr, 4096), (base + 6000, src_addr, 4096)], base, len(dst), 4096)
    assert dst == bytearray(8192)
