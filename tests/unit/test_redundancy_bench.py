"""benchmarks/redundancy.py without stores: bad numbers are refused by name before anything starts, and the table shows
each scheme's figures."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.unit
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "redundancy.py"


def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("redundancy_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        (["--saves", "0"], "--saves must be at least 1, got 0"),
        (["--restores", "-1"], "--restores must be at least 1, got -1"),
        (["--keep", "0"], "--keep must be at least 1, got 0"),
        (["--size", "4KiB"], "--size must be at least 1MiB, got 4KiB"),
        (["--size", "lots"], "--size 'lots' is invalid"),
        (["--idle-wait", "-5"], "--idle-wait must be at least 0, got -5.0"),
        (["--schemes", "replicas:3"], "--schemes must name some of replicas:2, ec:4+1, got 'replicas:3'"),
    ],
)
def test_bad_numbers_are_refused_by_name(
    flags: list[str], problem: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = script()
    monkeypatch.setattr(bench, "measure_scheme", lambda *a: pytest.fail("a store started"))
    monkeypatch.setattr(sys, "argv", ["redundancy.py", *flags])
    with pytest.raises(SystemExit) as exited:
        bench.main()
    assert exited.value.code == 2 and problem in capsys.readouterr().err


def test_the_table_has_a_line_per_scheme_with_its_figures() -> None:
    bench = script()

    def doc(scheme: str, settled: float, exact: bool) -> dict[str, Any]:
        restore = {"p50": 1.5, "verified_equal": exact}
        return {
            "scheme": scheme, "rank_state_bytes": [256 << 20] * 5, "ram_multiple_peak": settled + 0.25, "ram_multiple_settled": settled,
            "settled_max_store": settled, "ram_multiple_idle": None, "stall_over_memcpy_p50": 1.4, "stall_over_memcpy_max": 5.0,
            "committed_p50": 1.3, "committed_over_tcp_p50": 9.9, "restore_after_host_loss": restore, "host_loss_over_tcp": 5.9,
            "restore_local": restore, "keep": 1,
        }  # fmt: skip

    text = bench.table([doc("replicas:2", 6.0, True), doc("ec:4+1", 3.5, False)])
    title, head, _, replicas, ec = text.splitlines()
    assert "256 MiB per rank, keep 1;" in title and "settled" in head
    assert replicas.split()[:4] == ["replicas:2", "6.25x", "6.00x", "6.00x"] and replicas.split()[-1] == "yes"
    assert ec.split()[:4] == ["ec:4+1", "3.75x", "3.50x", "3.50x"] and "n/a" in ec and ec.split()[-1] == "NO"
