"""memstore on a Ray cluster (default suite): a store actor per node found from tasks, tokens, refused settings.

The nodes count as reachable from other machines (conftest: ``MEMSTORE_TEST_LOOPBACK_IS_REMOTE``), so this is the
quick start of docs/ray.md on a cluster with routable IPs: no token is configured, the stores run with the
cluster token ``ensure_stores`` creates, and every client here gets it from ``memstore.ray``.

A 2-node cluster (a head without CPUs, one 1-CPU worker) runs the scenario's first step (``scenario.Scenario``:
stores started) and the settings and token checks. The steps after it (a node lost, replaced, drained; four nodes)
are the slow stage's, in ``test_ray_node_changes.py``.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import ray

import memstore.ray as mray
from memstore.config import StoreConfig
from memstore.errors import ConfigError, RayStoreError
from memstore.ray import gcs
from memstore.ray.records import actor_name
from memstore.v1.security import Credentials
from tests.ray_integration.conftest import RayCluster
from tests.ray_integration.scenario import JOB, SETTINGS, Scenario, refusal
from tests.states import assert_same, rank_state
from trainer_client import CheckpointClient, Connection

pytestmark = pytest.mark.ray

RAY_WORKER_NODES = 1  # the scenario's start needs a store per node, not the four nodes its later steps need


@pytest.fixture(scope="module")
def scenario(ray_cluster: RayCluster) -> Scenario:
    return Scenario(ray_cluster)


def test_one_store_per_node_found_from_tasks(scenario: Scenario) -> None:
    scenario.reach("started")


def test_bad_settings_are_refused_in_the_caller(ray_cluster: RayCluster) -> None:
    with pytest.raises(ConfigError, match="--replicas"):
        mray.ensure_stores(replicas=0)
    with pytest.raises(ConfigError, match="listen"):
        mray.ensure_stores(config={"listen": "127.0.0.1:0"})
    with pytest.raises(ConfigError, match="unknown configuration keys: no_such_flag"):
        mray.ensure_stores(config={"no_such_flag": 1})
    with pytest.raises(ConfigError, match="namespace"):
        mray.ensure_stores(namespace="a:b")
    with pytest.raises(RayStoreError, match="ensure_stores"):
        ray.get(store_here_in.remote("never-started"))


def test_a_setting_a_store_would_refuse_is_refused_in_the_caller_with_its_message(ray_cluster: RayCluster) -> None:
    with pytest.raises(ConfigError) as store_says:
        store = {"host_id": "h", "listen": "127.0.0.1:0", "discovery": "fed", "auth_token_file": "t", "tls_cert": "/c.pem"}
        StoreConfig.load(cli=store, env={})  # what `memstore serve` says
    with pytest.raises(ConfigError) as caller_says:
        mray.ensure_stores(namespace="refused", config={"tls_cert": "/c.pem"})
    assert str(caller_says.value) == str(store_says.value) == "--tls-cert and --tls-key go together"
    for node_id in gcs.alive_nodes():  # refused before any actor started, and before any token or setting was kept
        with pytest.raises(ValueError):
            ray.get_actor(actor_name(node_id), namespace="refused")
    registry = gcs.Registry("refused")
    assert registry.cluster_token() is None and registry.settings() is None and registry.records() == {}


@ray.remote(num_cpus=0)
def store_here_in(namespace: str) -> str:
    try:
        return mray.local_store_address(namespace=namespace)
    except RayStoreError as exc:
        raise RayStoreError(str(exc)) from None


def test_a_token_file_of_the_user_s_still_works(ray_cluster: RayCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "cluster.token"
    path.write_text("user-token-" + "u" * 24)
    path.chmod(0o600)
    namespace = "own-token"
    try:
        addresses = mray.ensure_stores(replicas=1, capacity="32MiB", namespace=namespace,
                                       config={**SETTINGS, "shm_dir": ray_cluster.shm_dir, "auth_token_file": str(path)})  # fmt: skip
        assert gcs.Registry(namespace).cluster_token() is None  # the user's token wins: no cluster token is made
        user = Credentials(token=path.read_text())
        for address in addresses.values():
            assert refusal(address, user) is None
            assert refusal(address, Credentials()) == grpc.StatusCode.UNAUTHENTICATED
        monkeypatch.setenv("MEMSTORE_AUTH_TOKEN_FILE", str(path))  # how trainers get the user's token, as before
        assert mray.store_credentials(namespace) == user
        address = next(iter(addresses.values()))
        with CheckpointClient(JOB, 0, 1, connection=Connection(address, timeout=20, credentials=mray.store_credentials(namespace))) as c:
            c.save(1, rank_state(0, 1)).wait(timeout=30)
            assert_same(c.load(1, zero_copy=False), rank_state(0, 1))
    finally:
        mray.stop_stores(namespace)
