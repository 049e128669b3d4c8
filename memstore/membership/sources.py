"""The discovery sources: where a store learns the members of its cluster.

- :class:`StaticPeers`: the fixed ``--peers`` list (the behaviour before discovery);
- :class:`PeersFile`: ``--peers-file PATH``, the JSON that ``memstore local-cluster --endpoints-file`` writes,
  re-read when the file changes;
- :class:`DnsDiscovery`: ``--discovery dns://NAME:PORT``, the A/AAAA records of a DNS name (in
  :mod:`memstore.membership.dns_discovery`, re-exported here);
- :class:`FedMembers`: members fed in through Python by another runtime (Ray).

Each answers ``members()`` or raises DiscoveryError naming the source and what was wrong.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from memstore.errors import DiscoveryError
from memstore.membership.dns_discovery import DnsDiscovery
from memstore.membership.members import Member, Members, members_from, validate_member

__all__ = ["DnsDiscovery", "FedMembers", "PeersFile", "StaticPeers"]


class StaticPeers:
    """A fixed membership: the ``--peers`` pairs (order kept) with the ``--failure-domains`` labels."""

    def __init__(self, peers: Sequence[tuple[str, str]], domains: Mapping[str, str] | None = None) -> None:
        self.description = "--peers"
        labels = dict(domains or {})
        unknown = sorted(set(labels) - {host_id for host_id, _ in peers})
        if unknown:
            raise DiscoveryError(f"--failure-domains names hosts that are not in --peers: {', '.join(map(repr, unknown))}")
        items = [Member(host_id, address, labels.get(host_id, "")) for host_id, address in peers]
        self._members = members_from(items, self.description)

    def members(self) -> Members:
        return dict(self._members)


class FedMembers:
    """Members set through Python by another runtime (e.g. a Ray actor that knows where the stores run).

    ``set()`` validates and replaces the whole set (thread-safe); ``members()`` raises DiscoveryError until
    the first ``set()``.
    """

    def __init__(self, description: str = "fed members") -> None:
        self.description = description
        self._lock = threading.Lock()
        self._members: Members | None = None

    def set(self, members: Iterable[Member]) -> None:
        new = members_from(list(members), self.description)
        with self._lock:
            self._members = new

    def members(self) -> Members:
        with self._lock:
            current = self._members
        if current is None:
            raise DiscoveryError(f"{self.description}: no members were set yet")
        return dict(current)


_FORMAT = 'expected {"hosts": {"<host_id>": "HOST:PORT", ...}} with an optional "domains": {"<host_id>": "<label>", ...}'


class PeersFile:
    """``--peers-file PATH``: the JSON ``{"hosts": {"<host_id>": "HOST:PORT", ...}}`` (optionally ``"domains":
    {"<host_id>": "<label>"}``) exactly as ``memstore local-cluster --endpoints-file`` writes it.

    The file is parsed again only when it changed: its stat (device, inode, size, mtime_ns and ctime_ns,
    taken on the open file) differs from the last read; otherwise the cached answer (or error) is
    returned. Replace the file atomically (write a temporary file, then rename it over the path) so a
    reader never sees half a file. ``reads`` counts the parses.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.description = f"--peers-file {self.path}"
        self.reads = 0
        self._lock = threading.Lock()
        self._stamp: tuple[int, ...] | None = None
        self._cached: Members | str = ""  # the last parse: members, or the message of its error

    def members(self) -> Members:
        with self._lock:
            self._refresh()
            cached = self._cached
        if isinstance(cached, str):
            raise DiscoveryError(cached)
        return dict(cached)

    def _refresh(self) -> None:
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                if stamp == self._stamp:
                    return
                data = f.read()
        except OSError as exc:
            self._stamp, self._cached = None, f"{self.description}: cannot read the file: {exc.strerror or exc}"
            return
        self.reads += 1
        self._stamp = stamp
        try:
            self._cached = parse_peers_json(data, self.description)
        except DiscoveryError as exc:
            self._cached = str(exc)


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _json_kind(value: Any) -> str:
    kinds = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def _key(section: str, host_id: str) -> str:
    return f"{section}[{json.dumps(host_id)}]"


def parse_peers_json(data: bytes | str, where: str) -> Members:
    """The members of a peers file's content; DiscoveryError naming ``where``, the JSON key path and the problem."""
    try:
        doc = json.loads(data, object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        raise DiscoveryError(f"{where}: key {json.dumps(str(exc))} appears twice in one object") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bytes that are not UTF-8, nesting too deep
        raise DiscoveryError(f"{where}: not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise DiscoveryError(f"{where}: {_FORMAT}, found {_json_kind(doc)}")
    unknown = sorted(set(doc) - {"hosts", "domains"})
    if unknown:
        raise DiscoveryError(f"{where}: unknown key {json.dumps(unknown[0])}: {_FORMAT}")
    if "hosts" not in doc:
        raise DiscoveryError(f'{where}: no "hosts" key: {_FORMAT}')
    hosts = _strings(doc["hosts"], "hosts", '"HOST:PORT"', where)
    if not hosts:
        raise DiscoveryError(f'{where}: "hosts" is empty: it must list at least one store')
    domains = _strings(doc.get("domains", {}), "domains", "non-empty label", where)
    for host_id, label in domains.items():
        if host_id not in hosts:
            raise DiscoveryError(f'{where}: {_key("domains", host_id)}: no host {host_id!r} in "hosts"')
        if not label:
            raise DiscoveryError(f'{where}: {_key("domains", host_id)}: expected a non-empty label, found ""')
    members: Members = {}
    for host_id, address in hosts.items():
        members[host_id] = Member(host_id, address, domains.get(host_id, ""))
        validate_member(members[host_id], f"{where}: {_key('hosts', host_id)}")
    return members


def _strings(value: Any, section: str, what: str, where: str) -> dict[str, str]:
    """``value`` if it is a JSON object of strings; else DiscoveryError naming the key path."""
    if not isinstance(value, dict):
        raise DiscoveryError(f'{where}: "{section}": expected an object of "<host_id>": {what}, found {_json_kind(value)}')
    for host_id, item in value.items():
        if not isinstance(item, str):
            raise DiscoveryError(f"{where}: {_key(section, host_id)}: expected a {what} string, found {_json_kind(item)}")
    return value
