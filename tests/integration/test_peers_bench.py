"""Smoke test of ``python -m benchmarks.peers``: memstore and DCP on a tiny state, end to end (saves, durable, both
restores in fresh processes, memory, the table and the docs section), so the harness cannot rot. The peers that are
not installed here are reported unavailable with a reason, never as failures. No timing thresholds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.peers.run import load_system, main
from benchmarks.peers.table import BEGIN, END

pytestmark = pytest.mark.integration


@pytest.mark.slow  # two store processes and four fresh restore processes importing torch: ~16 s
@pytest.mark.timeout(180)
def test_memstore_and_dcp_run_end_to_end_and_fill_the_table(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"# title\n\n{BEGIN}\nstale table\n{END}\n\nafter\n")
    out = tmp_path / "peers.json"
    argv = ["--systems", "memstore,dcp", "--states", "tensors", "--size", "1MiB", "--tensors", "4", "--saves", "2"]
    assert main([*argv, "--workdir", str(tmp_path), "--json", str(out), "--docs", str(page)]) == 0

    doc = json.loads(out.read_text())
    assert doc["states"]["tensors"]["tensors"] == 4 and doc["states"]["tensors"]["bytes"] == 1 << 20
    rows = {r["system"]: r for r in doc["rows"]}
    assert set(rows) == {"memstore", "dcp"}
    for name, row in rows.items():
        assert row["available"] and not row.get("error"), (name, row.get("traceback"))
        assert [s["step"] for s in row["saves"]] == [1, 2]
        assert all(0 < s["stall_seconds"] <= s["durable_seconds"] for s in row["saves"]), name
        for kind in ("restore_local", "restore_after_loss"):
            assert row[kind]["verified"] == "bit-exact" and row[kind]["seconds"] > 0, (name, kind)
        assert row["memory"]["trainer"]["rss_after"] > 0
    assert all(s["copies"] == 2 for s in rows["memstore"]["saves"])  # R=2 on the 2 stores
    assert rows["memstore"]["restore_after_loss"]["source_host"] == "h1"  # the saving host h0 was lost
    assert set(rows["memstore"]["memory"]["servers"]) == {"h0", "h1"}

    text = page.read_text()
    assert text.startswith("# title\n") and text.endswith("\nafter\n") and "stale table" not in text
    assert "| memstore | tensors (4 tensors" in text and "| dcp | tensors (4 tensors" in text


def test_a_peer_that_is_not_installed_is_unavailable_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "ml_flashpoint", None)  # import ml_flashpoint raises ImportError
    monkeypatch.setitem(sys.modules, "dlrover", None)
    for name in ("ml-flashpoint", "dlrover"):
        why = load_system(name)
        assert isinstance(why, str) and "ImportError" in why, (name, why)
