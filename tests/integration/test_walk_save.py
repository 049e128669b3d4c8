"""The save path's walk (``scripts/walk_save.py``) stays short: one steady-state save, on each path, returns to a file it
already left at most 4 times (issue 41), and enters the client and the capture code once each."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("walk_save", ROOT / "scripts" / "walk_save.py")
assert _spec is not None and _spec.loader is not None
walk_save = sys.modules["walk_save"] = importlib.util.module_from_spec(_spec)  # its dataclass looks its module up
_spec.loader.exec_module(walk_save)


def test_each_save_path_returns_to_a_file_it_left_at_most_four_times() -> None:
    walks = {w.path: w for w in walk_save.walks()}
    assert set(walks) == {"shared memory", "remote"}
    for w in walks.values():
        report = w.report()
        assert w.returns <= walk_save.MOST, report
        assert all(w.entered[f] == 1 for f in walk_save.ONCE), report  # the client and the capture code: entered once
        assert w.stays[0][0] == "trainer_client/client.py" and "trainer_client/handles.py" in w.entered, report
    assert "trainer_client/capture/ring.py" in walks["shared memory"].entered  # the walk followed each path
    assert "trainer_client/transport/remote.py" in walks["remote"].entered
