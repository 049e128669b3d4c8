"""Shared fixtures: real store clusters on 127.0.0.1, reaped at teardown."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from memstore.local_cluster import LocalCluster


@pytest.fixture
def make_cluster(tmp_path) -> Iterator[Callable[..., LocalCluster]]:  # type: ignore[no-untyped-def]
    """Start LocalClusters; every store process is stopped (and reaped) when the test ends."""
    started: list[LocalCluster] = []

    def make(**kwargs: Any) -> LocalCluster:
        cluster = LocalCluster(workdir=tmp_path / f"cluster{len(started)}", **kwargs)
        started.append(cluster)
        return cluster.start()

    yield make
    for cluster in started:
        cluster.stop()
