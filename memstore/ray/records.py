"""The plain-Python part of the Ray integration: names, the store records kept in Ray's GCS, and the membership
they make. No Ray import: the rules are unit-tested without a Ray cluster.

- A store runs as the detached actor ``memstore-store-<node id>`` in the namespace given to ``ensure_stores``.
- Its host id is ``ray-`` plus the first 12 hex digits of the node id: a node that comes back has a new node id,
  so it is a new member, which takes a vacant slot (the lost node's) and is filled by repair.
- Each store publishes a :class:`StoreRecord` (JSON) under ``store/<node id>`` once it serves. The members are
  the records of alive nodes, minus those that left (a drained store removes its record).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

from memstore.errors import DiscoveryError
from memstore.membership.members import Member, Members, members_from

ACTOR_PREFIX = "memstore-store-"
RECORD_PREFIX = "store/"
HOST_ID_PREFIX = "ray-"
_NODE_ID = re.compile(r"[0-9a-f]{16,128}")


_NAMESPACE = re.compile(r"[A-Za-z0-9._-]{1,64}")


def namespace_problem(namespace: object) -> str | None:
    if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
        return f"namespace {namespace!r} is invalid: expected 1-64 characters of [A-Za-z0-9._-]"
    return None


def node_id_problem(node_id: object) -> str | None:
    if not isinstance(node_id, str) or not _NODE_ID.fullmatch(node_id):
        return f"Ray node id {node_id!r} is invalid: expected 16-128 lowercase hex digits"
    return None


def host_id_for(node_id: str) -> str:
    """The memstore host id of the store on Ray node ``node_id``."""
    problem = node_id_problem(node_id)
    if problem:
        raise DiscoveryError(problem)
    return HOST_ID_PREFIX + node_id[:12]


def actor_name(node_id: str) -> str:
    return ACTOR_PREFIX + node_id


def record_key(node_id: str) -> str:
    return RECORD_PREFIX + node_id


@dataclass(frozen=True)
class StoreRecord:
    """What a store actor publishes about itself once it serves."""

    node_id: str
    host_id: str
    address: str  # HOST:PORT of its gRPC endpoint
    domain: str = ""  # failure-domain label (from a node label, when ensure_stores names one)

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes, where: str) -> StoreRecord:
        """The record in ``data``; DiscoveryError naming ``where`` and what is wrong."""
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise DiscoveryError(f"{where}: not a store record (invalid JSON: {exc})") from None
        keys = {"node_id", "host_id", "address", "domain"}
        if not isinstance(doc, dict) or not {"node_id", "host_id", "address"} <= set(doc) or set(doc) - keys:
            raise DiscoveryError(f"{where}: not a store record: expected an object with node_id, host_id, address (and domain)")
        if not all(isinstance(doc[k], str) for k in doc):
            raise DiscoveryError(f"{where}: not a store record: every field must be a string")
        record = cls(**doc)
        problem = node_id_problem(record.node_id)
        if problem:
            raise DiscoveryError(f"{where}: {problem}")
        if record.host_id != host_id_for(record.node_id):
            raise DiscoveryError(f"{where}: host id {record.host_id!r} does not belong to node {record.node_id}")
        return record


def members_of(records: Iterable[StoreRecord], alive: Iterable[str], where: str) -> Members:
    """The membership: the stores of nodes that are alive (a dead node's record is ignored until it is removed)."""
    alive_ids = set(alive)
    return members_from(
        (Member(r.host_id, r.address, r.domain) for r in sorted(records, key=lambda r: r.host_id) if r.node_id in alive_ids), where
    )


def domain_of(labels: Mapping[str, str], label: str) -> str:
    """The failure-domain label of a node: the value of its node label ``label`` ("" when unnamed or absent)."""
    return str(labels.get(label, "")) if label else ""
