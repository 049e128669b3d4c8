"""The save path's protobuf messages, built in one place: the shard's key, its stripe, the ``CommitRequest`` that hands a
segment to the store (shared memory) and the ``PutHeader`` with its ``Manifest`` that precedes a sent shard (remote).

The client and both save paths speak plain values (:class:`~trainer_client.transport.save_path.PlannedShard`, a slot's
lease id, checksums); only this module and the transports that carry the messages name ``store_pb2``.
"""

from __future__ import annotations

from collections.abc import Sequence

from memstore.v1 import store_pb2 as pb
from memstore.v1.integrity import CHECKSUM_ALGO
from memstore.v1.keys import key_problem
from trainer_client import serialization
from trainer_client.errors import InvalidArgumentError
from trainer_client.serialization import ChunkSums
from trainer_client.transport.save_path import PlannedShard


def shard_key(job_id: str, step: int, rank: int, world_size: int, timeline: str = "") -> pb.ShardKey:
    """The key of ``rank``'s shard of ``step``; InvalidArgumentError naming what is wrong with it."""
    problem = key_problem(job_id, step, rank, world_size, timeline)
    if problem:
        raise InvalidArgumentError(problem)
    return pb.ShardKey(job_id=job_id, step=step, rank=rank, timeline=timeline)


def stripe(members: Sequence[int], index: int, logical_nbytes: int, stripe_nbytes: int) -> pb.Stripe:
    """A replica group's stripe as the store records it: the group's ranks, this member's index, the sizes."""
    return pb.Stripe(group=members, index=index, logical_nbytes=logical_nbytes, stripe_nbytes=stripe_nbytes)


def commit_request(
    shard: PlannedShard, lease_id: str, spill_codec: str, *, name_key: bool, captured: int | None = None,
    capture: pb.CaptureStats | None = None, capture_seconds: float = 0.0, sums: ChunkSums | None = None,
) -> pb.CommitRequest:  # fmt: skip
    """The ``Commit`` of ``shard`` written into the segment of ``lease_id``.

    ``name_key``: the lease was reserved ahead, before its step was known: the commit names the shard. ``captured``: a
    mark (the first ``captured`` bytes are final; the store starts pushing them) instead of the final commit, which
    carries the ring's ``capture`` report, the capture's seconds and, when the trainer hashed the copy, its ``sums``.
    """
    request = pb.CommitRequest(
        lease_id=lease_id, metrics=shard.metrics, format_version=serialization.FORMAT_VERSION, spill_codec=spill_codec,
        stripe=shard.stripe, restorable_floor=_floor(shard), captured_bytes=captured,
    )  # fmt: skip
    if captured is None:
        if capture is not None:
            request.capture.CopyFrom(capture)
        request.capture_seconds = capture_seconds
        if sums is not None and sums.values is not None:
            request.chunk_size, request.checksum_algo = sums.chunk_size, CHECKSUM_ALGO
            request.chunk_checksums.extend(sums.values)
    if name_key:
        request.key.CopyFrom(shard.key)
        request.nbytes = shard.layout.nbytes
    return request


def put_header(
    shard: PlannedShard, world_size: int, chunk_size: int, checksums: list[int], created: float, spill_codec: str
) -> pb.PutHeader:
    """What precedes ``shard``'s bytes sent to the store: its manifest (``chunk_size``-byte chunks with ``checksums``,
    made at ``created``) and who sends it."""
    key = shard.key
    manifest = pb.Manifest(
        key=key, world_size=world_size, nbytes=shard.layout.nbytes, chunk_size=chunk_size, chunk_checksums=checksums,
        checksum_algo=CHECKSUM_ALGO, format_version=serialization.FORMAT_VERSION, metrics=shard.metrics, created_unix=created,
        spill_codec=spill_codec, stripe=shard.stripe,
    )  # fmt: skip
    return pb.PutHeader(
        manifest=manifest, origin=pb.PUT_ORIGIN_CLIENT, sender_host=f"client-rank-{key.rank}", restorable_floor=_floor(shard)
    )


def _floor(shard: PlannedShard) -> int | None:
    return shard.floor() if shard.floor is not None else None
