"""Start, find and stop the store actors of a Ray cluster: one detached actor per alive node.

``ensure_stores`` is idempotent: called again (after nodes joined), it starts only the missing stores. It
also records its settings in the GCS, so ``local_store_address`` can start the store of a node that joined
after the last ``ensure_stores`` (a replacement node on which Ray Train restarts a worker).

Security needs no setup: unless given an ``auth_token_file``, ``ensure_stores`` creates a cluster token, keeps
it in the GCS key-value store of the memstore cluster (readable by what runs on the Ray cluster, never written
to a file the actors keep or logged), and every store starts with authentication on. Trainers get it from
``local_store_connection`` (``RayTrainCheckpoints`` uses it), operators from ``store_credentials``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from memstore.errors import ConfigError, RayStoreError
from memstore.ray import gcs
from memstore.ray.actor import CLUSTER_TOKEN_FILE, StoreActor, store_config, uses_cluster_token
from memstore.ray.records import actor_name, domain_of, host_id_for
from memstore.v1.security import Credentials
from trainer_client import knobs
from trainer_client.connection import Connection

DEFAULT_NAMESPACE = "memstore"
_RemoteStore = ray.remote(StoreActor)


def _settings(replicas: int, capacity: int | str, spill: str | None, config: Mapping[str, Any] | None) -> dict[str, Any]:
    settings: dict[str, Any] = {"replicas": replicas, "capacity": capacity}
    if spill:
        settings["spill"] = spill
    reserved = {"host_id", "listen", "peers", "peers_file", "discovery", "failure_domain", "failure_domains"}
    clash = sorted(reserved & set(config or {}))
    if clash:
        raise ConfigError(f"ensure_stores(config=...): {', '.join(clash)} are set by memstore.ray for each node, not by config")
    settings.update(config or {})
    try:
        json.dumps(settings)
    except TypeError as exc:
        raise ConfigError(f"ensure_stores: settings must be plain values (numbers, strings, booleans): {exc}") from None
    return settings


def _check(settings: dict[str, Any], nodes: Mapping[str, gcs.Node], domain_label: str) -> None:
    """Build the StoreConfig each node's actor will build, with the node's IP: what a store would refuse (a value, a
    combination, a routable --listen without a token) raises ConfigError here, in the caller, before any actor starts."""
    token_file = CLUSTER_TOKEN_FILE if uses_cluster_token(settings) else ""
    for node in nodes.values():
        store_config(settings, host_id_for(node.node_id), node.ip, domain_of(node.labels, domain_label), token_file)


def _start(namespace: str, node: gcs.Node, settings: dict[str, Any], domain_label: str) -> Any:
    """The store actor of ``node``: the running one, or a new one pinned to the node (hard affinity)."""
    return _RemoteStore.options(  # type: ignore[attr-defined]
        name=actor_name(node.node_id),
        namespace=namespace,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_concurrency=8,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
    ).remote(namespace, settings, domain_of(node.labels, domain_label))


def _addresses(handles: Mapping[str, Any], timeout: float) -> dict[str, str]:
    out: dict[str, str] = {}
    refs = {node_id: h.address.remote() for node_id, h in handles.items()}
    deadline = time.monotonic() + timeout
    for node_id, ref in refs.items():
        try:
            out[node_id] = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            raise RayStoreError(f"the memstore store on Ray node {node_id} did not start within {timeout:.0f}s") from None
        except ray.exceptions.RayActorError as exc:
            raise RayStoreError(f"the memstore store on Ray node {node_id} failed to start: {exc}") from None
    return out


def ensure_stores(
    replicas: int = 2,
    capacity: int | str = "4GiB",
    spill: str | None = None,
    *,
    namespace: str = DEFAULT_NAMESPACE,
    config: Mapping[str, Any] | None = None,
    failure_domain_label: str = "",
    timeout: float = 120.0,
) -> dict[str, str]:
    """Start a memstore store on every alive Ray node that has none; returns ``{node id: store address}``.

    Args:
        replicas: ``--replicas`` of every store.
        capacity: ``--capacity`` of every store.
        spill: ``--spill`` of every store.
        namespace: the Ray namespace of the store actors, and the name of this memstore cluster (two
            namespaces are two independent clusters).
        config: any other ``memstore serve`` setting by its field name (``{"keep": 3, "spill_every_steps": 100}``).
        failure_domain_label: a Ray node label (e.g. ``ray.io/availability-zone``) whose value is the node's
            failure domain; placement then spreads copies across domains.
        timeout: seconds to wait for the stores to serve.

    Authentication is always on: unless ``config`` names an ``auth_token_file`` (the user's, present on every
    node; trainers then need it too, e.g. ``MEMSTORE_AUTH_TOKEN_FILE``), the stores use a cluster token created
    on the first call and kept in Ray's GCS; trainers get it from ``local_store_connection``. Every setting is
    checked here, with each node's IP, before any actor starts: what a store would refuse raises ``ConfigError``
    with the store's message.

    Nodes Ray is draining get no new store. The settings of the first call are kept in Ray's GCS and used for
    stores started later by ``local_store_address``; a later call with other settings replaces them for new
    stores only (running stores keep theirs).
    """
    if not ray.is_initialized():
        ray.init()
    settings = _settings(replicas, capacity, spill, config)
    registry = gcs.Registry(namespace)
    alive = gcs.alive_nodes()
    draining = gcs.draining_nodes()
    _check(settings, alive, failure_domain_label)
    if uses_cluster_token(settings):
        registry.create_cluster_token()  # kept if the cluster has one: running stores hold it
    registry.put_settings(json.dumps({"settings": settings, "failure_domain_label": failure_domain_label}).encode())
    handles = {nid: _start(namespace, node, settings, failure_domain_label) for nid, node in alive.items() if nid not in draining}
    addresses = _addresses(handles, timeout)
    for node_id in registry.records():
        if node_id not in alive:
            registry.delete(node_id)  # a dead node's record: its store is gone with it
    return addresses


def store_addresses(namespace: str = DEFAULT_NAMESPACE) -> dict[str, str]:
    """``{node id: address}`` of the serving stores on alive nodes (drained stores excluded)."""
    alive = gcs.alive_nodes()
    return {nid: r.address for nid, r in gcs.Registry(namespace).records().items() if nid in alive}


def local_store_address(namespace: str = DEFAULT_NAMESPACE, timeout: float = 60.0) -> str:
    """The address of the store on the node this code runs on (in a Ray task, actor or Ray Train worker).

    A node that joined after the last ``ensure_stores`` gets its store now, with the settings of that call.
    The store wants a token: ``local_store_connection`` gives the address with the credentials.
    """
    if not ray.is_initialized():
        raise RayStoreError("memstore.ray.local_store_address() runs inside Ray (a task, an actor, a Ray Train worker)")
    registry = gcs.Registry(namespace)
    node_id = gcs.current_node_id()
    record = registry.get(node_id)
    if record is not None:
        return record.address
    saved = registry.settings()
    if saved is None:
        raise RayStoreError(
            f"no memstore store on Ray node {node_id} (memstore cluster {namespace!r}): call memstore.ray.ensure_stores() first"
        )
    if node_id in gcs.draining_nodes():
        raise RayStoreError(f"Ray node {node_id} is being drained: its memstore store has left; save from another node")
    doc = json.loads(saved)
    node = gcs.alive_nodes()[node_id]
    label = doc.get("failure_domain_label", "")
    _check(doc["settings"], {node_id: node}, label)  # this node's IP may be refused where the others' were not
    handle = _start(namespace, node, doc["settings"], label)
    return _addresses({node_id: handle}, timeout)[node_id]


def store_credentials(namespace: str = DEFAULT_NAMESPACE) -> Credentials:
    """What to present to the stores of ``namespace``: the environment's credentials (``MEMSTORE_AUTH_TOKEN[_FILE]``,
    ``MEMSTORE_TLS_*``), with the cluster token ``ensure_stores`` keeps in Ray's GCS when they name no token.

    Runs anywhere connected to the Ray cluster (the driver, a task, an actor). The token is a secret: do not log it.
    """
    credentials = knobs.credentials()
    if credentials.token:
        return credentials
    token = gcs.Registry(namespace).cluster_token()
    return dataclasses.replace(credentials, token=token) if token else credentials


def local_store_connection(
    connection: Connection | None = None, *, namespace: str = DEFAULT_NAMESPACE, timeout: float = 60.0
) -> Connection:
    """A :class:`trainer_client.Connection` to the store on this node, with the credentials to use it: what
    ``connection`` leaves out (its address, its credentials) comes from ``local_store_address`` and
    ``store_credentials``. Runs where ``local_store_address`` does (a task, an actor, a Ray Train worker)::

        with CheckpointClient("my-job", rank, world, connection=memstore.ray.local_store_connection()) as client:
            ...
    """
    connection = connection if connection is not None else Connection()
    if connection.address is None:
        connection = dataclasses.replace(connection, address=local_store_address(namespace, timeout))
    if connection.credentials is None:
        connection = dataclasses.replace(connection, credentials=store_credentials(namespace))
    return connection


def stop_stores(namespace: str = DEFAULT_NAMESPACE, timeout: float = 30.0) -> int:
    """Stop every store actor of ``namespace`` and forget its records: every shard in memstore's RAM goes
    (spilled steps stay on the durable tier). Returns how many stores were stopped."""
    registry = gcs.Registry(namespace)
    stopped = 0
    for node_id in gcs.alive_nodes():
        try:
            handle = ray.get_actor(actor_name(node_id), namespace=namespace)
        except ValueError:
            continue  # no store on this node
        try:
            ray.get(handle.shutdown.remote(), timeout=timeout)
        except ray.exceptions.RayError:
            pass  # already dead: killing it below is all that is left
        ray.kill(handle)
        stopped += 1
    registry.clear()
    return stopped
