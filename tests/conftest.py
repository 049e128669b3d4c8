"""Shared fixtures: real store clusters on 127.0.0.1, reaped at teardown."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from memstore.testing import LocalCluster
from tests.harness.fake_cuda import FakeCudaRuntime
from tests.harness.inprocess import InProcessCluster
from tools.s3_server import MotoServer
from trainer_client.capture import cuda

C = TypeVar("C", bound=LocalCluster)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect (not skip) the tests marked ``gpu`` where torch sees no CUDA device.

    A deselected test is reported as such ("N deselected"), never as passed or skipped, so a run without a
    GPU cannot be mistaken for one that exercised the GPU paths (tests/gpu/).
    """
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu or _cuda_available():
        return
    config.hook.pytest_deselected(items=gpu)
    items[:] = [item for item in items if item.get_closest_marker("gpu") is None]


@pytest.fixture
def dns_server() -> Iterator[Any]:
    """A real DNS server on 127.0.0.1 whose records the test sets (tools/dns_server.py), for --discovery dns://."""
    from tools.dns_server import DnsServer

    server = DnsServer()
    try:
        yield server
    finally:
        server.stop()


def _clusters(kind: type[C], tmp_path: Path) -> Iterator[Callable[..., C]]:
    started: list[C] = []

    def make(**kwargs: Any) -> C:
        cluster = kind(workdir=tmp_path / f"cluster{len(started)}", **kwargs)
        started.append(cluster)
        cluster.start()
        return cluster

    try:
        yield make
    finally:
        for cluster in started:
            # The test is over: SIGKILL (or stop at once) instead of a drain, which would flush to a durable tier
            # that the test may have stopped already (15 s per S3 test) and push lone shards to peers.
            for host_id in cluster.stores:
                cluster.kill(host_id)
            cluster.stop()


@pytest.fixture
def make_cluster(tmp_path) -> Iterator[Callable[..., LocalCluster]]:  # type: ignore[no-untyped-def]
    """Start LocalClusters (a process per store); every store process is stopped (and reaped) when the test ends.
    For tests where a process boundary is the point: a SIGKILL, a crash that leaves shared memory, fault points."""
    yield from _clusters(LocalCluster, tmp_path)


@pytest.fixture
def make_inprocess_cluster(tmp_path) -> Iterator[Callable[..., InProcessCluster]]:  # type: ignore[no-untyped-def]
    """Start InProcessClusters (stores on threads of the test process, real gRPC on 127.0.0.1,
    tests/harness/inprocess.py); every store is stopped when the test ends. The default for cluster tests."""
    yield from _clusters(InProcessCluster, tmp_path)


@pytest.fixture
def moto(tmp_path) -> Iterator[MotoServer]:  # type: ignore[no-untyped-def]
    """A real S3-compatible server (moto, tools/s3_server.py) on 127.0.0.1 with a bucket "ckpt"."""
    server = MotoServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def fake_cuda() -> Iterator[FakeCudaRuntime]:
    """The CUDA runtime replaced, for this test, by a fake that enforces real CUDA's registration rules and registers
    CPU states' memory too (``tests/harness/fake_cuda.py``): the pinning path runs without a GPU."""
    with cuda.installed(FakeCudaRuntime()) as runtime:
        assert isinstance(runtime, FakeCudaRuntime)
        yield runtime
