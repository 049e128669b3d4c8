"""--discovery dns:// against a real DNS server (dnslib, UDP on 127.0.0.1) whose records the tests change."""

from __future__ import annotations

import re

import pytest

from memstore.errors import DiscoveryError
from memstore.membership import DnsDiscovery, Member, Members, Watcher
from memstore.testing import wait_for
from tools.dns_server import DnsServer, ptr_name

pytestmark = pytest.mark.integration

NAME = "stores.memstore.test."
PORT = 7070


def member(host_id: str, ip: str) -> Member:
    return Member(host_id, f"[{ip}]:{PORT}" if ":" in ip else f"{ip}:{PORT}")


def as_members(*ms: Member) -> Members:
    return {m.host_id: m for m in ms}


def test_members_follow_the_records(dns_server: DnsServer) -> None:
    zone = dns_server.zone
    zone.set(NAME, "A", "127.0.0.1", "127.0.0.2")
    zone.set(ptr_name("127.0.0.1"), "PTR", "store-0.stores.ns.svc.cluster.local.")  # a pod with hostname/subdomain
    source = DnsDiscovery(dns_server.url(NAME, PORT), timeout=1)
    assert source.members() == as_members(member("store-0", "127.0.0.1"), member("127-0-0-2", "127.0.0.2"))
    zone.set(NAME, "A", "127.0.0.1", "127.0.0.3")
    zone.set(ptr_name("127.0.0.3"), "PTR", "store-2.stores.ns.svc.cluster.local.")
    assert source.members() == as_members(member("store-0", "127.0.0.1"), member("store-2", "127.0.0.3"))
    zone.set(ptr_name("127.0.0.3"), "PTR", "we!rd.example.")  # not a valid host id: the IP-derived one
    assert source.members() == as_members(member("store-0", "127.0.0.1"), member("127-0-0-3", "127.0.0.3"))


def test_aaaa_records(dns_server: DnsServer) -> None:
    zone = dns_server.zone
    zone.set(NAME, "A", "127.0.0.1")
    zone.set(NAME, "AAAA", "::1")
    source = DnsDiscovery(dns_server.url(NAME, PORT), timeout=1)
    assert source.members() == as_members(member("127-0-0-1", "127.0.0.1"), member("--1", "::1"))
    zone.set(ptr_name("::1"), "PTR", "store-v6.stores.ns.svc.cluster.local.")
    zone.drop(NAME)
    zone.set(NAME, "AAAA", "::1")  # AAAA only: the A query answers no records
    assert source.members() == {"store-v6": Member("store-v6", f"[::1]:{PORT}")}


def test_nobody_is_an_error(dns_server: DnsServer) -> None:
    zone = dns_server.zone
    source = DnsDiscovery(dns_server.url(NAME, PORT), timeout=1)
    with pytest.raises(DiscoveryError) as info:
        source.members()
    assert str(info.value) == f"--discovery {source.url}: {NAME} does not exist (NXDOMAIN from DNS server 127.0.0.1:{dns_server.port})"
    zone.set(NAME, "PTR")  # the name exists, with no A or AAAA records
    with pytest.raises(DiscoveryError, match=f"{NAME} has no A or AAAA records"):
        source.members()


def test_same_host_id_twice_is_an_error(dns_server: DnsServer) -> None:
    zone = dns_server.zone
    zone.set(NAME, "A", "127.0.0.1", "127.0.0.2")
    zone.set(ptr_name("127.0.0.1"), "PTR", "store-0.a.example.")
    zone.set(ptr_name("127.0.0.2"), "PTR", "store-0.b.example.")
    with pytest.raises(DiscoveryError, match=re.escape("127.0.0.1 and 127.0.0.2 both have host id 'store-0'")):
        DnsDiscovery(dns_server.url(NAME, PORT), timeout=1).members()


def test_failing_ptr_query_fails_the_answer(dns_server: DnsServer) -> None:
    zone = dns_server.zone
    zone.set(NAME, "A", "127.0.0.1")
    zone.set(ptr_name("127.0.0.1"), "PTR", "store-0.stores.example.")
    source = DnsDiscovery(dns_server.url(NAME, PORT), timeout=1)
    assert list(source.members()) == ["store-0"]
    zone.servfail.add("PTR")  # no falling back to "127-0-0-1": the host id would flip
    with pytest.raises(DiscoveryError, match=r"the PTR query for 1\.0\.0\.127\.in-addr\.arpa\. to DNS server 127\.0\.0\.1:\d+ failed"):
        source.members()


def test_watcher_keeps_last_good_members_through_nxdomain_and_a_dead_server(dns_server: DnsServer) -> None:
    zone = dns_server.zone
    zone.set(NAME, "A", "127.0.0.1")
    zone.set(ptr_name("127.0.0.1"), "PTR", "store-0.stores.example.")
    calls: list[Members] = []
    with Watcher(DnsDiscovery(dns_server.url(NAME, PORT), timeout=0.3), 0.02, calls.append) as watcher:
        assert watcher.poll_once() and calls == [as_members(member("store-0", "127.0.0.1"))]
        watcher.start()
        zone.set(NAME, "A", "127.0.0.1", "127.0.0.2")
        wait_for(lambda: len(calls) == 2, timeout=5, what="127.0.0.2 to join")
        assert calls[-1] == as_members(member("store-0", "127.0.0.1"), member("127-0-0-2", "127.0.0.2"))
        zone.set(NAME, "A", "127.0.0.2")
        wait_for(lambda: len(calls) == 3, timeout=5, what="store-0 to leave")
        assert calls[-1] == as_members(member("127-0-0-2", "127.0.0.2"))

        zone.drop(NAME)
        wait_for(lambda: watcher.status().consecutive_failures >= 2, timeout=5, what="NXDOMAIN polls")
        status = watcher.status()
        assert "does not exist (NXDOMAIN" in status.error and status.members == calls[-1]

        zone.set(NAME, "A", "127.0.0.2")
        wait_for(lambda: watcher.status().error == "", timeout=5, what="recovery")
        dns_server.stop()
        wait_for(lambda: watcher.status().consecutive_failures >= 1, timeout=5, what="a poll of the stopped server")
        status = watcher.status()
        assert status.error.startswith(f"--discovery {dns_server.url(NAME, PORT)}: ") and "to DNS server 127.0.0.1:" in status.error
        assert status.members == as_members(member("127-0-0-2", "127.0.0.2"))
        assert len(calls) == 3  # neither failures nor the recovery to the same members were changes


def test_stores_follow_the_records(dns_server: DnsServer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Real store processes on 127.0.0.2-4 (one port, as pods behind a headless Service) learn each other from DNS."""
    import shutil
    import subprocess
    import sys

    from memstore.children import child_env
    from memstore.testing import free_ports
    from memstore.v1 import store_pb2 as pb
    from memstore.v1.channel import store_stub

    (port,) = free_ports(1)
    zone = dns_server.zone
    url = f"dns://{NAME}:{port}?server=127.0.0.1:{dns_server.port}"
    shm = tmp_path / "shm"
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def publish(*ips: str) -> None:
        zone.set(NAME, "A", *ips)
        for ip in ips:
            zone.set(ptr_name(ip), "PTR", f"s{ip.rsplit('.', 1)[1]}.stores.ns.svc.cluster.local.")

    def start(ip: str) -> None:
        host = f"s{ip.rsplit('.', 1)[1]}"
        args = [sys.executable, "-m", "memstore", "serve", "--host-id", host, "--listen", f"{ip}:{port}", "--discovery", url,
                "--discovery-interval", "0.3", "--replicas", "2", "--capacity", "64MiB", "--shm-dir", str(shm)]  # fmt: skip
        with open(tmp_path / f"{host}.log", "ab") as log:
            procs[host] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**child_env()})

    def slots(ip: str) -> list[str]:
        channel, stub = store_stub(f"{ip}:{port}")
        with channel:
            try:
                return [s.host_id for s in stub.Health(pb.HealthRequest(), timeout=1).slots.slots]
            except Exception:
                return []

    try:
        publish("127.0.0.2", "127.0.0.3")
        start("127.0.0.2")
        start("127.0.0.3")
        for ip in ("127.0.0.2", "127.0.0.3"):
            wait_for(lambda ip=ip: slots(ip) == ["s2", "s3"], timeout=30, what=f"{ip} to see s2, s3")
        publish("127.0.0.2", "127.0.0.3", "127.0.0.4")  # a new pod appears ...
        start("127.0.0.4")
        for ip in ("127.0.0.2", "127.0.0.3", "127.0.0.4"):
            wait_for(lambda ip=ip: slots(ip) == ["s2", "s3", "s4"], timeout=30, what=f"{ip} to see s4 join")
        procs["s3"].kill()
        procs["s3"].wait(timeout=10)
        publish("127.0.0.2", "127.0.0.4")  # ... and one disappears: its slot is vacated, not renumbered
        for ip in ("127.0.0.2", "127.0.0.4"):
            wait_for(lambda ip=ip: slots(ip) == ["s2", "", "s4"], timeout=30, what=f"{ip} to see s3 leave")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
        shutil.rmtree(shm, ignore_errors=True)
