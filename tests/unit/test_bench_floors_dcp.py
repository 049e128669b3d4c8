"""The bench's DCP baseline where torch's DCP cannot do what it asks: a staging mode whose async_save (or stager, or
future) raises is reported unavailable, with the reason, in the JSON and the tables, its ratios and target are n/a,
and the run goes on. In this process, on a tiny state: torch's real DCP, with one function patched per test."""

from __future__ import annotations

import io
import json
import sys
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from memstore.bench.floors_dcp import CLOSED_STAGER_HINT, detect_dcp, floor_dcp
from memstore.bench.jsonable import json_default, to_json
from memstore.bench.results import DcpFloor
from memstore.bench.scenario_results import LeakSkipped
from memstore.bench.state import make_state
from memstore.bench.targets import evaluate
from tests.unit.test_bench_results import NB, config, leak, measurement, size_result

pytestmark = pytest.mark.unit

REASON = "KeyError: <class 'type'>"


def _state() -> dict[str, Any]:
    return make_state(1 << 14, seed=1)


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _raising_async_save(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """async_save with 2.13's keywords that raises as torch 2.11's stager did; the list counts its calls."""
    import torch.distributed.checkpoint as dcp

    calls: list[int] = []

    def async_save(state_dict: Any, *, storage_writer: Any = None, async_stager: Any = None, no_dist: bool = False) -> Any:
        calls.append(1)
        raise KeyError(type)

    monkeypatch.setattr(dcp, "async_save", async_save)
    return calls


def test_async_save_that_raises_makes_both_modes_unavailable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = _raising_async_save(monkeypatch)
    floor = floor_dcp(_state(), str(tmp_path), reps=2)  # raised KeyError before
    assert len(calls) == 2  # one try per mode: a mode stops at its first failure
    expected = f"unavailable on torch {_torch_version()}: {REASON}"
    for mode in (floor.default, floor.reused_stager):
        assert mode.unavailable == expected
        assert mode.blocking_seconds is None and mode.total_seconds is None and mode.first_call is None
        assert mode.blocking_p50 is None and mode.total_p50 is None
    assert floor.file_bytes is None and floor.torch == _torch_version()
    data = json.loads(json.dumps(to_json(floor), default=json_default))
    assert data["default"] == {"blocking_seconds": None, "total_seconds": None, "unavailable": expected}
    assert data["reused_stager"]["unavailable"] == expected
    assert not list(tmp_path.iterdir())  # its temporary directory is gone


def test_torch_211_reused_stager_is_unavailable_and_the_default_still_measured(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """torch 2.11's DefaultStager._stage closes its StateDictStager after every stage: the reused stager's second call
    raises KeyError(<class 'type'>) in deepcopy_with_tensor_offload (copying the class ``dict`` from the state dict's
    ``__reduce_ex__``), from torch's own code here."""
    from torch.distributed.checkpoint.staging import DefaultStager

    stage = DefaultStager._stage

    def stage_then_close(self: Any, state_dict: Any, **kwargs: Any) -> Any:
        try:
            return stage(self, state_dict, **kwargs)
        finally:
            self._state_dict_stager.close()  # as torch 2.11 does (pytorch/pytorch#183413)

    monkeypatch.setattr(DefaultStager, "_stage", stage_then_close)
    floor = floor_dcp(_state(), str(tmp_path), reps=2)
    assert floor.default.unavailable is None and floor.default.blocking_seconds and floor.default.blocking_seconds.n == 2
    assert floor.file_bytes and floor.file_bytes > 0  # from the default staging's saves
    reason = floor.reused_stager.unavailable
    assert reason is not None and floor.reused_stager.blocking_seconds is None
    assert reason.startswith(f"unavailable on torch {_torch_version()}: {REASON} in torch's DCP stager")
    assert "(_state_dict_stager.py, deepcopy_with_tensor_offload)" in reason and reason.endswith(CLOSED_STAGER_HINT)


def test_old_async_save_without_no_dist_or_async_stager(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """torch 2.4's async_save has neither ``no_dist`` nor ``async_stager``: the default staging is measured without
    them, the reused stager is unavailable (feature-detected, not a TypeError mid-run)."""
    import torch.distributed.checkpoint as dcp

    seen: list[dict[str, Any]] = []

    def async_save(state_dict: Any, *, checkpoint_id: Any = None, storage_writer: Any = None, planner: Any = None,
                   process_group: Any = None) -> Future[Any]:  # fmt: skip
        seen.append({"process_group": process_group, "planner": planner, "checkpoint_id": checkpoint_id})
        fut: Future[Any] = Future()
        fut.set_result(dcp.save(state_dict, storage_writer=storage_writer, no_dist=True))
        return fut

    monkeypatch.setattr(dcp, "async_save", async_save)
    floor = floor_dcp(_state(), str(tmp_path), reps=1)
    assert len(seen) == 1 and floor.default.blocking_seconds is not None and floor.default.unavailable is None
    assert floor.reused_stager.unavailable == (
        f"unavailable on torch {_torch_version()}: torch.distributed.checkpoint.async_save has no async_stager parameter"
    )
    assert "has no no_dist" in floor.process_group


def test_no_default_stager_in_this_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.distributed.checkpoint.staging", None)  # import raises ImportError
    api = detect_dcp()
    assert not isinstance(api, str) and api.new_stager is None
    assert "torch.distributed.checkpoint.staging has no DefaultStager/StagingOptions" in api.no_stager


def test_no_dcp_at_all(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    monkeypatch.delattr(dcp, "async_save")
    floor = floor_dcp(_state(), str(tmp_path), reps=1)
    assert floor.default.unavailable == floor.reused_stager.unavailable
    why = floor.default.unavailable
    assert why is not None and why.startswith(f"unavailable on torch {_torch_version()}: AttributeError"), why


def _with_dcp(dcp_floor: DcpFloor) -> Any:
    info = size_result()
    info.floors.dcp = dcp_floor
    return info


def test_unavailable_dcp_in_ratios_targets_json_and_tables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from rich.console import Console

    from memstore.bench.render import render
    from memstore.bench.results import RunConditions
    from memstore.bench.run_result import assemble

    _raising_async_save(monkeypatch)
    info = _with_dcp(floor_dcp(_state(), str(tmp_path), reps=1))
    reason = f"unavailable on torch {_torch_version()}: {REASON}"

    ra, tg = evaluate(measurement(), info, leak())
    assert ra.stall_p50_over_dcp_async_blocking is None and ra.committed_p50_over_dcp_async_total is None
    assert ra.stall_p50_over_dcp_async_blocking_reused_stager is None
    assert ra.unavailable == {
        "stall_p50_over_dcp_async_blocking": reason,
        "stall_p50_over_dcp_async_blocking_reused_stager": reason,
        "committed_p50_over_dcp_async_total": reason,
    }
    t = tg.stall_vs_dcp_async_save
    assert t.passed is None and t.value is None and t.note == f"n/a: DCP async_save (default staging) {reason}"
    assert ra.stall_p50_over_memcpy == pytest.approx(0.5)  # the other ratios are untouched

    cond = RunConditions(1, "x", 1, None, None, None, None, None, 1.0, None, None, None)
    scenarios = [measurement(), measurement(replicas=1)]
    scenarios[1].headline = False
    result = assemble(config(["--quick"]), "memstore bench --quick", 0.0, {str(NB): info}, scenarios, [], LeakSkipped("--leak-saves 0"),
                      cond, None, [])  # fmt: skip
    data = json.loads(json.dumps(to_json(result), default=json_default))
    assert data["floors"]["dcp"]["default"]["unavailable"] == reason
    assert data["ratios"]["stall_p50_over_dcp_async_blocking"] is None and data["ratios"]["unavailable"] == ra.unavailable
    assert data["targets"]["stall_vs_dcp_async_save"] == {"target": t.target, "value": None, "pass": None, "note": t.note}

    out = io.StringIO()
    render(result, Console(file=out, width=1000))
    text = out.getvalue()
    headline = next(line for line in text.splitlines() if "save() stall p50 vs DCP async_save (blocking)" in line)
    assert f"DCP async_save (default staging) {reason}" in headline and "n/a" in headline and "PASS" not in headline
    assert f"DCP async_save (reused stager) {reason}" in text
    assert "DCP async_save unavailable (see above)" in text
    for label in ("default staging", "reused DefaultStager"):  # the baselines table
        row = next(line for line in text.splitlines() if f"DCP async_save, {label}" in line)
        assert reason in row and "ms" not in row, row
    matrix = next(line for line in text.splitlines() if line.lstrip("│┃ ").startswith("64MiB-2h-R1"))
    assert "n/a" in matrix

    assert to_json(evaluate(measurement(), size_result(), leak())[0]).get("unavailable") is None  # measured: no key

    pytest.importorskip("matplotlib")
    from memstore.bench.plot import write_plot

    write_plot(result, str(tmp_path / "b.png"))
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
