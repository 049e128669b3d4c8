"""ShardLayout.write_into(mark=): the shard's bytes are final front to back as the marks say, and the same."""

from __future__ import annotations

import pytest
import torch

from trainer_client import serialization
from trainer_client.serialization import encoder

pytestmark = pytest.mark.unit


def test_marks_say_how_many_bytes_are_final_and_the_shard_is_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(encoder, "MARK_BYTES", 1 << 16)  # many marks from a small state
    torch.manual_seed(0)
    state = {
        "w": [torch.randn(3000) for _ in range(20)],
        "half": [torch.randn(50, 7).to(torch.bfloat16) for _ in range(40)],
        "strided": torch.randn(64, 32).t(),
        "meta": {"step": 7, "name": "x"},
    }
    layout = serialization.plan(state)
    expected = bytearray(layout.nbytes)
    layout.write_into(expected)
    out = bytearray(b"\xaa" * layout.nbytes)  # a reused buffer: nothing may be left of its old bytes
    marks: list[int] = []

    def mark(n: int) -> None:
        assert out[:n] == expected[:n], f"bytes before mark {n} are not final yet"
        marks.append(n)

    layout.write_into(out, mark=mark)
    assert out == expected
    assert len(marks) >= 3 and marks == sorted(set(marks)) and marks[0] > 0 and marks[-1] < layout.nbytes
    assert serialization.decode(bytes(out))["meta"] == {"step": 7, "name": "x"}
