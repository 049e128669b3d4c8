"""The README's main job, `memstore demo`, on a small setting: DDP over gloo, a host SIGKILLed, bit-exact resume."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.slow  # ~50 s on 2 cores; host loss under DDP stays in the default suite (test_exact_resume, test_recovery)
def test_demo_survives_host_loss_bit_exactly() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "memstore", "demo", "--hosts", "3", "--steps", "12", "--kill-at", "6", "--model-size", "tiny"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bit-identical to the uninterrupted run" in proc.stdout
    assert "from peer RAM" in proc.stdout  # the lost host's rank came back from its group peer


def test_demo_rejects_bad_options() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "memstore", "demo", "--steps", "5", "--kill-at", "9"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "--kill-at" in proc.stdout
