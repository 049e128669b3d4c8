"""The structure rules CI checks (scripts/check_structure.py) catch what they are for."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_structure", ROOT / "scripts" / "check_structure.py")
assert _spec is not None and _spec.loader is not None
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)


def test_ray_is_imported_only_by_memstore_ray(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(check, "ROOT", tmp_path)
    for rel, text in {
        "memstore/ray/stores.py": "import ray\n",
        "memstore/server/bad.py": "def f():\n    from ray.train import report\n",
        "trainer_client/ok.py": "import rayon_not_ray\nfrom . import ray\n",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    files = sorted(tmp_path.rglob("*.py"))
    assert check.misplaced_imports(files) == ["memstore.server.bad imports ray: only memstore.ray may (it is an optional extra)"]


def test_prometheus_client_is_imported_only_by_the_metrics_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(check, "ROOT", tmp_path)
    for rel, text in {
        "memstore/server/metrics.py": "from prometheus_client import Counter\n",
        "memstore/server/saving.py": "import prometheus_client.core\n",
        "memstore/server/metrics_extra.py": "def f():\n    from prometheus_client import Gauge\n",
        "memstore/server/events.py": "from memstore.server import metrics\n",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    files = sorted(tmp_path.rglob("*.py"))
    why = "only memstore.server.metrics may (the engine reports through memstore.server.events)"
    assert check.misplaced_imports(files) == [
        f"memstore.server.metrics_extra imports prometheus_client: {why}",
        f"memstore.server.saving imports prometheus_client: {why}",
    ]


def test_the_tree_meets_every_rule() -> None:
    assert check.main() == 0
