"""``--discovery dns://NAME:PORT[?server=IP:PORT]``: the members are the A/AAAA records of a DNS name.

Parses and validates the URL (ConfigError when malformed) and turns DNS answers into members with
dnspython; every DNS failure becomes a DiscoveryError with a stable message (no timings in it, so the
watcher logs a lasting failure once). dnspython is imported when a resolver is first made, not with this module:
every store imports it, few discover members over DNS, and its import costs a store's start about a tenth of a
second.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlsplit

from memstore.errors import ConfigError, DiscoveryError
from memstore.membership.members import Member, Members, host_id_problem, members_from
from memstore.v1.keys import ip_host_id

if TYPE_CHECKING:
    import dns.name
    import dns.resolver

URL_FORMAT = "dns://NAME:PORT[?server=IP:PORT]"
_LABEL = r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_DNS_NAME = re.compile(rf"(?=.{{1,253}}\.?$)({_LABEL}\.)*{_LABEL}\.?")


class DnsDiscovery:
    """``--discovery dns://NAME:PORT[?server=IP:PORT]``: one member per A and AAAA record of NAME.

    Each address IP becomes a member at ``IP:PORT`` (IPv6 as ``[IP]:PORT``); PORT is the stores' gRPC
    port. The domain is "" (DNS carries no failure-domain label).

    Host id rule: the first label of the IP's PTR record (Kubernetes answers a pod of a headless Service
    that sets hostname/subdomain with ``<pod-hostname>.<svc>.<ns>.svc.cluster.local``, so the host id is
    the pod's hostname, stable across restarts of a StatefulSet pod). When the IP has no PTR record
    (NXDOMAIN or no answer), or its first label is not a valid host id, the host id is the IP with '.' and
    ':' replaced by '-' (``10.0.0.7`` -> ``10-0-0-7``, the same name Kubernetes gives an unnamed pod). A
    PTR query that times out or fails fails the whole answer rather than fall back, so a host id never
    flips between the two forms because one query was slow. Two IPs whose PTR records give the same host
    id are an error.

    ``?server=IP[:PORT]`` (port 53 by default) asks that DNS server only; without it the system resolver
    (/etc/resolv.conf, search domains included) is used. ``timeout`` bounds each DNS query, in seconds.

    NAME not existing (NXDOMAIN), having no A or AAAA records, a timeout or an unreachable or failing
    server all raise DiscoveryError: a source answering "nobody" is treated as a failure, never as an
    empty cluster, so a :class:`~memstore.membership.watcher.Watcher` keeps the last good membership.
    """

    def __init__(self, url: str, timeout: float = 2.0) -> None:
        self.url = url
        self.name, self.port, self.server = parse_dns_url(url)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigError(f"--discovery {url} timeout {timeout!r} is invalid: expected seconds > 0")
        self.timeout = float(timeout)
        self.description = f"--discovery {url}"
        self._asked = f"DNS server {_format_address(*self.server)}" if self.server else "the system resolver"
        self._resolver: dns.resolver.Resolver | None = None

    def members(self) -> Members:
        resolver = self._resolver or self._make_resolver()
        ips = self._addresses(resolver)
        by_id: dict[str, str] = {}
        for ip in ips:
            host_id = self._host_id(resolver, ip)
            if host_id in by_id:
                raise DiscoveryError(
                    f"{self.description}: {by_id[host_id]} and {ip} both have host id {host_id!r} (from their PTR records); "
                    "host ids must be unique"
                )
            by_id[host_id] = ip
        items = [Member(host_id, _format_address(ip, self.port)) for host_id, ip in sorted(by_id.items())]
        return members_from(items, self.description)

    def _make_resolver(self) -> dns.resolver.Resolver:
        import dns.exception
        import dns.resolver

        if self.server is None:
            try:
                resolver = dns.resolver.Resolver()
            except dns.exception.DNSException as exc:
                raise DiscoveryError(f"{self.description}: the system resolver is not configured: {exc}") from None
        else:
            resolver = dns.resolver.Resolver(configure=False)
            resolver.nameservers = [self.server[0]]
            resolver.port = self.server[1]
        resolver.timeout = resolver.lifetime = self.timeout
        self._resolver = resolver
        return resolver

    def _addresses(self, resolver: dns.resolver.Resolver) -> list[str]:
        found: set[str] = set()
        for rdtype in ("A", "AAAA"):
            answer = self._query(resolver, self.name, rdtype)
            found.update(rr.address for rr in answer or ())
        if not found:
            raise DiscoveryError(f"{self.description}: {self.name} has no A or AAAA records ({self._asked})")
        return sorted(found, key=lambda ip: (len(packed := ipaddress.ip_address(ip).packed), packed))  # IPv4 first

    def _host_id(self, resolver: dns.resolver.Resolver, ip: str) -> str:
        import dns.reversename

        answer = self._query(resolver, dns.reversename.from_address(ip), "PTR", nxdomain_ok=True)
        labels = sorted(rr.target.labels[0].decode("ascii", "replace") for rr in answer or () if rr.target.labels)
        valid = [label for label in labels if host_id_problem(label) is None]
        return valid[0] if valid else ip_host_id(ip)

    def _query(
        self, resolver: dns.resolver.Resolver, qname: str | dns.name.Name, rdtype: str, nxdomain_ok: bool = False
    ) -> dns.resolver.Answer | None:
        """The answer, or None when the name has no records of ``rdtype`` (or does not exist, if ``nxdomain_ok``)."""
        import dns.exception
        import dns.resolver

        what = f"the {rdtype} query for {qname} to {self._asked}"
        try:
            return resolver.resolve(qname, rdtype, search=rdtype != "PTR")
        except dns.resolver.NoAnswer:
            return None
        except dns.resolver.NXDOMAIN:
            if nxdomain_ok:
                return None
            raise DiscoveryError(f"{self.description}: {qname} does not exist (NXDOMAIN from {self._asked})") from None
        except dns.exception.Timeout:
            raise DiscoveryError(f"{self.description}: {what} got no answer within {self.timeout:g}s") from None
        except dns.resolver.NoNameservers:
            raise DiscoveryError(f"{self.description}: {what} failed (server failure, refusal or unreachable server)") from None
        except dns.exception.DNSException as exc:
            raise DiscoveryError(f"{self.description}: {what} failed: {type(exc).__name__}") from None


def _format_address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def parse_dns_url(url: str) -> tuple[str, int, tuple[str, int] | None]:
    """``dns://NAME:PORT[?server=IP[:PORT]]`` -> (NAME, PORT, (server IP, server port) or None); ConfigError if malformed."""

    def bad(why: str) -> ConfigError:
        return ConfigError(f"--discovery {url!r} is invalid: {why}; expected {URL_FORMAT}")

    try:
        parts = urlsplit(url) if isinstance(url, str) else None
        port = parts.port if parts else None
        query = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=True) if parts and parts.query else []
    except ValueError as exc:
        raise bad(str(exc)) from None
    if parts is None or parts.scheme != "dns":
        raise bad("the scheme must be dns://")
    if parts.path not in ("", "/") or parts.fragment or parts.username is not None:
        raise bad("it has a path, fragment or user part")
    name = parts.hostname or ""
    if not _DNS_NAME.fullmatch(name) or _is_ip(name):
        raise bad(f"NAME {name!r} is not a DNS name")
    if not port:
        raise bad("PORT (the stores' gRPC port, 1..65535) is missing or 0")
    unknown = [key for key, _ in query if key != "server"]
    if unknown or len(query) > 1:
        raise bad(f"unknown or repeated parameter {(unknown or ['server'])[0]!r}")
    server = _parse_server(query[0][1], bad) if query else None
    return name, port, server


def _parse_server(text: str, bad: Callable[[str], ConfigError]) -> tuple[str, int]:
    """``IP``, ``IP:PORT`` or ``[IPv6]:PORT`` -> (IP, port); port 53 when left out."""
    host, port = text, "53"
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ("53" if not rest else "")
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    if not _is_ip(host) or not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise bad(f"server {text!r} is not IP[:PORT] with port 1..65535")
    return str(ipaddress.ip_address(host)), int(port)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
