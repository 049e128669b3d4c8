"""The bench's DCP baseline where torch's DCP cannot do what it asks: a staging mode whose async_save (or stager, or
future) raises is reported unavailable, with the reason, its ratios are n/a with it, and the run goes on. In this
process, on a tiny state: torch's real DCP, with one function patched per test."""

from __future__ import annotations

import sys
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from memstore.bench.baselines_dcp import CLOSED_STAGER_HINT, baseline_dcp, detect_dcp
from memstore.bench.state import make_state
from memstore.bench.targets import evaluate, text_table
from tests.unit.test_bench_targets import document

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


# In the slow stage: the bench smoke (tests/integration/test_bench_smoke.py) measures the same floor on this torch.
@pytest.mark.slow
def test_the_floor_measures_both_stagings_on_this_torch(tmp_path: Path) -> None:
    baseline = baseline_dcp(_state(), str(tmp_path), reps=2)
    assert baseline["default"]["unavailable"] is None and len(baseline["default"]["blocking_seconds"]) == 2
    assert baseline["default"]["blocking_p50"] > 0 and baseline["default"]["total_p50"] >= baseline["default"]["blocking_p50"]
    assert baseline["file_bytes"] and baseline["file_bytes"] > 1 << 14
    assert not list(tmp_path.iterdir())  # its temporary directory is gone


def test_async_save_that_raises_makes_both_modes_unavailable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = _raising_async_save(monkeypatch)
    baseline = baseline_dcp(_state(), str(tmp_path), reps=2)
    assert len(calls) == 2  # one try per mode: a mode stops at its first failure
    expected = f"unavailable on torch {_torch_version()}: {REASON}"
    for mode in (baseline["default"], baseline["reused_stager"]):
        assert mode == {"blocking_seconds": None, "blocking_p50": None, "total_p50": None, "unavailable": expected}
    assert baseline["file_bytes"] is None and baseline["torch"] == _torch_version()
    assert not list(tmp_path.iterdir())


def test_torch_211_reused_stager_is_unavailable_and_the_default_still_measured(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """torch 2.11's DefaultStager._stage closes its StateDictStager after every stage: the reused stager's second call
    raises KeyError(<class 'type'>) in deepcopy_with_tensor_offload, from torch's own code here."""
    from torch.distributed.checkpoint.staging import DefaultStager

    stage = DefaultStager._stage

    def stage_then_close(self: Any, state_dict: Any, **kwargs: Any) -> Any:
        try:
            return stage(self, state_dict, **kwargs)
        finally:
            self._state_dict_stager.close()  # as torch 2.11 does (pytorch/pytorch#183413)

    monkeypatch.setattr(DefaultStager, "_stage", stage_then_close)
    baseline = baseline_dcp(_state(), str(tmp_path), reps=2)
    assert baseline["default"]["unavailable"] is None and len(baseline["default"]["blocking_seconds"]) == 2
    assert baseline["file_bytes"] and baseline["file_bytes"] > 0  # from the default staging's saves
    reason = baseline["reused_stager"]["unavailable"]
    assert reason is not None and baseline["reused_stager"]["blocking_seconds"] is None
    assert reason.startswith(f"unavailable on torch {_torch_version()}: {REASON} in torch's DCP stager")
    assert "(_state_dict_stager.py, deepcopy_with_tensor_offload)" in reason and reason.endswith(CLOSED_STAGER_HINT)


def test_old_async_save_without_no_dist_or_async_stager(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """torch 2.4's async_save has neither ``no_dist`` nor ``async_stager``: the default staging is measured without
    them, the reused stager is unavailable (feature-detected, not a TypeError mid-run)."""
    import torch.distributed.checkpoint as dcp

    seen: list[Any] = []

    def async_save(state_dict: Any, *, checkpoint_id: Any = None, storage_writer: Any = None, planner: Any = None,
                   process_group: Any = None) -> Future[Any]:  # fmt: skip
        seen.append(process_group)
        fut: Future[Any] = Future()
        fut.set_result(dcp.save(state_dict, storage_writer=storage_writer, no_dist=True))
        return fut

    monkeypatch.setattr(dcp, "async_save", async_save)
    baseline = baseline_dcp(_state(), str(tmp_path), reps=1)
    assert len(seen) == 1 and baseline["default"]["blocking_seconds"] and baseline["default"]["unavailable"] is None
    assert baseline["reused_stager"]["unavailable"] == (
        f"unavailable on torch {_torch_version()}: torch.distributed.checkpoint.async_save has no async_stager parameter"
    )
    assert "has no no_dist" in baseline["process_group"]


def test_no_default_stager_in_this_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.distributed.checkpoint.staging", None)  # import raises ImportError
    api = detect_dcp()
    assert not isinstance(api, str) and api.new_stager is None
    assert "torch.distributed.checkpoint.staging has no DefaultStager/StagingOptions" in api.no_stager


def test_no_dcp_at_all(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    monkeypatch.delattr(dcp, "async_save")
    baseline = baseline_dcp(_state(), str(tmp_path), reps=1)
    why = baseline["default"]["unavailable"]
    assert why == baseline["reused_stager"]["unavailable"]
    assert why is not None and why.startswith(f"unavailable on torch {_torch_version()}: AttributeError"), why


def test_unavailable_dcp_makes_its_ratios_na_with_the_reason(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _raising_async_save(monkeypatch)
    doc = document()
    doc["floors"]["dcp"] = baseline_dcp(_state(), str(tmp_path), reps=1)
    reason = f"unavailable on torch {_torch_version()}: {REASON}"
    rows = {r["ratio"]: r for r in evaluate(doc)}
    for name in ("stall_over_dcp_blocking", "stall_over_dcp_blocking_reused_stager"):
        assert rows[name]["value"] is None and rows[name]["pass"] is None and rows[name]["note"] == reason
    assert rows["stall_over_memcpy"]["value"] == pytest.approx(1.25)  # the other ratios are untouched
    line = next(x for x in text_table(list(rows.values())).splitlines() if x.startswith("stall_over_dcp_blocking "))
    assert "n/a" in line and reason in line and "PASS" not in line and "MISS" not in line
