"""The Janitor alone: retention over the catalog, with the cluster's holdings and the durable tier faked."""

from __future__ import annotations

import threading
import time

import pytest

from memstore.core.model import Holding, ShardKey
from memstore.server import janitor as janitor_module
from memstore.server.janitor import Janitor
from tests.unit.engine_fakes import captured, config, make_catalog, settled

pytestmark = pytest.mark.unit
DATA = bytes(range(256)) * 32  # 8 KiB


def janitor(holdings: list[Holding]):  # type: ignore[no-untyped-def]
    cfg = config(keep="2")
    catalog, _, stop = make_catalog(cfg)
    asked: list[str] = []

    def cluster_holdings(job: str) -> tuple[list[Holding], list[str]]:
        asked.append(job)
        return holdings, []

    return Janitor(catalog, cfg, cluster_holdings, stop, threading.Event()), catalog, asked


def test_retention_keeps_k_and_asks_the_cluster_only_when_something_would_go() -> None:
    jan, catalog, asked = janitor([])
    for step in (1, 2):
        settled(catalog, ShardKey("job", step, 0), DATA, created=float(step))
    jan.apply_retention()
    assert asked == []  # two steps, keep 2: nothing to decide
    settled(catalog, ShardKey("job", 3, 0), DATA, created=3.0)
    jan.apply_retention()
    assert asked == ["job"] and sorted(k.step for k, _, _ in catalog.held("job")) == [2, 3]


def test_the_durable_tier_keeps_steps_due_for_spilling() -> None:
    class Durable:
        def protected_steps(self, job: str) -> set[int]:
            return {1}

    jan, catalog, _ = janitor([])
    jan.durable = Durable()  # type: ignore[assignment]
    for step in (1, 2, 3):
        settled(catalog, ShardKey("job", step, 0), DATA, created=float(step))
    jan.apply_retention()
    assert sorted(k.step for k, _, _ in catalog.held("job")) == [1, 2, 3]


def test_a_pass_frees_what_expired_leases_held(monkeypatch: pytest.MonkeyPatch) -> None:
    jan, catalog, _ = janitor([])
    entry = captured(catalog, ShardKey("job", 1, 0), DATA)
    catalog.lease_allocation(entry, ahead=False)  # a trainer that allocated and crashed
    jan.pass_once()
    assert catalog.pool.used == len(DATA)  # type: ignore[attr-defined]  # not expired yet
    later = time.monotonic() + 3600
    monkeypatch.setattr(janitor_module.time, "monotonic", lambda: later)
    jan.pass_once()
    assert catalog.pool.used == 0  # type: ignore[attr-defined]


def test_a_timeline_resaved_from_an_older_step_supersedes_the_abandoned_steps() -> None:
    cfg = config(keep="3")
    catalog, _, stop = make_catalog(cfg)
    keys = [ShardKey("job", 1, 0, "A.0"), ShardKey("job", 2, 0, "A.0"), ShardKey("job", 3, 0, "A.0"), ShardKey("job", 2, 0, "B.0")]
    for i, k in enumerate(keys):
        settled(catalog, k, DATA, created=float(i + 1))
    view = [Holding("h0", k, 1, True, float(i + 1)) for i, k in enumerate(keys)]
    Janitor(catalog, cfg, lambda job: (view, []), stop, threading.Event()).apply_retention()
    assert sorted(k.version for k, _, _ in catalog.held("job")) == [(1, "A.0"), (2, "B.0")]
