"""Conversions between the wire messages (memstore.v1) and the core's plain types."""

from __future__ import annotations

from memstore.core.model import Manifest, ShardKey, ShardState
from memstore.v1 import store_pb2 as pb

_STATE_TO_PB: dict[ShardState, int] = {
    ShardState.CAPTURED: pb.SHARD_STATE_CAPTURED,
    ShardState.REPLICATING: pb.SHARD_STATE_REPLICATING,
    ShardState.COMMITTED: pb.SHARD_STATE_COMMITTED,
    ShardState.UNDER_REPLICATED: pb.SHARD_STATE_UNDER_REPLICATED,
    ShardState.REPLICA: pb.SHARD_STATE_REPLICA,
}
_STATE_FROM_PB = {v: k for k, v in _STATE_TO_PB.items()}


def key_to_pb(key: ShardKey) -> pb.ShardKey:
    return pb.ShardKey(job_id=key.job_id, step=key.step, rank=key.rank, timeline=key.timeline)


def key_from_pb(key: pb.ShardKey) -> ShardKey:
    return ShardKey(key.job_id, key.step, key.rank, key.timeline)


def manifest_to_pb(m: Manifest) -> pb.Manifest:
    from memstore.v1.integrity import CHECKSUM_ALGO

    return pb.Manifest(
        key=key_to_pb(m.key),
        world_size=m.world_size,
        nbytes=m.nbytes,
        chunk_size=m.chunk_size,
        chunk_checksums=list(m.checksums),
        checksum_algo=CHECKSUM_ALGO,
        owner_host=m.owner_host,
        format_version=m.format_version,
        metrics=dict(m.metrics),
        created_unix=m.created_unix,
        spill_codec=m.spill_codec,
    )


def manifest_from_pb(m: pb.Manifest) -> Manifest:
    return Manifest(
        key=key_from_pb(m.key),
        world_size=m.world_size,
        nbytes=m.nbytes,
        chunk_size=m.chunk_size,
        checksums=tuple(m.chunk_checksums),
        owner_host=m.owner_host,
        format_version=m.format_version,
        metrics=dict(m.metrics),
        created_unix=m.created_unix,
        spill_codec=m.spill_codec,
    )


def state_to_pb(state: ShardState) -> pb.ShardState:
    return _STATE_TO_PB[state]  # type: ignore[return-value]


def state_from_pb(state: int) -> ShardState | None:
    return _STATE_FROM_PB.get(state)
