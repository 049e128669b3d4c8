"""The C heap kept for Reed-Solomon's per-call allocations (``memstore.erasure.heap``): set only for ec:K+M with M >= 2."""

from __future__ import annotations

import pytest

from memstore.core.redundancy import Redundancy
from memstore.erasure.heap import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, MMAP_THRESHOLD, TRIM_THRESHOLD, glibc_mallopt, tune_heap

pytestmark = pytest.mark.unit


class Recorder:
    def __init__(self, answer: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []
        self.answer = answer

    def __call__(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.answer


@pytest.mark.parametrize("scheme", ["replicas:1", "replicas:2", "ec:4+1", "ec:2+1"])
def test_the_heap_is_left_alone_without_reed_solomon(scheme: str) -> None:
    mallopt = Recorder()
    assert not tune_heap(Redundancy.parse(scheme), mallopt)
    assert mallopt.calls == []


@pytest.mark.parametrize("scheme", ["ec:4+2", "ec:3+2", "ec:8+3"])
def test_both_thresholds_are_raised_when_the_scheme_codes_with_two_parities_or_more(scheme: str) -> None:
    mallopt = Recorder()
    assert tune_heap(Redundancy.parse(scheme), mallopt)
    assert mallopt.calls == [(M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD)]


def test_a_refusal_is_reported_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    assert not tune_heap(Redundancy.parse("ec:4+2"), Recorder(answer=0))
    assert "could not raise" in caplog.text


def test_this_process_has_glibcs_mallopt() -> None:
    assert glibc_mallopt() is not None  # the store's default (Linux with glibc, as the wheels we ship for)
