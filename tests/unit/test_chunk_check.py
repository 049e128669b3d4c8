"""Verification beside the copy (``trainer_client.chunk_check``) through the device-restore copies on the CPU: the
chunks are hashed ahead of the copies, a copy waits only for its own chunks, and a chunk that fails in the middle of
a restore stops it with ``CorruptShardError`` before its bytes are copied; a failed chunk no tensor covers is still
caught before the load returns. Targets are CPU tensors staged through the bounce ring, registered in the fake CUDA
runtime (``tests/harness/fake_cuda``)."""

from __future__ import annotations

import gc
import mmap
from typing import Any

import numpy as np
import pytest
import torch

from memstore.v1.integrity import compute_checksums
from memstore.v1.pagefaults import address_of
from tests.harness.fake_cuda import FakeCudaRuntime
from trainer_client import serialization
from trainer_client.capture import device_restore
from trainer_client.chunk_check import ChunkCheck
from trainer_client.errors import CorruptShardError

pytestmark = pytest.mark.unit
CHUNK = 256 << 10


def _shard() -> tuple[dict[str, Any], mmap.mmap, int]:
    state = {f"t{i}": torch.full((64 << 10,), float(i)) for i in range(8)}  # 256 KiB each: a chunk apiece, about
    state["step"] = 7
    state["tail"] = np.ones(2 * CHUNK // 8)  # an array: copied by the tree walk, no tensor's gate covers its chunks
    encoded = serialization.encode(state)
    mm = mmap.mmap(-1, len(encoded))
    mm[:] = bytes(encoded)
    return state, mm, len(encoded)


def _restore(mm: mmap.mmap, nbytes: int, check: ChunkCheck, copied: list[int]) -> Any:
    def gate(addr: int, n: int) -> None:
        check.gate(addr, n)
        copied.append(addr - check.base)

    copies = device_restore.HostToDevice(staged=lambda target: True, gate=gate)  # CPU targets through the bounce ring
    return device_restore.decode_onto(mm, torch.device("cpu"), zero_copy=False, copies=copies)


def _check(mm: mmap.mmap, nbytes: int, checksums: list[int]) -> ChunkCheck:
    return ChunkCheck(memoryview(mm)[:nbytes], address_of(mm), CHUNK, checksums, "step 1 rank 0", workers=2)


def test_a_sound_shard_is_restored_with_every_chunk_verified(fake_cuda: FakeCudaRuntime) -> None:
    state, mm, nbytes = _shard()
    check = _check(mm, nbytes, compute_checksums(memoryview(mm), nbytes, CHUNK))
    copied: list[int] = []
    out = _restore(mm, nbytes, check, copied)
    check.finish()
    assert all(torch.equal(out[f"t{i}"], state[f"t{i}"]) for i in range(8)) and out["step"] == 7
    assert np.array_equal(out["tail"], state["tail"])
    assert len(copied) == 8  # every tensor passed the gate before its copy
    del out
    gc.collect()  # the decoder's views of the mapping may sit in a reference cycle until a collection
    mm.close()  # then nothing keeps the mapping: the hashing threads are done and their view released


def test_a_chunk_that_fails_in_the_middle_stops_the_restore_before_its_bytes_are_copied(fake_cuda: FakeCudaRuntime) -> None:
    _, mm, nbytes = _shard()
    checksums = compute_checksums(memoryview(mm), nbytes, CHUNK)
    bad = len(checksums) // 2
    mm[bad * CHUNK + 100] ^= 0xFF  # a bit flipped after the checksums were made
    check = _check(mm, nbytes, checksums)
    copied: list[int] = []
    with pytest.raises(CorruptShardError, match=f"chunk {bad} of step 1 rank 0"):
        _restore(mm, nbytes, check, copied)
    check.close()
    assert copied and all(offset < (bad + 1) * CHUNK for offset in copied)  # nothing after the bad chunk was copied


def test_a_failed_chunk_that_no_tensor_covers_is_caught_before_the_load_returns(fake_cuda: FakeCudaRuntime) -> None:
    _, mm, nbytes = _shard()
    checksums = compute_checksums(memoryview(mm), nbytes, CHUNK)
    check = _check(mm, nbytes, [*checksums[:-1], checksums[-1] ^ 1])  # the last chunk (the array's) differs
    _restore(mm, nbytes, check, [])  # the tensors before it verified: copied
    with pytest.raises(CorruptShardError, match=f"chunk {len(checksums) - 1}"):
        check.finish()


def test_checksums_that_do_not_fit_the_shard_are_refused() -> None:
    _, mm, nbytes = _shard()
    with pytest.raises(CorruptShardError, match="do not fit"):
        ChunkCheck(memoryview(mm)[:nbytes], address_of(mm), CHUNK, [1, 2], "step 1 rank 0")
