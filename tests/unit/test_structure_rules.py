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


RAY = "only memstore.ray may (it is an optional extra)"
PROM = "only memstore.server.metrics may (the engine reports through memstore.server.events)"


@pytest.mark.parametrize(
    ("tree", "expected"),
    [
        pytest.param(
            {
                "memstore/ray/stores.py": "import ray\n",
                "memstore/server/bad.py": "def f():\n    from ray.train import report\n",
                "trainer_client/ok.py": "import rayon_not_ray\nfrom . import ray\n",
            },
            [f"memstore.server.bad imports ray: {RAY}"],
            id="ray only in memstore.ray",
        ),
        pytest.param(
            {
                "memstore/server/metrics.py": "from prometheus_client import Counter\n",
                "memstore/server/saving.py": "import prometheus_client.core\n",
                "memstore/server/metrics_extra.py": "def f():\n    from prometheus_client import Gauge\n",
                "memstore/server/events.py": "from memstore.server import metrics\n",
            },
            [f"memstore.server.{m} imports prometheus_client: {PROM}" for m in ("metrics_extra", "saving")],
            id="prometheus_client only in the metrics module",
        ),
    ],
)
def test_misplaced_imports_are_named(tree: dict[str, str], expected: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(check, "ROOT", tmp_path)
    for rel, text in tree.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert check.misplaced_imports(sorted(tmp_path.rglob("*.py"))) == expected


def _write_tree(root: Path, tree: dict[str, str]) -> list[Path]:
    for rel, text in tree.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return sorted(root.rglob("*.py"))


def test_cross_module_private_imports_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(check, "ROOT", tmp_path)
    files = _write_tree(
        tmp_path,
        {
            "trainer_client/_ring.py": "from trainer_client import _cuda\n_local = 1\n",
            "trainer_client/client.py": "import trainer_client._ring\nfrom trainer_client.format import MAGIC, __all__\n",
            "trainer_client/format/__init__.py": "from .spec import _PRELUDE\n",
            "memstore/demo/chaos_run.py": "def f():\n    from memstore.demo.showcase import _Job\n",
            "examples/train.py": "from torch.distributed.checkpoint.filesystem import _StorageInfo\nfrom ray._private import state\n",
            "benchmarks/ok.py": "from trainer_client.serialization.spec import PRELUDE\n",
        },
    )
    assert check.private_imports(files) == [
        f"{path}: imports {name} ({private} is private: give it a public name in a module whose job it is)"
        for path, name, private in [
            ("memstore/demo/chaos_run.py:2", "memstore.demo.showcase._Job", "_Job"),
            ("trainer_client/_ring.py:1", "trainer_client._cuda", "_cuda"),
            ("trainer_client/client.py:1", "trainer_client._ring", "_ring"),
            ("trainer_client/format/__init__.py:1", "trainer_client.format.spec._PRELUDE", "_PRELUDE"),
        ]
    ]


def test_the_trainer_side_imports_only_the_stores_contract(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(check, "ROOT", tmp_path)
    files = _write_tree(
        tmp_path,
        {
            "trainer_client/client.py": (
                "from memstore.v1 import store_pb2\nfrom memstore.core.model import Manifest\nfrom memstore.errors import ConfigError\n"
                "from memstore.config import StoreConfig\n"
            ),
            "trainer_client/dcp.py": "def f():\n    import memstore.server.store\n    from memstore import faults, v1\n",
            "trainer_client/ok.py": "import memstore_like\nfrom . import errors\n",
            "memstore/cli/main.py": "from memstore.server import store\n",  # not trainer-side
        },
    )
    rule = "trainer_client may import only memstore.v1, memstore.core, memstore.errors from memstore"
    assert check.trainer_imports(files) == [
        f"trainer_client/client.py:4: imports memstore.config (StoreConfig): {rule}",
        f"trainer_client/dcp.py:2: imports memstore.server.store: {rule}",
        f"trainer_client/dcp.py:3: imports memstore.faults: {rule}",
    ]


def test_the_product_never_imports_the_lab_or_the_tests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(check, "ROOT", tmp_path)
    files = _write_tree(
        tmp_path,
        {
            "memstore/testing.py": "def f():\n    from tools.dns_server import DnsServer\n",
            "memstore/bench/rig.py": "import tests.harness.pods\nfrom memstore.testing import LocalCluster\n",
            "trainer_client/dcp.py": "from benchmarks import floors\nfrom .tools import x\nimport toolsy\n",
            "tools/recovery_matrix/scenario.py": "from memstore.testing import LocalCluster\nfrom tools.faultproxy import FaultProxy\n",
            "tests/conftest.py": "from tools.s3_server import MotoServer\n",
        },
    )
    rule = "the wheel ships memstore and trainer_client only"
    assert check.lab_imports(files) == [
        f"memstore/bench/rig.py:1: imports tests.harness.pods: {rule}; tests/ stays in the checkout",
        f"memstore/testing.py:2: imports tools.dns_server: {rule}; tools/ stays in the checkout",
        f"trainer_client/dcp.py:1: imports benchmarks: {rule}; benchmarks/ stays in the checkout",
    ]


def test_the_tree_meets_every_rule() -> None:
    assert check.main() == 0


ENGINE_BASES = "give it the object it needs in its constructor"


def test_inheritance_between_engine_classes_and_mixins_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(check, "ROOT", tmp_path)
    tree = {
        "memstore/server/catalog.py": "class Catalog:\n    pass\n",
        "memstore/server/saving.py": "from memstore.server.catalog import Catalog\n\nclass Saving(Catalog):\n    pass\n",
        "memstore/server/janitor.py": "class Janitor(Recovery, Reading):\n    pass\n",
        "memstore/server/mix.py": "class LeaseMixin:\n    pass\n",
        "memstore/server/fine.py": (
            "from enum import Enum\nfrom typing import Protocol\nfrom memstore.v1 import store_pb2_grpc as pb_grpc\n"
            "class Role(Enum): ...\nclass Port(Protocol): ...\nclass Sub(Port, Protocol): ...\nclass Oops(ValueError): ...\n"
            "class StoreServicer(pb_grpc.StoreServicer): ...\nclass StoreEvents: ...\nclass StoreMetrics(StoreEvents): ...\n"
        ),
        "memstore/spill/elsewhere.py": "class A:\n    pass\n\nclass B(A, dict):\n    pass\n",  # other packages: not this rule's
    }
    for rel, text in tree.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    found = check.inheritance(sorted(tmp_path.rglob("*.py")))
    assert sorted(found) == [
        "memstore.server.janitor.Janitor has 2 bases (Recovery, Reading): no multiple inheritance in memstore/server, compose",
        f"memstore.server.mix.LeaseMixin is a mixin: {ENGINE_BASES}",
        f"memstore.server.saving.Saving inherits from Catalog, a class of memstore/server: {ENGINE_BASES}",
    ]


def test_nothing_below_the_command_line_imports_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(check, "ROOT", tmp_path)
    files = _write_tree(tmp_path, {
        "memstore/__init__.py": "", "memstore/__main__.py": "from memstore.cli import main\n",
        "memstore/cli/__init__.py": "from memstore.cli import common\n", "memstore/cli/common.py": "",
        "memstore/survey.py": "", "memstore/cli/status.py": "from memstore import survey\n",
        "memstore/bench/run.py": "def f():\n    from memstore.cli.common import x\n",
    })  # fmt: skip
    (problem,) = check.cli_imports(check.graph_of(files))
    assert problem.startswith("memstore.bench.run imports memstore.cli.common: only the command line's own modules")


def test_two_pieces_that_import_each_other_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No module cycle, yet the spill tier and the config import each other: what issue 41 found."""
    monkeypatch.setattr(check, "ROOT", tmp_path)
    files = _write_tree(tmp_path, {
        "memstore/__init__.py": "from memstore import config\n",
        "memstore/config.py": "def f():\n    from memstore.spill.storage import parse\n",
        "memstore/spill/__init__.py": "from memstore.config import StoreConfig\n", "memstore/spill/storage.py": "",
        "memstore/server/app.py": "from memstore import config, spill\n",
    })  # fmt: skip
    graph = check.graph_of(files)
    assert check.cycles(graph) == []
    assert check.package_cycles(graph) == [
        "imports run both ways between memstore.config and memstore.spill: one of them must not import the other"
    ]
