"""The process group a client agrees over when it is not told one: the job's default group, when it is the job.

``CheckpointClient(group=...)`` makes saves, ``latest_step()`` and ``load()`` agree over the job's process group, so that
each store serves O(replicas) calls per saved step instead of listing every store (``trainer_client.floor``,
``trainer_client.agreement``). A job started the usual way (``torchrun``, DDP, FSDP, Ray Train's ``TorchTrainer``) has
that group already: ``torch.distributed``'s default group, whose rank i is the client of rank i. So ``group=None`` (the
default) means *that group, when it is the job's*:

- ``torch.distributed`` is initialized, its default group has the client's ``world_size`` ranks (more than one), and
  this process is the client's ``rank`` in it: the default group (``dist.group.WORLD``);
- otherwise (no process group: Ray tasks, separate processes, ranks as threads; or a group that is not the job's, e.g.
  Lightning's one client of rank 0 in a job of many): none, and the client asks every store as before.

``group=False`` opts out; a process group passes that group. The choice is made once, at the client's first save or
restore (a client made before ``init_process_group`` still finds the group).

With a group, saves, ``latest_step()`` and ``load()`` without a timeline are collectives: every rank calls them at the
same point (a restarted job does; a rank that saves while the others do not would wait for them).
"""

from __future__ import annotations

from typing import Any

from trainer_client.errors import InvalidArgumentError

NO_GROUP = False  # ``group=False``: ask the stores, agree over no process group


def default_job_group(rank: int, world_size: int) -> Any:
    """``torch.distributed``'s default group when it is the job's (see the module doc), else None."""
    if world_size < 2:
        return None
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch always ships it, but a build may lack the distributed package
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size() != world_size or dist.get_rank() != rank:
        return None
    return dist.group.WORLD


def resolve_group(group: Any, rank: int, world_size: int) -> Any:
    """The process group for ``group=`` as passed: None (the default) -> ``default_job_group``, False -> None, a group ->
    itself. Anything else (True, a rank list) is an error naming it."""
    if group is None:
        return default_job_group(rank, world_size)
    if group is NO_GROUP:
        return None
    if group is True or isinstance(group, (int, str, list, tuple)):
        raise InvalidArgumentError(
            f"group={group!r} is invalid: expected a torch.distributed process group, None (the job's default group when there "
            "is one) or False (none)"
        )
    return group
