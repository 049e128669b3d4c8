"""The recovery matrix (memstore/devtools/recovery_matrix): its catalogue, its page, and its rows run for real.

Fast (default suite): the catalogue is consistent, ``docs/recovery-matrix.md`` lists exactly the catalogue's rows
(fault x configuration), all exact, and one cheap row runs for real. Slow: every row, each exact within the RPO
bound its fault declares. Timings are never compared: they are measurements, not promises.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memstore.devtools.recovery_matrix import report
from memstore.devtools.recovery_matrix.catalogue import FAULTS, Fault
from memstore.devtools.recovery_matrix.scenario import Config, run_row

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
            assert 1 <= c.replicas <= f.hosts(c), f"{f.id}: R={c.replicas} needs at least as many hosts"
            bound = f.max_rpo(c)
            assert bound is None or bound >= 0, f.id


def test_the_page_lists_exactly_the_catalogue_rows_all_exact() -> None:
    page = report.table_rows((DOCS / "recovery-matrix.md").read_text())
    assert [(fid, config) for fid, config, _ in page] == [(f.id, c.label) for f, c in ROWS], (
        "docs/recovery-matrix.md is not current: run python -m memstore.devtools.recovery_matrix"
    )
    assert [fid for fid, _, exact in page if not exact] == []
    data = json.loads((DOCS / "bench" / "recovery-matrix.json").read_text())
    assert report.markdown(data) == (DOCS / "recovery-matrix.md").read_text(), "the page is made from the JSON alone"


def test_a_trainer_sigkill_row_for_real(tmp_path) -> None:  # type: ignore[no-untyped-def]
    fault = next(f for f in FAULTS if f.id == "trainer-sigkill")
    row = run_row(fault, Config(2, False), steps=2, workdir=tmp_path)
    assert row.exact, row.note
    assert row.rpo == 0 and row.restored >= row.committed >= 2
    assert sorted(row.sources) == ["h0", "h1"]  # each rank from its own store's RAM


def test_a_wrong_restore_is_not_exact(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The runner's exactness check is live: a fault that overwrites h0's segments with zeros must not pass."""

    def zero_segments(s) -> None:  # type: ignore[no-untyped-def]
        for path in Path(s.cluster.segment_dir("h0")).glob("seg-*"):
            path.write_bytes(bytes(path.stat().st_size))

    fault = Fault("zeroed", "Zeroed", "h0's segments zeroed at R=1", (Config(1, False),), zero_segments)
    row = run_row(fault, Config(1, False), steps=2, workdir=tmp_path)
    assert not row.ok, row


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "config"), ROWS, ids=[f"{f.id}-R{c.replicas}{'-spill' if c.spill else ''}" for f, c in ROWS])
def test_every_row_recovers_exactly(fault: Fault, config: Config, tmp_path) -> None:  # type: ignore[no-untyped-def]
    row = run_row(fault, config, workdir=tmp_path)
    assert row.exact, row.note
    bound = fault.max_rpo(config)
    assert bound is None or row.rpo <= bound, row
