"""The chaos run: real DDP training under seeded random kills of stores, trainers and whole groups."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.fault


def chaos(tmp_path, seed: int, steps: int, faults: int) -> dict:  # type: ignore[no-untyped-def, type-arg]
    report = tmp_path / f"chaos-{seed}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "memstore", "chaos", "--seed", str(seed), "--steps", str(steps), "--faults", str(faults),
         "--report", str(report), "--timeout", "200"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "bit-identical to the fault-free run" in proc.stdout
    data: dict = json.loads(report.read_text())  # type: ignore[type-arg]
    assert data["ok"] and data["mixed_restores"] == 0 and data["hangs"] == 0
    assert len(data["faults"]) >= 1
    return data


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_a_long_chaos_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # One run of 36 steps and 6 faults (~1.8 min on 2 idle cores; 48 and 8 took 2.3, 4.4 beside another slow file)
    # rather than a short one and three of 40 steps (6.3 min): the slow stage must fit CI's 40 minutes, and
    # `memstore chaos --seed N` runs any other schedule by hand. The default suite keeps the schedule check.
    data = chaos(tmp_path, seed=2, steps=36, faults=6)
    assert len(data["faults"]) >= 4


def test_chaos_schedule_is_reproducible() -> None:
    import random

    from memstore.demo.chaos_run import _schedule

    assert _schedule(random.Random(7), 30, 4, 4) == _schedule(random.Random(7), 30, 4, 4)
    assert _schedule(random.Random(7), 30, 4, 4) != _schedule(random.Random(8), 30, 4, 4)
