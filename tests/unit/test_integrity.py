"""first_mismatch: the first bad chunk of a shard, on threads only where the shard is large enough to pay for them.

The module under test: memstore.v1.integrity."""

from __future__ import annotations

import os
from typing import Any

import pytest

from memstore.v1 import integrity
from memstore.v1.integrity import checksum, chunk_spans, first_mismatch

CHUNK = 4096


def shard(nbytes: int) -> tuple[memoryview, list[int]]:
    buf = memoryview(bytearray(os.urandom(nbytes)))
    return buf, [checksum(buf[o : o + n]) for o, n in chunk_spans(nbytes, CHUNK)]


class NoThreads:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("a small shard was hashed on a thread pool")


def test_a_small_shard_is_hashed_on_the_callers_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    buf, sums = shard(integrity.PARALLEL_HASH_MIN_BYTES // 4)
    monkeypatch.setattr(integrity, "ThreadPoolExecutor", NoThreads)
    assert first_mismatch(buf, len(buf), CHUNK, sums, workers=4) is None
    buf[5 * CHUNK + 1] ^= 0xFF
    assert first_mismatch(buf, len(buf), CHUNK, sums, workers=4) == 5


@pytest.mark.parametrize("bad", [[3], [40, 7], [63]])
def test_a_large_shard_is_hashed_on_threads_and_the_first_bad_chunk_is_named(monkeypatch: pytest.MonkeyPatch, bad: list[int]) -> None:
    monkeypatch.setattr(integrity, "PARALLEL_HASH_MIN_BYTES", 8 * CHUNK)  # 64 chunks: up to 8 threads' worth
    made: list[int] = []
    real = integrity.ThreadPoolExecutor

    def counted(max_workers: int) -> Any:
        made.append(max_workers)
        return real(max_workers=max_workers)

    monkeypatch.setattr(integrity, "ThreadPoolExecutor", counted)
    buf, sums = shard(64 * CHUNK)
    assert first_mismatch(buf, len(buf), CHUNK, sums, workers=4) is None
    for index in bad:
        buf[index * CHUNK] ^= 0x01
    assert first_mismatch(buf, len(buf), CHUNK, sums, workers=4) == min(bad)
    assert made == [4, 4]


def test_a_checksum_list_of_the_wrong_length_is_a_mismatch() -> None:
    buf, sums = shard(3 * CHUNK)
    assert first_mismatch(buf, len(buf), CHUNK, sums[:-1]) == -1
