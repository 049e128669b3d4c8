"""memstore bench sizes its stores to hold an explicit --prefault (a store refuses a reserve beyond its capacity)."""

from __future__ import annotations

from typing import Any

import pytest

from memstore.bench import stores

pytestmark = pytest.mark.unit
MiB = 1 << 20


class Recorded:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs

    def start(self) -> None:
        return None


def capacity(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> int:
    monkeypatch.setattr(stores, "LocalCluster", Recorded)
    cluster: Any = stores.start_cluster(2, 2, 2, 128 * MiB, None, env)
    return int(cluster.kwargs["capacity"])


def test_the_stores_hold_an_explicit_prefault_beside_their_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    shards = capacity(monkeypatch, {})
    assert shards == 5 * 128 * MiB + stores.CAPACITY_SLACK  # keep + 3 shards
    assert capacity(monkeypatch, {"MEMSTORE_PREFAULT": "auto"}) == shards
    assert capacity(monkeypatch, {"MEMSTORE_PREFAULT": "256MiB"}) == shards  # fits already
    assert capacity(monkeypatch, {"MEMSTORE_PREFAULT": "1GiB"}) == 1024 * MiB + stores.CAPACITY_SLACK


def test_a_bad_prefault_is_refused_before_any_store_starts(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from memstore.bench import add_arguments

    p = argparse.ArgumentParser(prog="memstore bench")
    add_arguments(p)
    assert p.parse_args(["--prefault", "4100MiB"]).prefault == "4100MiB"
    assert p.parse_args(["--prefault", "auto"]).prefault == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["--prefault", "lots"])
    assert "argument --prefault: size 'lots' is invalid" in capsys.readouterr().err
