"""What a cluster member is, the rules a membership must meet, and the interface of a discovery source.

Plain Python (no gRPC, no torch): the sources and the watcher build on these, and so does the store
server that consumes the membership. Every check raises :class:`~memstore.errors.DiscoveryError` with a
message naming where the member came from, its host id and what is wrong.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from memstore.errors import DiscoveryError
from memstore.v1.keys import HOST_ID_PATTERN

_HOSTNAME = re.compile(r"[A-Za-z0-9._-]+")  # a DNS name or an IPv4 address; IPv6 goes in brackets
ADDRESS_RULE = "expected HOST:PORT with port 1..65535 (IPv6 as [::1]:PORT)"
NO_MEMBERS = "no members (a membership needs at least one store)"


@dataclass(frozen=True)
class Member:
    """One store of the cluster."""

    host_id: str
    address: str  # "HOST:PORT" of the store's gRPC endpoint; IPv6 as "[::1]:PORT"
    domain: str = ""  # optional failure-domain label


Members = dict[str, Member]  # host_id -> Member


class DiscoverySource(Protocol):
    """Where the members come from. ``members()`` answers the current set or raises DiscoveryError."""

    description: str  # e.g. "--peers-file /etc/memstore/peers.json"; names the source in errors and status

    def members(self) -> Members: ...


def host_id_problem(host_id: Any) -> str | None:
    """Why ``host_id`` is not a valid host id (the rule of ``--host-id``/``--peers``), or None."""
    if not isinstance(host_id, str) or not HOST_ID_PATTERN.fullmatch(host_id):
        return f"host id {host_id!r} is invalid: expected 1-64 characters of [A-Za-z0-9._-]"
    return None


def address_problem(address: Any) -> str | None:
    """Why ``address`` is not ``HOST:PORT`` (port 1..65535, IPv6 host in brackets), or None."""
    if not isinstance(address, str):
        return f"address {address!r} is invalid: {ADDRESS_RULE}"
    host, sep, port = address.rpartition(":")
    port_ok = sep and port.isascii() and port.isdigit() and 1 <= int(port) <= 65535
    if not port_ok or not _host_ok(host):
        return f"address {address!r} is invalid: {ADDRESS_RULE}"
    return None


def _host_ok(host: str) -> bool:
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return False
        return True
    return bool(_HOSTNAME.fullmatch(host))


def validate_member(m: Member, where: str) -> None:
    """Raise DiscoveryError naming ``where``, the host id and what is wrong with ``m``."""
    if not isinstance(m, Member):
        raise DiscoveryError(f"{where}: expected a Member, found {type(m).__name__} {m!r}")
    problem = host_id_problem(m.host_id) or address_problem(m.address)
    if problem is None and not isinstance(m.domain, str):
        problem = f"domain {m.domain!r} is invalid: expected a string label"
    if problem:
        raise DiscoveryError(f"{where}: host {m.host_id!r}: {problem}")


def members_from(items: Iterable[Member], where: str) -> Members:
    """The membership of ``items``: each member valid, host ids unique, at least one member."""
    out: Members = {}
    for m in items:
        validate_member(m, where)
        if m.host_id in out:
            raise DiscoveryError(f"{where}: host {m.host_id!r} is listed more than once")
        out[m.host_id] = m
    if not out:
        raise DiscoveryError(f"{where}: {NO_MEMBERS}")
    return out


def validate_members(members: Any, where: str) -> Members:
    """A copy of ``members`` (a source's answer) if it is a valid, non-empty ``host_id -> Member`` mapping."""
    if not isinstance(members, Mapping):
        raise DiscoveryError(f"{where}: expected a mapping of host id to Member, found {type(members).__name__}")
    for key, m in members.items():
        validate_member(m, where)
        if key != m.host_id:
            raise DiscoveryError(f"{where}: key {key!r} holds the member of host {m.host_id!r}")
    if not members:
        raise DiscoveryError(f"{where}: {NO_MEMBERS}")
    return dict(members)
