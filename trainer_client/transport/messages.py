"""What names a planned shard on the wire: its key (checked) and, for a replica group's member, its stripe.

The client speaks plain values and these two; the messages that hand a shard over move with the path that sends them:
each path writes down before the copy what they say (the ``CommitRequest``'s fields in
:mod:`~trainer_client.transport.shared_memory_path`, the ``Manifest`` in :mod:`~trainer_client.transport.remote_path`),
and what sends them completes them (:meth:`trainer_client.capture.ring.CaptureRing.commit`,
:meth:`trainer_client.transport.remote.RemoteTransfer.send`, with the ``PutHeader``).
"""

from __future__ import annotations

from collections.abc import Sequence

from memstore.v1 import store_pb2 as pb
from memstore.v1.keys import key_problem
from trainer_client.errors import InvalidArgumentError


def shard_key(job_id: str, step: int, rank: int, world_size: int, timeline: str = "") -> pb.ShardKey:
    """The key of ``rank``'s shard of ``step``; InvalidArgumentError naming what is wrong with it."""
    problem = key_problem(job_id, step, rank, world_size, timeline)
    if problem:
        raise InvalidArgumentError(problem)
    return pb.ShardKey(job_id=job_id, step=step, rank=rank, timeline=timeline)


def stripe(members: Sequence[int], index: int, logical_nbytes: int, stripe_nbytes: int, slices_only: bool) -> pb.Stripe:
    """A replica group's stripe as the store records it: the group's ranks, this member's index, the sizes, and whether
    the shard holds only the stripe's slices (no own part)."""
    return pb.Stripe(group=members, index=index, logical_nbytes=logical_nbytes, stripe_nbytes=stripe_nbytes, slices_only=slices_only)
