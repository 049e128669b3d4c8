"""The shard key and manifest as the wire carries them, converted to and from the core's plain types.

Both sides of the wire need these: the store converts at its boundary (``memstore.server.convert``
re-exports them with its other conversions), and the trainer client converts a received manifest
once before verifying the stream it describes (``memstore.v1.streams``). Both also write a restorable floor into the
messages that carry one (:func:`set_floor`).
"""

from __future__ import annotations

from memstore.core.model import Manifest, ShardKey, Stripe
from memstore.errors import ManifestTooLarge
from memstore.v1 import store_pb2 as pb
from memstore.v1.integrity import CHECKSUM_ALGO, MAX_CHUNKS_PER_SHARD
from memstore.v1.keys import MAX_METRICS, MAX_WORLD_SIZE


def key_to_pb(key: ShardKey) -> pb.ShardKey:
    return pb.ShardKey(job_id=key.job_id, step=key.step, rank=key.rank, timeline=key.timeline)


def key_from_pb(key: pb.ShardKey) -> ShardKey:
    return ShardKey(key.job_id, key.step, key.rank, key.timeline)


def stripe_to_pb(s: Stripe | None) -> pb.Stripe | None:
    if s is None:
        return None
    return pb.Stripe(
        group=list(s.group), index=s.index, logical_nbytes=s.logical_nbytes, stripe_nbytes=s.stripe_nbytes, slices_only=s.slices_only
    )


def stripe_from_pb(s: pb.Stripe, job_id: str = "") -> Stripe:
    """The core's stripe (validate it with ``memstore.v1.streams.stripe_problem``); ManifestTooLarge before converting
    a group of more ranks than a job may have."""
    if len(s.group) > MAX_WORLD_SIZE:
        raise ManifestTooLarge(
            f"stripe of {job_id!r:.140} names a replica group of {len(s.group)} ranks: at most {MAX_WORLD_SIZE} (MAX_WORLD_SIZE)"
        )
    return Stripe(tuple(s.group), s.index, s.logical_nbytes, s.stripe_nbytes, s.slices_only)


def manifest_to_pb(m: Manifest) -> pb.Manifest:
    return pb.Manifest(
        key=key_to_pb(m.key),
        world_size=m.world_size,
        nbytes=m.nbytes,
        chunk_size=m.chunk_size,
        chunk_checksums=list(m.checksums),
        checksum_algo=CHECKSUM_ALGO if m.chunk_size else "",  # chunk_size 0: not checksummed yet (a CAPTURED copy)
        owner_host=m.owner_host,
        format_version=m.format_version,
        metrics=dict(m.metrics),
        created_unix=m.created_unix,
        spill_codec=m.spill_codec,
        stripe=stripe_to_pb(m.stripe),
    )


def manifest_from_pb(m: pb.Manifest) -> Manifest:
    """The core's manifest; StreamError before converting anything large (more checksums, metrics or stripe ranks than a
    shard may have)."""
    if len(m.chunk_checksums) > MAX_CHUNKS_PER_SHARD:
        raise ManifestTooLarge(
            f"manifest of {m.key.job_id!r:.140} carries {len(m.chunk_checksums)} chunk checksums: at most {MAX_CHUNKS_PER_SHARD} "
            "(MAX_CHUNKS_PER_SHARD) per shard; raise the sender's --chunk-bytes"
        )
    if len(m.metrics) > MAX_METRICS:
        raise ManifestTooLarge(
            f"manifest of {m.key.job_id!r:.140} carries {len(m.metrics)} metrics: at most {MAX_METRICS} (MAX_METRICS) per shard"
        )
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
        stripe=stripe_from_pb(m.stripe, m.key.job_id) if m.HasField("stripe") else None,
    )


def set_floor(
    message: pb.CommitRequest | pb.WaitCommittedRequest | pb.PutHeader | pb.AllocateRequest, floor: int | None, timeline: str
) -> None:
    """Put the floor (``floor`` of ``timeline``; "" = the shard's) in ``message``: the form a store that predates
    ``restorable_floor_version`` ignores when it is of another timeline (it lists then, as without a floor)."""
    if floor is None:
        return
    if timeline:
        message.restorable_floor_version.CopyFrom(pb.FloorVersion(step=floor, timeline=timeline))
    else:
        message.restorable_floor = floor
