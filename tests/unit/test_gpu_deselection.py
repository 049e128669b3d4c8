"""Tests marked ``gpu`` are deselected, not skipped or passed, where torch sees no CUDA device (tests/conftest.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import conftest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


class FakeItem:
    def __init__(self, name: str, gpu: bool) -> None:
        self.name = name
        self.gpu = gpu

    def get_closest_marker(self, name: str) -> Any:
        return pytest.mark.gpu.mark if name == "gpu" and self.gpu else None


class FakeConfig:
    def __init__(self) -> None:
        self.deselected: list[Any] = []
        self.hook = self

    def pytest_deselected(self, items: list[Any]) -> None:
        self.deselected.extend(items)


@pytest.mark.parametrize("cuda", [False, True])
def test_the_hook_deselects_gpu_tests_only_without_cuda(cuda: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conftest, "_cuda_available", lambda: cuda)
    items: list[Any] = [FakeItem("cpu_a", False), FakeItem("gpu_a", True), FakeItem("cpu_b", False), FakeItem("gpu_b", True)]
    config = FakeConfig()
    conftest.pytest_collection_modifyitems(config, items)  # type: ignore[arg-type]
    if cuda:
        assert [i.name for i in items] == ["cpu_a", "gpu_a", "cpu_b", "gpu_b"] and config.deselected == []
    else:
        assert [i.name for i in items] == ["cpu_a", "cpu_b"]
        assert [i.name for i in config.deselected] == ["gpu_a", "gpu_b"]


@pytest.mark.slow  # a pytest of its own collecting tests/gpu (~8 s of a core); the hook's test above stays in the default suite
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine runs the GPU tests")
def test_the_gpu_suite_is_reported_deselected_here() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/gpu", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 5, out  # pytest's "no tests collected": all of them were deselected
    assert " deselected" in out and "error" not in out.lower(), out
