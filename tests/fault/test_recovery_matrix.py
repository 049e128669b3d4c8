"""The recovery matrix (tools/recovery_matrix): its catalogue, its page, and its rows run for real.

Fast (default suite): the catalogue is consistent, ``docs/recovery-matrix.md`` lists exactly the catalogue's rows
(fault x configuration), all exact, and one cheap row runs for real. Slow: every row, each exact within the RPO
bound its fault declares. Timings are never compared: they are measurements, not promises.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tools.recovery_matrix import report
from tools.recovery_matrix.catalogue import FAULTS, Fault
from tools.recovery_matrix.fault import NotRunHere
from tools.recovery_matrix.runner import run_row
from tools.recovery_matrix.scenario import Config, RowResult
from tools.recovery_matrix.state import difference, make_state

pytestmark = pytest.mark.fault
DOCS = Path(__file__).resolve().parents[2] / "docs"
ROWS = [(f, c) for f in FAULTS for c in f.configs]


def test_the_catalogue_is_consistent() -> None:
    ids = [f.id for f in FAULTS]
    assert len(ids) == len(set(ids)), "fault ids are unique"
    assert len({f.name for f in FAULTS}) == len(FAULTS), "fault names are unique"
    for f in FAULTS:
        assert f.configs and len(set(f.configs)) == len(f.configs), f.id
        assert callable(f.inject) and callable(f.recover), f.id
        assert f.description and "|" not in f.description and "|" not in f.name, f.id
        for c in f.configs:
            assert 1 <= c.scheme.group_size <= f.hosts(c), f"{f.id}: {c.label} needs a group's hosts ({c.scheme.group_size})"
            bound = f.max_rpo(c)
            assert bound is None or bound >= 0, f.id


def test_the_page_lists_exactly_the_catalogue_rows_all_exact() -> None:
    page = report.table_rows((DOCS / "recovery-matrix.md").read_text())
    assert [(fid, config) for fid, config, _ in page] == [(f.id, c.label) for f, c in ROWS], (
        "docs/recovery-matrix.md is not current: run python -m tools.recovery_matrix"
    )
    assert [fid for fid, _, exact in page if not exact] == []
    data = json.loads((DOCS / "bench" / "recovery-matrix.json").read_text())
    assert report.markdown(data) == (DOCS / "recovery-matrix.md").read_text(), "the page is made from the JSON alone"


@pytest.mark.slow  # 6 s of real processes: the default suite keeps the checks above; every row runs in the slow stage
def test_a_trainer_sigkill_row_for_real(tmp_path) -> None:  # type: ignore[no-untyped-def]
    fault = next(f for f in FAULTS if f.id == "trainer-sigkill")
    row = run_row(fault, Config(2, False), steps=2, workdir=tmp_path)
    assert row.exact, row.note
    assert row.rpo == 0 and row.restored >= row.committed >= 2
    assert sorted(row.sources) == ["h0", "h1"]  # each rank from its own store's RAM


def test_a_fault_this_machine_cannot_inject_is_not_run_and_says_why(tmp_path) -> None:  # type: ignore[no-untyped-def]
    fault = replace(FAULTS[0], needs=lambda: "needs root (uid 1000)")
    with pytest.raises(NotRunHere, match=r"needs root \(uid 1000\)"):
        run_row(fault, fault.configs[0], workdir=tmp_path)
    assert list(tmp_path.iterdir()) == []  # raised before anything started


def test_the_exactness_check_sees_one_byte_and_a_row_needs_a_restore_within_its_bound() -> None:
    a, b = make_state(1, 5), make_state(1, 5)
    assert difference(a, b) is None
    b["model"]["weight"].view(torch.uint8)[1234] ^= 1
    assert difference(a, b) == "state['model']['weight']: bytes differ"
    assert difference(a, make_state(1, 6)) is not None
    row = RowResult("f", "R=1, spill on", committed=6, restored=4, rpo=2, rto=1.0, exact=True, rpo_bound=6)
    assert row.ok
    assert not replace(row, rpo_bound=1).ok  # beyond the declared bound
    assert not replace(row, restored=0, rpo=6).ok  # nothing restored is within no bound
    assert replace(row, restored=0, rpo=6, rpo_bound=None).ok  # ... unless losing every step is the declared outcome
    assert not replace(row, exact=False, rpo_bound=None).ok


def _slug(c: Config) -> str:
    """A row's configuration in a test id: R2, R2-spill, ec4-1 (``-k ec4-1`` picks the erasure-coded rows)."""
    scheme = c.erasure.replace(":", "").replace("+", "-") or f"R{c.replicas}"
    return scheme + ("-spill" if c.spill else "")


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "config"), ROWS, ids=[f"{f.id}-{_slug(c)}" for f, c in ROWS])
def test_every_row_recovers_exactly(fault: Fault, config: Config, tmp_path) -> None:  # type: ignore[no-untyped-def]
    why_not = fault.needs()
    if why_not:
        pytest.skip(f"not run here: {why_not}")
    row = run_row(fault, config, workdir=tmp_path)
    assert row.exact, row.note
    bound = fault.max_rpo(config)
    assert bound is None or row.rpo <= bound, row
