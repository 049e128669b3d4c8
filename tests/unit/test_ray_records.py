"""The Ray integration's plain rules (memstore.ray.records): host ids from node ids, store records, membership."""

from __future__ import annotations

import json

import pytest

from memstore.errors import DiscoveryError
from memstore.membership.members import Member
from memstore.ray.records import StoreRecord, domain_of, host_id_for, members_of, namespace_problem

pytestmark = pytest.mark.unit

NODE_A = "a1" * 28
NODE_B = "b2" * 28


def test_host_id_is_a_short_prefix_of_the_node_id() -> None:
    assert host_id_for(NODE_A) == "ray-" + NODE_A[:12]
    for bad in ("", "XYZ", "abc", "g" * 56, 7):
        with pytest.raises(DiscoveryError, match="node id"):
            host_id_for(bad)  # type: ignore[arg-type]


def test_record_round_trip_and_every_bad_record_named() -> None:
    rec = StoreRecord(NODE_A, host_id_for(NODE_A), "127.0.0.1:7000", "zone-a")
    assert StoreRecord.decode(rec.encode(), "here") == rec
    bad = {
        b"not json": "invalid JSON",
        b"[]": "expected an object",
        b'{"node_id": "x"}': "expected an object",
        b'{"node_id": 1, "host_id": "h", "address": "a"}': "must be a string",
        b'{"node_id": "zz", "host_id": "h", "address": "a"}': "node id",
        json.dumps({"node_id": NODE_A, "host_id": "ray-other", "address": "a"}).encode(): "does not belong",
        json.dumps({"node_id": NODE_A, "host_id": host_id_for(NODE_A), "address": "a", "extra": "1"}).encode(): "expected an object",
    }
    for data, message in bad.items():
        with pytest.raises(DiscoveryError, match=message) as err:
            StoreRecord.decode(data, "GCS record store/x")
        assert "GCS record store/x" in str(err.value)


def test_members_are_the_records_of_alive_nodes() -> None:
    a = StoreRecord(NODE_A, host_id_for(NODE_A), "127.0.0.1:7000", "zone-a")
    b = StoreRecord(NODE_B, host_id_for(NODE_B), "127.0.0.1:7001")
    assert members_of([b, a], [NODE_A], "ray") == {a.host_id: Member(a.host_id, a.address, "zone-a")}
    assert list(members_of([b, a], [NODE_A, NODE_B], "ray")) == sorted([a.host_id, b.host_id])
    with pytest.raises(DiscoveryError, match="no members"):
        members_of([a], [NODE_B], "ray")
    bad_address = StoreRecord(NODE_A, host_id_for(NODE_A), "nowhere")
    with pytest.raises(DiscoveryError, match="address"):
        members_of([bad_address], [NODE_A], "ray")


def test_namespace_and_domain_rules() -> None:
    assert namespace_problem("memstore") is None
    assert "namespace" in (namespace_problem("a:b") or "")
    assert namespace_problem("") is not None
    assert domain_of({"zone": "z1"}, "zone") == "z1"
    assert domain_of({"zone": "z1"}, "") == ""
    assert domain_of({}, "zone") == ""
