"""Smoke test of ``benchmarks/gpu_capture.py --device cpu``: a real (tiny) training state, every figure of the run and
of the training loop in the JSON, the restores bit-exact. No timing thresholds: CPU figures say nothing of a GPU."""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# Starts a local cluster and a second process for the fresh restore: in the slow stage.
pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_capture.py"
ARGS = ["--device", "cpu", "--state", "model", "--layers", "2", "--dim", "128", "--saves", "6", "--loop", "--steps", "12", "--every", "3"]
TIMEOUT = 240  # seconds; the run takes ~15 s on 2 idle cores


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _run(json_path: Path) -> subprocess.CompletedProcess[str]:
    """The script in its own process group; on a timeout it gets SIGTERM (it stops its cluster), then SIGKILL
    (its stores die with it: PR_SET_PDEATHSIG), and whatever it left in /dev/shm is removed."""
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *ARGS, "--json", str(json_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate(timeout=20)
        pytest.fail(f"benchmarks/gpu_capture.py ran past {TIMEOUT}s:\n{out[-4000:]}")
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)
        for leftover in glob.glob(f"/dev/shm/memstore-{proc.pid}-*"):  # LocalCluster's shm dir, named by the script's pid
            shutil.rmtree(leftover, ignore_errors=True)


@pytest.mark.timeout(TIMEOUT + 60)
def test_gpu_capture_script_on_cpu_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "gpu_capture.json"
    proc = _run(out)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "PASS" in proc.stdout or "MISS" in proc.stdout  # the targets table was printed
    data = json.loads(out.read_text())

    assert data["device"] == "cpu" and data["device_type"] == "cpu" and data["torch"]
    state = data["state"]
    assert state["kind"] == "model" and state["layers"] == 2 and state["dim"] == 128
    assert state["tensors"] == data["tensors"] == 4 * 12 * 2  # 12 parameters a layer, AdamW's step, exp_avg, exp_avg_sq each
    assert state["bytes"] == data["bytes"] > 0
    assert data["cluster"]["hosts"] == 1 and data["cluster"]["replicas"] == 1

    for key in (
        "floor_seconds", "floor_gbps", "h2d_floor_seconds", "h2d_floor_gbps",
        "copied_first_seconds", "copied_first_vs_floor", "prepare_seconds", "prepared_first_seconds", "prepared_first_vs_floor",
        "copied_steady_seconds", "copied_steady_gbps", "copied_steady_vs_floor",
        "enqueued_return_seconds", "enqueued_return_max_seconds", "enqueued_captured_seconds", "enqueued_captured_vs_floor",
        "load_seconds", "load_gbps", "load_vs_h2d_floor", "load_cpu_then_to_seconds",
        "fresh_load_seconds", "fresh_load_vs_h2d_floor", "fresh_process_seconds",
    ):  # fmt: skip
        assert _number(data[key]) and data[key] >= 0, key
    assert data["enqueued_return_seconds"] <= data["enqueued_return_max_seconds"]
    for key in ("registrations", "registrations_steady", "fallbacks", "saves", "superseded", "failed_saves"):
        assert isinstance(data[key], int) and data[key] >= 0, key
    assert data["fallbacks"] == 0 and data["registrations_steady"] == 0  # a CPU state makes no CUDA call
    assert data["saves"] == 1 + 5 + 6 + 5 + 6 + 1  # first, warm-up and steady of each mode, the prepared one
    assert data["failed_saves"] == 0, data["save_errors"]
    assert data["restore_bit_exact"] is True, data["restore_mismatches"]
    assert data["fresh_restore_complete"] is True and data["fresh_restore"]["step"] == data["restored_step"]

    loop = data["loop"]
    assert loop["every"] == [3] and loop["steps"] == 12
    assert _number(loop["baseline"]["median_step_seconds"]) and loop["baseline"]["saves"] == 0
    (run,) = loop["runs"]
    assert run["every"] == 3 and run["saves"] == 4 and run["failed_saves"] == 0, run["save_errors"]
    for key in ("median_step_seconds", "mean_step_seconds", "ratio_median", "ratio_mean", "save_return_max_seconds"):
        assert _number(run[key]) and run[key] > 0, key
    assert loop["final_bit_exact"] is True, loop["final_mismatches"]
    assert loop["final_tensors_compared"] == state["tensors"]
    assert loop["registrations_during_runs"] == 0

    figures = {t["figure"]: t for t in data["targets"]}
    assert len(figures) == 8  # steady capture, enqueued save(), two restores, the loop at k=3 and its registrations,
    #                           registrations after the warm-up, fallbacks
    assert all(t["pass"] in (True, False) for t in figures.values() if t["target"])
    assert figures["loop k=3, mean step / baseline"]["pass"] is None  # the loop's target is for k=25
