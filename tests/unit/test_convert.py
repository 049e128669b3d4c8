"""The store's boundary with the wire: conversions between memstore.v1 messages and the core's types."""

from __future__ import annotations

import dataclasses

import pytest

from memstore.core.model import Manifest, PutOrigin, ShardInfo, ShardKey, ShardState, TransferHeader
from memstore.core.restorable import RestoreAnswer, Version
from memstore.core.status import HelloReport
from memstore.errors import InvalidArgument, StreamChecksumError, StreamError
from memstore.server.convert import (
    hello_from_pb,
    hello_to_pb,
    info_from_pb,
    info_to_pb,
    latest_to_pb,
    sidecar_bytes,
    sidecar_info,
    transfer_from_pb,
    transfer_to_pb,
)
from memstore.v1 import store_pb2 as pb
from memstore.v1.integrity import CHECKSUM_ALGO, compute_checksums
from memstore.v1.streams import manifest_problem, receive_chunks

pytestmark = pytest.mark.unit

KEY = ShardKey("job", 7, 1, "run.0")
DATA = bytes(range(256)) * 40  # 10240 bytes: 3 chunks of 4096 (the last shorter)
MANIFEST = Manifest(
    key=KEY,
    world_size=2,
    nbytes=len(DATA),
    chunk_size=4096,
    checksums=tuple(compute_checksums(memoryview(DATA), len(DATA), 4096)),
    owner_host="h0",
    format_version=3,
    metrics={"loss": 0.5},
    created_unix=1234.5,
    spill_codec="zstd",
)


def test_sidecar_bytes_are_the_serialized_wire_shard_info() -> None:
    """Segments left by a store of an earlier version stay adoptable: the sidecar format is the wire's ShardInfo."""
    info = ShardInfo(MANIFEST, ShardState.COMMITTED, True, "", 2)
    wire = pb.ShardInfo(
        manifest=pb.Manifest(
            key=pb.ShardKey(job_id="job", step=7, rank=1, timeline="run.0"),
            world_size=2,
            nbytes=len(DATA),
            chunk_size=4096,
            chunk_checksums=list(MANIFEST.checksums),
            checksum_algo=CHECKSUM_ALGO,
            owner_host="h0",
            format_version=3,
            metrics={"loss": 0.5},
            created_unix=1234.5,
            spill_codec="zstd",
        ),
        state=pb.SHARD_STATE_COMMITTED,
        verified=True,
        copies=2,
    )
    assert sidecar_bytes(info) == wire.SerializeToString()
    assert sidecar_info(wire.SerializeToString()) == info


def test_a_copy_not_yet_checksummed_lists_as_before() -> None:
    placeholder = Manifest(KEY, 2, 100, chunk_size=0, checksums=(), owner_host="h0")
    got = info_to_pb(ShardInfo(placeholder, ShardState.CAPTURED, False))
    want = pb.Manifest(key=pb.ShardKey(job_id="job", step=7, rank=1, timeline="run.0"), world_size=2, nbytes=100, owner_host="h0")
    assert got.manifest == want and got.state == pb.SHARD_STATE_CAPTURED and not got.verified


def test_an_unknown_state_from_a_peer_is_none() -> None:
    wire = info_to_pb(ShardInfo(MANIFEST, ShardState.REPLICA, True))
    wire.state = pb.SHARD_STATE_UNSPECIFIED
    assert info_from_pb(wire).state is None
    assert info_to_pb(info_from_pb(wire)).state == pb.SHARD_STATE_UNSPECIFIED


@pytest.mark.parametrize("origin", list(PutOrigin))
def test_transfer_header_round_trip(origin: PutOrigin) -> None:
    header = TransferHeader(MANIFEST, origin, "h0")
    assert transfer_from_pb(transfer_to_pb(header)) == header


def test_transfer_header_without_origin_is_invalid() -> None:
    wire = transfer_to_pb(TransferHeader(MANIFEST, PutOrigin.REPLICA, "h0"))
    wire.origin = pb.PUT_ORIGIN_UNSPECIFIED
    with pytest.raises(InvalidArgument, match="origin is unspecified: expected CLIENT, REPLICA or REPAIR"):
        transfer_from_pb(wire)


def test_latest_step_answers() -> None:
    found = latest_to_pb(RestoreAnswer(Version(5, "run.1", 4, 99.0), ("h3",)))
    assert (found.found, found.step, found.world_size, found.timeline, list(found.unreachable_hosts)) == (True, 5, 4, "run.1", ["h3"])
    missing = latest_to_pb(RestoreAnswer(None, ("durable",), "ranks disagree"))
    assert (missing.found, missing.step, missing.note, list(missing.unreachable_hosts)) == (False, 0, "ranks disagree", ["durable"])


def test_hello_round_trip() -> None:
    hello = HelloReport("h0", "1.0", 2, ("h0", "h1"), ("a:1", "b:2"), "/dev/shm/x", "boot", 1 << 30, 4 << 20, "mixed", 4567)
    assert hello_from_pb(hello_to_pb(hello)) == hello
    assert hello.cluster_redundancy == "replicas:2"  # a store that does not say replicates, R times
    ec = dataclasses.replace(hello, replicas=1, redundancy="ec:4+1")
    assert hello_from_pb(hello_to_pb(ec)) == ec and hello_from_pb(hello_to_pb(ec)).cluster_redundancy == "ec:4+1"


def test_streams_verify_against_the_core_manifest() -> None:
    chunks = [DATA[i : i + 4096] for i in range(0, len(DATA), 4096)]
    assert manifest_problem(MANIFEST) is None
    dest = bytearray(len(DATA))
    assert receive_chunks(chunks, MANIFEST, memoryview(dest)) == len(DATA) and bytes(dest) == DATA
    bad = [chunks[0], b"x" + chunks[1][1:], chunks[2]]
    with pytest.raises(StreamChecksumError, match="chunk 1 of job/step=7/rank=1 failed its checksum"):
        receive_chunks(bad, MANIFEST, memoryview(bytearray(len(DATA))))
    with pytest.raises(StreamError, match="ended after 2 of 3"):
        receive_chunks(chunks[:2], MANIFEST, memoryview(bytearray(len(DATA))))
    assert "expected 3" in (manifest_problem(Manifest(KEY, 2, len(DATA), 4096, (1, 2), "h0")) or "")
