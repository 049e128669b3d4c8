"""A plain install works: a fresh venv, `pip install .` (declared dependencies only), then the commands people run first.

Versions are held to requirements/dev.lock with ``-c`` (the CPU torch wheel, no multi-GB CUDA downloads);
what gets installed is decided by pyproject.toml alone, so an import the package needs but does not
declare fails here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# The venv is made in the first test's setup, which pytest-timeout counts: 72 s alone, longer beside another slow file.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]


def run(*cmd: str | Path, cwd: Path | None = None, timeout: float = 900) -> str:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("fresh") / "venv"
    run(sys.executable, "-m", "venv", where)
    pip = where / "bin" / "pip"
    # A copy of the source tree, so the install never writes build/ or *.egg-info into the checkout.
    src = where.parent / "src"
    skip = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", "build", ".mypy_cache", ".ruff_cache", ".pytest_cache")
    shutil.copytree(ROOT, src, ignore=skip)
    run(pip, "install", "--disable-pip-version-check", "-c", ROOT / "requirements" / "dev.lock", src)
    return where


def test_memstore_help_lists_the_commands(venv: Path) -> None:
    out = run(venv / "bin" / "memstore", "--help", cwd=venv.parent)
    for command in ("serve", "local-cluster", "demo", "status", "ls", "bench", "simulate", "export"):
        assert command in out


def test_simulate_runs_with_core_dependencies_only(venv: Path) -> None:
    out_file = venv.parent / "sim.json"
    run(venv / "bin" / "memstore", "simulate", "--hosts", "64", "--json", out_file, cwd=venv.parent)
    data = json.loads(out_file.read_text())
    assert data  # a real result document, written by an install without the dev lock's extras


def test_bench_help_and_a_clear_error_for_the_missing_plot_extra(venv: Path) -> None:
    assert "--size" in run(venv / "bin" / "memstore", "bench", "--help", cwd=venv.parent)
    proc = subprocess.run([str(venv / "bin" / "memstore"), "simulate", "--hosts", "16", "--plot", str(venv.parent / "x.png")],
                          capture_output=True, text=True, timeout=300, cwd=venv.parent)  # fmt: skip
    assert proc.returncode != 0 and "memstore[bench]" in proc.stderr, proc.stderr
