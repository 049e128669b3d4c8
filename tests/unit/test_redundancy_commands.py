"""--redundancy through the commands that start stores: LocalCluster, local-cluster and demo (issue 42)."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

import pytest

from memstore.cli import serve
from memstore.cli.common import resolve_redundancy
from memstore.config import StoreConfig
from memstore.demo.showcase import run_demo
from memstore.errors import ConfigError
from memstore.testing import LocalCluster

pytestmark = pytest.mark.unit


def _store_config(args: list[str]) -> StoreConfig:
    """What a LocalCluster store's command line gives ``memstore serve`` (the store's own parser and loader)."""
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    ns = parser.parse_args(args[args.index("serve") + 1 :])
    return StoreConfig.load({f.name: getattr(ns, f.name) for f in fields(StoreConfig)}, env={})


def test_local_cluster_passes_the_redundancy_to_every_store(tmp_path: Path) -> None:
    cluster = LocalCluster(hosts=5, redundancy="ec:4+1", workdir=tmp_path / "c")  # not started
    assert (cluster.redundancy, cluster.replicas) == ("ec:4+1", 1)
    for sp in cluster.stores.values():
        assert "--replicas" not in sp.args
        config = _store_config(sp.args)
        assert (str(config.redundancy), config.replicas, len(config.peers)) == ("ec:4+1", 1, 5)


def test_local_cluster_without_redundancy_keeps_replicas(tmp_path: Path) -> None:
    cluster = LocalCluster(hosts=3, replicas=3, workdir=tmp_path / "c")
    args = cluster.stores["h0"].args
    assert args[args.index("--replicas") + 1] == "3" and "--redundancy" not in args
    assert str(_store_config(args).redundancy) == "replicas:3"


@pytest.mark.parametrize(("hosts", "text", "message"), [(4, "ec:4+1", "needs at least 5 hosts"), (5, "ec:4", "'ec:4' is invalid")])
def test_local_cluster_refuses_what_cannot_run(tmp_path: Path, hosts: int, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LocalCluster(hosts=hosts, redundancy=text, workdir=tmp_path / "c")


def test_commands_resolve_replicas_and_redundancy() -> None:
    assert resolve_redundancy(None, None) == "replicas:2"
    assert resolve_redundancy(3, None) == "replicas:3"
    assert resolve_redundancy(None, "ec:4+1") == "ec:4+1"
    assert resolve_redundancy(2, "replicas:2") == "replicas:2"
    with pytest.raises(ConfigError, match=r"--replicas 3 and --redundancy ec:4\+1 disagree"):
        resolve_redundancy(3, "ec:4+1")
    with pytest.raises(ConfigError, match="replicas:R"):
        resolve_redundancy(None, "ec:four+1")


def test_demo_refuses_a_group_larger_than_its_hosts(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_demo(hosts=4, redundancy="ec:4+1") == 2  # refused before anything starts
    assert "ec:4+1 needs 5 hosts" in capsys.readouterr().out
    assert run_demo(hosts=4, redundancy="ec:x") == 2
