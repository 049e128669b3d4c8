"""What memstore asks Ray's control plane (the GCS): the alive nodes, the draining nodes, and the store records.

The one module of memstore that uses Ray APIs that are not public: the GCS key-value store
(``ray.experimental.internal_kv``, which Ray's own libraries use for the same purpose) and the list of
draining nodes (``ray._private.state``, which Ray Train uses for preemption). Tested with the Ray version
the ``[ray]`` extra pins the floor of; the ray tests fail loudly if either API moves.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field

import ray
from ray.experimental import internal_kv

from memstore.errors import ConfigError, DiscoveryError
from memstore.ray.records import RECORD_PREFIX, StoreRecord, namespace_problem, record_key

log = logging.getLogger(__name__)

KV_NAMESPACE_PREFIX = "memstore."
GCS_TIMEOUT = 10.0
SETTINGS_KEY = "settings"
TOKEN_KEY = "auth/cluster-token"


@dataclass(frozen=True)
class Node:
    node_id: str  # hex
    ip: str
    labels: dict[str, str] = field(default_factory=dict)


def alive_nodes() -> dict[str, Node]:
    """The nodes Ray reports alive, by node id (hex)."""
    out: dict[str, Node] = {}
    for n in ray.nodes():
        if n.get("Alive"):
            out[n["NodeID"]] = Node(n["NodeID"], n["NodeManagerAddress"], dict(n.get("Labels") or {}))
    return out


def draining_nodes() -> dict[str, int]:
    """Nodes Ray is draining (autoscaler scale-down, preemption notice): node id -> deadline (ms since the epoch, 0 = none)."""
    from ray._private import state

    return dict(state.state.get_draining_nodes())


def current_node_id() -> str:
    return ray.get_runtime_context().get_node_id()


class Registry:
    """The store records of one memstore cluster (``namespace``) in the GCS key-value store."""

    def __init__(self, namespace: str) -> None:
        problem = namespace_problem(namespace)
        if problem:
            raise ConfigError(f"memstore.ray: {problem}")
        self.namespace = namespace
        self._kv_namespace = KV_NAMESPACE_PREFIX + namespace

    def put(self, record: StoreRecord) -> None:
        internal_kv._internal_kv_put(record_key(record.node_id), record.encode(), overwrite=True, namespace=self._kv_namespace)

    def delete(self, node_id: str) -> None:
        internal_kv._internal_kv_del(record_key(node_id), namespace=self._kv_namespace)

    def get(self, node_id: str) -> StoreRecord | None:
        data = internal_kv._internal_kv_get(record_key(node_id), namespace=self._kv_namespace)
        return None if data is None else StoreRecord.decode(data, self._where(node_id))

    def records(self) -> dict[str, StoreRecord]:
        """Every record, by node id; one that does not parse is logged and left out (the others still count)."""
        keys = internal_kv._internal_kv_list(RECORD_PREFIX, namespace=self._kv_namespace)
        if not keys:
            return {}
        client = internal_kv.internal_kv_get_gcs_client()
        values = client.internal_kv_multi_get(list(keys), self._kv_namespace.encode(), timeout=GCS_TIMEOUT)
        out: dict[str, StoreRecord] = {}
        for key, data in values.items():
            node_id = key.decode(errors="replace")[len(RECORD_PREFIX) :]
            try:
                record = StoreRecord.decode(data, self._where(node_id))
            except DiscoveryError as exc:
                log.warning("%s", exc)
                continue
            if record.node_id != node_id:
                log.warning("%s holds the record of node %s; ignored", self._where(node_id), record.node_id)
                continue
            out[record.node_id] = record
        return out

    def put_settings(self, settings: bytes) -> None:
        """The settings ``ensure_stores`` started the stores with (JSON), for stores started later on new nodes."""
        internal_kv._internal_kv_put(SETTINGS_KEY, settings, overwrite=True, namespace=self._kv_namespace)

    def settings(self) -> bytes | None:
        return internal_kv._internal_kv_get(SETTINGS_KEY, namespace=self._kv_namespace)

    def cluster_token(self) -> str | None:
        """The cluster token ``ensure_stores`` created for this memstore cluster (None: none yet)."""
        data = internal_kv._internal_kv_get(TOKEN_KEY, namespace=self._kv_namespace)
        return None if data is None else data.decode()

    def create_cluster_token(self) -> str:
        """The cluster token: the one kept in the GCS, else a new one put there (the first caller's wins a race)."""
        internal_kv._internal_kv_put(TOKEN_KEY, secrets.token_urlsafe(32).encode(), overwrite=False, namespace=self._kv_namespace)
        token = self.cluster_token()
        assert token is not None
        return token

    def clear(self) -> None:
        internal_kv._internal_kv_del(b"", del_by_prefix=True, namespace=self._kv_namespace)

    def _where(self, node_id: str) -> str:
        return f"Ray GCS record {record_key(node_id)!r} of memstore cluster {self.namespace!r}"
