"""Which ranks of a job hold the same state: a data-parallel replica group, as ``CheckpointClient(replica_group=...)``
names it.

Under DDP every rank holds the same model and optimizer state (the group is ``torch.distributed.group.WORLD``);
under HSDP the ranks of one replicate group do (the mesh's ``"replicate"`` dimension); under ZeRO-1 the model is
replicated across the data-parallel group and the optimizer is not (``save(..., replicated=["model"])``). The
members save one logical shard between them (:mod:`trainer_client.stripes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trainer_client.errors import InvalidArgumentError

__all__ = ["ReplicaGroup", "resolve_replica_group"]


@dataclass(frozen=True)
class ReplicaGroup:
    """The job ranks that promise identical states, in stripe order, and this rank's position among them."""

    members: tuple[int, ...]
    index: int
    process_group: Any = None  # the torch.distributed group it came from (None: given as a list of ranks)

    @property
    def size(self) -> int:
        return len(self.members)


def resolve_replica_group(replica_group: Any, rank: int, world_size: int, verify: bool = False) -> ReplicaGroup | None:
    """``replica_group`` as given to the client: None, a ``torch.distributed`` process group (its members are the
    default group's ranks, which must be the job's ranks), or a sequence of job ranks (no collective is then possible,
    so ``verify`` (``verify_replicas``) is not either). Raises InvalidArgumentError naming what is wrong."""
    if verify and (replica_group is None or isinstance(replica_group, (list, tuple, range))):
        raise InvalidArgumentError("verify_replicas=True needs replica_group= to be a torch.distributed process group")
    if replica_group is None:
        return None
    process_group = None
    if isinstance(replica_group, (list, tuple, range)):
        members = tuple(replica_group)
        what = f"replica_group={list(members)!r}"
    else:
        members, process_group = _members_of(replica_group), replica_group
        what = f"replica_group (a process group of ranks {list(members)!r})"
    if not members:
        raise InvalidArgumentError(f"{what} is empty: expected the job ranks that hold this rank's state, this rank ({rank}) among them")
    bad = [r for r in members if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < world_size]
    if bad:
        raise InvalidArgumentError(f"{what} names ranks outside 0..{world_size - 1}: {bad!r}")
    if len(set(members)) != len(members):
        raise InvalidArgumentError(f"{what} names a rank twice")
    if rank not in members:
        raise InvalidArgumentError(f"{what} does not include this rank ({rank})")
    return ReplicaGroup(members, members.index(rank), process_group)


def _members_of(group: Any) -> tuple[int, ...]:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise InvalidArgumentError(
            f"replica_group={group!r}: torch.distributed is not initialized; pass a process group of an initialized job, "
            "or the list of job ranks"
        )
    try:
        ranks: Sequence[int] = dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError, TypeError, AttributeError) as exc:
        raise InvalidArgumentError(f"replica_group={group!r} is not a process group of this job: {exc}") from None
    return tuple(int(r) for r in ranks)
