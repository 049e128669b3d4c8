"""Membership discovery without DNS: members and their rules, --peers, --peers-file, fed members, the watcher."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from memstore.errors import ConfigError, DiscoveryError, StoreError
from memstore.membership import (
    DiscoveryStatus,
    DnsDiscovery,
    FedMembers,
    Member,
    Members,
    PeersFile,
    StaticPeers,
    Watcher,
    validate_member,
)
from memstore.testing import LocalCluster, wait_for

pytestmark = pytest.mark.unit

H0 = Member("h0", "127.0.0.1:7070")
H1 = Member("h1", "127.0.0.1:7071")
H2 = Member("h2", "127.0.0.1:7072")


def _members(*ms: Member) -> Members:
    return {m.host_id: m for m in ms}


# -- members ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "member",
    [H0, Member("a.b-C_9", "host.example:1"), Member("h", "[::1]:65535", "rack-1"), Member("h" * 64, "10.0.0.7:7070")],
)
def test_valid_members(member: Member) -> None:
    validate_member(member, "test")


@pytest.mark.parametrize(
    ("member", "problem"),
    [
        (Member("bad/id", "127.0.0.1:1"), "host id 'bad/id' is invalid"),
        (Member("", "127.0.0.1:1"), "host id '' is invalid"),
        (Member("h" * 65, "127.0.0.1:1"), "is invalid: expected 1-64 characters"),
        (Member("h0", "127.0.0.1"), "address '127.0.0.1' is invalid"),
        (Member("h0", "127.0.0.1:0"), "port 1..65535"),
        (Member("h0", "127.0.0.1:65536"), "port 1..65535"),
        (Member("h0", ":7070"), "address ':7070' is invalid"),
        (Member("h0", "::1:7070"), "IPv6 as [::1]:PORT"),
        (Member("h0", "[nope]:7070"), "address '[nope]:7070' is invalid"),
        (Member("h0", "bad host:7070"), "address 'bad host:7070' is invalid"),
        (Member("h0", "127.0.0.1:70a"), "address '127.0.0.1:70a' is invalid"),
        (Member("h0", "127.0.0.1:1", 5), "domain 5 is invalid"),  # type: ignore[arg-type]
    ],
)
def test_invalid_member_names_where_host_and_problem(member: Member, problem: str) -> None:
    with pytest.raises(DiscoveryError, match=r"^--somewhere: ") as info:
        validate_member(member, "--somewhere")
    assert f"host {member.host_id!r}" in str(info.value) and problem in str(info.value)


def test_not_a_member() -> None:
    with pytest.raises(DiscoveryError, match="expected a Member, found tuple"):
        validate_member(("h0", "127.0.0.1:1"), "x")  # type: ignore[arg-type]


def test_discovery_error_is_a_store_error_answered_as_unavailable() -> None:
    assert issubclass(DiscoveryError, StoreError) and DiscoveryError.status == "UNAVAILABLE"


# -- --peers --------------------------------------------------------------------------------------------


def test_static_peers_keep_order_and_domains() -> None:
    source = StaticPeers([("h1", "127.0.0.1:7071"), ("h0", "127.0.0.1:7070")], {"h0": "rack-a"})
    got = source.members()
    assert list(got) == ["h1", "h0"]  # --peers order fixes placement
    assert got == {"h1": H1, "h0": Member("h0", "127.0.0.1:7070", "rack-a")}
    got.clear()
    assert len(source.members()) == 2  # a copy each time
    assert source.description == "--peers"


@pytest.mark.parametrize(
    ("peers", "domains", "problem"),
    [
        ([("h0", "127.0.0.1:1"), ("h0", "127.0.0.1:2")], None, "host 'h0' is listed more than once"),
        ([("h0", "nowhere")], None, "--peers: host 'h0': address 'nowhere' is invalid"),
        ([("h0", "127.0.0.1:1")], {"h9": "rack"}, "--failure-domains names hosts that are not in --peers: 'h9'"),
        ([], None, "no members"),
    ],
)
def test_static_peers_refuse_bad_lists(peers: list[tuple[str, str]], domains: dict[str, str] | None, problem: str) -> None:
    with pytest.raises(DiscoveryError, match=problem.replace("(", r"\(")):
        StaticPeers(peers, domains)


# -- --peers-file -----------------------------------------------------------------------------------


def _write(path: Path, content: Any) -> None:
    """Replace ``path`` atomically, the way local-cluster writes its endpoints file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(content if isinstance(content, str) else json.dumps(content))
    os.replace(tmp, path)


def test_peers_file_reads_what_local_cluster_writes(tmp_path: Path) -> None:
    cluster = LocalCluster(hosts=3, replicas=2, workdir=tmp_path / "cluster")  # not started: only its endpoints
    path = tmp_path / "endpoints.json"
    cluster.write_endpoints(path)
    got = PeersFile(path).members()
    assert got == {h: Member(h, address) for h, address in cluster.endpoints.items()}
    assert list(got) == ["h0", "h1", "h2"]


def test_peers_file_with_domains_and_ipv6(tmp_path: Path) -> None:
    path = tmp_path / "peers.json"
    _write(path, {"hosts": {"h0": "127.0.0.1:7070", "h1": "[::1]:7071"}, "domains": {"h1": "zone-b"}})
    source = PeersFile(str(path))
    assert source.description == f"--peers-file {path}"
    assert source.members() == {"h0": H0, "h1": Member("h1", "[::1]:7071", "zone-b")}


def test_peers_file_is_reread_only_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "peers.json"
    _write(path, {"hosts": {"h0": H0.address}})
    source = PeersFile(path)
    assert source.members() == _members(H0) and source.reads == 1
    assert source.members() == _members(H0) and source.reads == 1  # unchanged: the cached parse
    before = path.stat().st_mtime_ns
    _write(path, {"hosts": {"h0": H0.address, "h1": H1.address}})  # a rewrite within the same second
    os.utime(path, ns=(before, before))  # ... even with the very same mtime: a new inode
    assert source.members() == _members(H0, H1) and source.reads == 2
    assert source.members() == _members(H0, H1) and source.reads == 2


def test_peers_file_in_place_rewrite_of_the_same_size_and_mtime_is_seen(tmp_path: Path) -> None:
    path = tmp_path / "peers.json"
    path.write_text(json.dumps({"hosts": {"h1": H1.address}}))
    source = PeersFile(path)
    assert source.members() == _members(H1)
    st = path.stat()
    path.write_text(json.dumps({"hosts": {"h2": H2.address}}))  # same inode, same size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same mtime: only ctime tells
    assert path.stat().st_size == st.st_size and path.stat().st_ino == st.st_ino
    assert source.members() == _members(H2) and source.reads == 2


BAD_FILES: list[tuple[Any, str]] = [
    ("{not json", "not valid JSON: Expecting property name"),
    ("", "not valid JSON"),
    ([], "found an array"),
    ({"hosts": {"h0": H0.address}, "hostz": {}}, 'unknown key "hostz"'),
    ({"domains": {}}, 'no "hosts" key'),
    ({"hosts": ["h0"]}, '"hosts": expected an object of "<host_id>": "HOST:PORT", found an array'),
    ({"hosts": {}}, '"hosts" is empty'),
    ({"hosts": {"h0": H0.address, "h2": 7072}}, 'hosts["h2"]: expected a "HOST:PORT" string, found a number'),
    ({"hosts": {"h0": H0.address, "h2": None}}, 'hosts["h2"]: expected a "HOST:PORT" string, found null'),
    ({"hosts": {"h2": "127.0.0.1"}}, "hosts[\"h2\"]: host 'h2': address '127.0.0.1' is invalid"),
    ({"hosts": {"h2": "127.0.0.1:99999"}}, "port 1..65535"),
    ({"hosts": {"bad/id": H0.address}}, "hosts[\"bad/id\"]: host 'bad/id': host id 'bad/id' is invalid"),
    ({"hosts": {"h0": H0.address}, "domains": {"h9": "rack"}}, 'domains["h9"]: no host \'h9\' in "hosts"'),
    ({"hosts": {"h0": H0.address}, "domains": {"h0": 3}}, 'domains["h0"]: expected a non-empty label string, found a number'),
    ({"hosts": {"h0": H0.address}, "domains": {"h0": ""}}, 'domains["h0"]: expected a non-empty label'),
    ({"hosts": {"h0": H0.address}, "domains": []}, '"domains": expected an object'),
    ('{"hosts": {"h0": "127.0.0.1:1", "h0": "127.0.0.1:2"}}', 'key "h0" appears twice'),
]


@pytest.mark.parametrize(("content", "problem"), BAD_FILES)
def test_peers_file_garbage_names_the_path_and_problem(tmp_path: Path, content: Any, problem: str) -> None:
    path = tmp_path / "peers.json"
    _write(path, content)
    with pytest.raises(DiscoveryError) as info:
        PeersFile(path).members()
    assert str(info.value).startswith(f"--peers-file {path}: ")
    assert problem in str(info.value)


def test_peers_file_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "peers.json"
    path.write_bytes(b'{"hosts": {"h0": "\xff"}}')
    with pytest.raises(DiscoveryError, match="not valid JSON"):
        PeersFile(path).members()


@pytest.mark.parametrize(("make", "problem"), [(lambda p: None, "No such file or directory"), (Path.mkdir, "Is a directory")])
def test_peers_file_unreadable(tmp_path: Path, make: Any, problem: str) -> None:
    path = tmp_path / "peers.json"
    make(path)
    with pytest.raises(DiscoveryError, match=f"^--peers-file {path}: cannot read the file: {problem}"):
        PeersFile(path).members()


def test_peers_file_error_is_cached_until_the_file_is_fixed(tmp_path: Path) -> None:
    path = tmp_path / "peers.json"
    _write(path, {"hosts": {}})
    source = PeersFile(path)
    for _ in range(2):
        with pytest.raises(DiscoveryError, match="empty"):
            source.members()
    assert source.reads == 1
    _write(path, {"hosts": {"h0": H0.address}})
    assert source.members() == _members(H0)
    path.unlink()
    with pytest.raises(DiscoveryError, match="No such file"):
        source.members()
    _write(path, {"hosts": {"h0": H0.address}})
    assert source.members() == _members(H0)


# -- fed members --------------------------------------------------------------------------------------


def test_fed_members() -> None:
    fed = FedMembers("ray actors")
    with pytest.raises(DiscoveryError, match=r"^ray actors: no members were set yet"):
        fed.members()
    fed.set(iter([H0, H1]))
    assert fed.members() == _members(H0, H1)
    fed.set([H2])  # replaces the whole set
    assert fed.members() == _members(H2)
    fed.members().clear()
    assert fed.members() == _members(H2)


@pytest.mark.parametrize(
    ("members", "problem"),
    [
        ([H0, Member("h0", "127.0.0.1:1")], "host 'h0' is listed more than once"),
        ([H0, Member("h1", "nowhere")], "host 'h1': address 'nowhere' is invalid"),
        ([], "no members"),
        (["h0"], "expected a Member, found str"),
    ],
)
def test_fed_members_refuse_bad_sets_and_keep_the_old_one(members: list[Any], problem: str) -> None:
    fed = FedMembers()
    fed.set([H2])
    with pytest.raises(DiscoveryError, match=r"^fed members: ") as info:
        fed.set(members)
    assert problem in str(info.value)
    assert fed.members() == _members(H2)


def test_fed_members_concurrent_sets_leave_one_whole_set() -> None:
    fed = FedMembers()
    sets = [[Member(f"h{i}-{j}", f"127.0.0.1:{7000 + j}") for j in range(20)] for i in range(8)]
    threads = [threading.Thread(target=lambda s=s: [fed.set(s) for _ in range(50)]) for s in sets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fed.members() in [{m.host_id: m for m in s} for s in sets]


# -- the watcher ----------------------------------------------------------------------------------------


class Scripted:
    """A source answering what the test put in ``answer``: Members, garbage, or an exception to raise."""

    description = "scripted source"

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def members(self) -> Members:
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer  # type: ignore[no-any-return]


def test_watcher_calls_on_change_exactly_on_changes() -> None:
    source = FedMembers()
    calls: list[Members] = []
    watcher = Watcher(source, 60, calls.append)
    assert not watcher.poll_once()  # nothing set yet: a failure, no call
    source.set([H0])
    assert watcher.poll_once() and calls == [_members(H0)]  # the first good answer
    assert watcher.poll_once() and calls == [_members(H0)]  # unchanged
    source.set([H0, H1])
    assert watcher.poll_once() and calls == [_members(H0), _members(H0, H1)]
    source.set([H0, Member("h1", "127.0.0.1:9999")])  # a moved host is a change
    source.set([H0, Member("h1", H1.address, "rack-b")])  # so is a new domain label
    assert watcher.poll_once() and len(calls) == 3 and calls[-1]["h1"].domain == "rack-b"
    source.set([H0, H1])
    assert watcher.poll_once() and calls[-1] == _members(H0, H1) and len(calls) == 4


def test_watcher_keeps_last_good_membership_on_failure() -> None:
    source = Scripted(_members(H0, H1))
    calls: list[Members] = []
    watcher = Watcher(source, 60, calls.append)
    assert watcher.poll_once()
    ok = watcher.status()
    assert ok == DiscoveryStatus("scripted source", _members(H0, H1), ok.last_ok_unix, "", 0)
    assert abs(ok.last_ok_unix - time.time()) < 60
    source.answer = DiscoveryError("scripted source: the DNS server is down")
    assert not watcher.poll_once() and not watcher.poll_once()
    failed = watcher.status()
    assert failed.members == _members(H0, H1) and failed.last_ok_unix == ok.last_ok_unix
    assert failed.error == "scripted source: the DNS server is down" and failed.consecutive_failures == 2
    source.answer = _members(H0, H1)
    assert watcher.poll_once()
    assert watcher.status().error == "" and watcher.status().consecutive_failures == 0
    assert calls == [_members(H0, H1)]  # neither the failure nor the recovery to the same set is a change


@pytest.mark.parametrize(
    ("answer", "problem"),
    [
        ({}, "scripted source: no members"),
        ([H0], "expected a mapping of host id to Member, found list"),
        ({"h0": H1}, "key 'h0' holds the member of host 'h1'"),
        ({"h0": Member("h0", "nowhere")}, "host 'h0': address 'nowhere' is invalid"),
        ({"h0": ("h0", "127.0.0.1:1")}, "expected a Member, found tuple"),
        (None, "found NoneType"),
        (OSError("disk on fire"), "scripted source: unexpected OSError: disk on fire"),
    ],
)
def test_watcher_treats_garbage_as_failure(answer: Any, problem: str) -> None:
    source = Scripted(_members(H0))
    calls: list[Members] = []
    watcher = Watcher(source, 60, calls.append)
    assert watcher.poll_once()
    source.answer = answer
    assert not watcher.poll_once()
    status = watcher.status()
    assert problem in status.error and status.members == _members(H0) and status.consecutive_failures == 1
    assert calls == [_members(H0)]


def test_watcher_logs_each_new_error_once_and_recovery(caplog: pytest.LogCaptureFixture) -> None:
    source = Scripted(DiscoveryError("scripted source: down"))
    watcher = Watcher(source, 60, lambda members: None)
    with caplog.at_level(logging.INFO, logger="memstore.membership.watcher"):
        for _ in range(3):
            watcher.poll_once()
        source.answer = DiscoveryError("scripted source: garbage")
        for _ in range(3):
            watcher.poll_once()
        source.answer = _members(H0)
        watcher.poll_once()
        watcher.poll_once()
        source.answer = DiscoveryError("scripted source: garbage")
        watcher.poll_once()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3
    assert "down" in warnings[0] and "garbage" in warnings[1] and "garbage" in warnings[2]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert sum("recovered after 6 failed polls" in m for m in infos) == 1


def test_watcher_survives_a_failing_on_change() -> None:
    source = FedMembers()
    source.set([H0])
    seen: list[Members] = []

    def on_change(members: Members) -> None:
        seen.append(members)
        raise RuntimeError("consumer bug")

    watcher = Watcher(source, 60, on_change)
    assert watcher.poll_once()
    source.set([H1])
    assert watcher.poll_once()
    assert seen == [_members(H0), _members(H1)]  # H1 replaced H0 in one answer: H0 leaves at once


def test_a_member_leaves_only_after_answers_in_a_row_leave_it_out() -> None:
    from memstore.membership.watcher import ABSENT_POLLS

    source = FedMembers()
    source.set([H0, H1])
    seen: list[Members] = []
    watcher = Watcher(source, 60, seen.append)
    assert watcher.poll_once()
    for _ in range(ABSENT_POLLS - 1):  # a flapping answer (DNS while pods churn): H1 is kept at its last address
        source.set([H0])
        assert watcher.poll_once()
        source.set([H0, H1])
        assert watcher.poll_once()
    assert seen == [_members(H0, H1)] and watcher.status().members == _members(H0, H1)
    source.set([H0])
    for _ in range(ABSENT_POLLS - 1):
        assert watcher.poll_once()
    assert seen == [_members(H0, H1)]
    assert watcher.poll_once()  # the ABSENT_POLLS-th answer in a row without it: H1 is gone
    assert seen == [_members(H0, H1), _members(H0)]
    source.set([H1])  # a newcomer (H1 again) in place of H0: taken as it is
    assert watcher.poll_once()
    assert seen[-1] == _members(H1)


def test_watcher_thread_polls_and_close_is_prompt() -> None:
    source = FedMembers()
    calls: list[Members] = []

    def on_change(members: Members) -> None:
        assert watcher.status().members == members  # on_change runs outside the watcher's lock
        calls.append(members)

    watcher = Watcher(source, 0.02, on_change)
    source.set([H0])
    before = set(threading.enumerate())
    watcher.start()
    watcher.start()  # once only
    wait_for(lambda: calls == [_members(H0)], timeout=5, what="the first membership")
    source.set([H0, H1, H2])
    wait_for(lambda: len(calls) == 2, timeout=5, what="the changed membership")
    assert calls[-1] == _members(H0, H1, H2)
    started = time.monotonic()
    watcher.close()
    assert time.monotonic() - started < 1
    assert [t for t in threading.enumerate() if t not in before] == []  # the polling thread was joined
    with pytest.raises(RuntimeError, match="closed"):
        watcher.start()


def test_watcher_after_startup_poll_waits_an_interval_and_close_does_not() -> None:
    source = FedMembers()
    source.set([H0])
    with Watcher(source, 3600, lambda members: None) as watcher:
        assert watcher.poll_once()  # the startup pattern: poll now, then start the thread
        watcher.start()
        started = time.monotonic()
    assert time.monotonic() - started < 1  # closing does not wait out the hour-long interval


@pytest.mark.parametrize("interval", [0, -1, float("nan"), "1"])
def test_watcher_refuses_bad_interval(interval: Any) -> None:
    with pytest.raises(ConfigError, match="interval"):
        Watcher(FedMembers(), interval, lambda members: None)


# -- dns:// urls (no DNS traffic: tests/integration/test_dns_discovery.py asks a real server) -------------


@pytest.mark.parametrize(
    ("url", "name", "port", "server"),
    [
        ("dns://memstore.ns.svc.cluster.local:7070", "memstore.ns.svc.cluster.local", 7070, None),
        ("dns://stores:7070?server=127.0.0.1:5353", "stores", 7070, ("127.0.0.1", 5353)),
        ("dns://stores.:1/?server=10.0.0.10", "stores.", 1, ("10.0.0.10", 53)),
        ("dns://stores:7070?server=[::1]:5353", "stores", 7070, ("::1", 5353)),
    ],
)
def test_dns_url(url: str, name: str, port: int, server: tuple[str, int] | None) -> None:
    source = DnsDiscovery(url)
    assert (source.name, source.port, source.server) == (name, port, server)
    assert source.description == f"--discovery {url}"


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://stores:7070", "scheme"),
        ("stores:7070", "scheme"),
        ("dns://stores", "PORT"),
        ("dns://stores:0", "PORT"),
        ("dns://stores:70000", "out of range"),
        ("dns://stores:http", "integer"),
        ("dns://:7070", "is not a DNS name"),
        ("dns://10.0.0.1:7070", "'10.0.0.1' is not a DNS name"),
        ("dns://bad_name!:7070", "is not a DNS name"),
        ("dns://stores:7070/path", "path"),
        ("dns://user@stores:7070", "user"),
        ("dns://stores:7070?server=resolver.local", "server 'resolver.local' is not IP[:PORT]"),
        ("dns://stores:7070?server=127.0.0.1:0", "server '127.0.0.1:0'"),
        ("dns://stores:7070?server=", "server ''"),
        ("dns://stores:7070?serv=127.0.0.1", "unknown or repeated parameter 'serv'"),
        ("dns://stores:7070?server=127.0.0.1&server=127.0.0.2", "repeated parameter 'server'"),
    ],
)
def test_dns_url_malformed(url: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        DnsDiscovery(url)
    assert str(info.value).startswith(f"--discovery {url!r} is invalid: ") and problem in str(info.value)
    assert "dns://NAME:PORT[?server=IP:PORT]" in str(info.value)


def test_dns_timeout_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="timeout"):
        DnsDiscovery("dns://stores:7070", timeout=0)
