"""The property tests (tests/unit/test_properties.py) at four times the default suite's budgets, in the slow stage."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve()


@pytest.mark.timeout(900)
def test_the_properties_hold_at_four_times_the_budget() -> None:
    env = {**os.environ, "MEMSTORE_PROPERTY_SCALE": "4"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", str(HERE.parent / "test_properties.py")],
        cwd=HERE.parents[2], env=env, capture_output=True, text=True, timeout=840,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
