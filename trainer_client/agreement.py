"""The collectives of ``latest_step(group=...)``: every rank's local view, agreed over the job's process group.

Internal to ``CheckpointClient`` (users call ``latest_step``); not public API.

The protocol and its rules are :mod:`memstore.core.agreement`; this module only moves its values
between ranks. It uses nothing but ``all_reduce`` (a broadcast is an all-reduce MAX with zeros from
every other rank), so any ``torch.distributed`` process group works: one made by ``init_process_group``
or ``new_group``, or a backend object made directly. Tensors live on the GPU for NCCL groups, else on
the CPU.

Every rank takes part in every collective even when its own question failed: a failure travels in
the values (an ``ok`` flag), so all ranks raise together instead of some waiting forever in a
collective the others left.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from memstore.core.agreement import Seen, decide, decode_candidates, encode_candidates, rank_vector
from trainer_client.errors import InvalidArgumentError, StoreUnavailableError

log = logging.getLogger(__name__)
_FAILED = b"!"  # rank 0 shares this instead of candidates when its own question failed
#: How long the ranks ask again, together, when the answer is older than a step some rank has seen and a store could
#: not list a peer (its view was incomplete): a live peer that was slow or restarting must not cost committed steps.
INCOMPLETE_RETRY_SECONDS = 5.0
INCOMPLETE_RETRY_PAUSE = 0.5
LocalAnswer = tuple[list[Seen], bool]  # this rank's versions, and whether its store listed every peer it asked
ClusterAnswer = tuple[Seen | None, bool]  # the cluster-wide answer, and whether every store answered


@dataclass
class AgreementStats:
    """What one agreement cost this rank: calls to its store, collectives, and whether the fallback ran."""

    rpcs: int = 0
    collectives: int = 0
    fallback: bool = False
    retries: int = 0  # rounds asked again because a view was incomplete (INCOMPLETE_RETRY_SECONDS)


@dataclass
class Agreements:
    """A client's memory of ``latest_step(group=...)``: what the last one cost, the point it agreed (used once by
    the ``load(step, group=...)`` right after it), and agreed versions complete on the durable tier (a restore of
    those reads durable storage without listing it)."""

    stats: AgreementStats = field(default_factory=AgreementStats)
    point: Any = None
    durable: set[tuple[int, str]] = field(default_factory=set)


def collective_device(group: Any) -> torch.device:
    """Where an all-reduce over ``group`` wants its tensors: the current GPU for NCCL, else the CPU."""
    name = str(group.name()).lower() if hasattr(group, "name") else ""
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in name else torch.device("cpu")


def group_problem(group: Any, rank: int, world_size: int) -> tuple[int, InvalidArgumentError | None]:
    """This process's rank in ``group``, and why the group is not the job's (None when it is): one member per rank,
    this client's rank at its own place. Raises at once for an object that is no process group at all."""
    try:
        size, me = int(group.size()), int(group.rank())
    except (AttributeError, TypeError, RuntimeError) as exc:
        raise InvalidArgumentError(f"group {group!r:.80} is not a torch.distributed process group: {exc}") from None
    if size != world_size or me != rank:
        return me, InvalidArgumentError(
            f"group has {size} ranks and this process is its rank {me}, but the client is rank {rank} of {world_size}: "
            "pass the job's process group (its rank i must be the client of rank i)"
        )
    return me, None


class _Collectives:
    def __init__(self, group: Any, stats: AgreementStats) -> None:
        self.group = group
        self.device = collective_device(group)
        self.stats = stats

    def _reduce(self, tensor: torch.Tensor, op: Any) -> torch.Tensor:
        import torch.distributed as dist

        self.stats.collectives += 1
        dist.all_reduce(tensor, op=op, group=self.group)
        return tensor.cpu()

    def share(self, data: bytes | None) -> bytes:
        """Rank 0's bytes (``data``; None on the others) on every rank: its length, then its bytes."""
        import torch.distributed as dist

        n = torch.tensor([0 if data is None else len(data)], dtype=torch.int64, device=self.device)
        length = int(self._reduce(n, dist.ReduceOp.MAX)[0])
        buf = torch.zeros(length, dtype=torch.uint8)
        if data is not None and length:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return bytes(self._reduce(buf.to(self.device), dist.ReduceOp.MAX).numpy().tobytes())

    def minimum(self, values: list[int]) -> list[int]:
        import torch.distributed as dist

        return [int(x) for x in self._reduce(torch.tensor(values, dtype=torch.int64, device=self.device), dist.ReduceOp.MIN).tolist()]


def agree(
    group: Any,
    rank: int,
    world_size: int,
    step: int | None,
    ask_local: Callable[[], LocalAnswer],
    ask_cluster: Callable[[], ClusterAnswer],
    stats: AgreementStats,
    retry_seconds: float = INCOMPLETE_RETRY_SECONDS,
) -> Seen | None:
    """The version every rank restores (the same on all of them), or None if nothing is restorable.

    ``ask_local``: this rank's scoped question to its store; ``ask_cluster``: the cluster-wide one (rank 0
    asks it only when the scoped views cannot decide). A failure of either raises on every rank.

    Each answer says whether its store heard from every peer it asked. When the agreed version is older than a step
    some rank has seen and an answer was incomplete, the ranks ask again together for up to ``retry_seconds`` (a peer
    that was restarting or slow answers by then); after that the older version stands, with a warning (the peer is
    really gone: what it held is lost or on the durable tier).
    """

    def one_round(may_retry: bool) -> tuple[Seen | None, bool]:
        """One round of :func:`agree`: its answer, and whether every rank asks again (decided together)."""
        me, problem = group_problem(group, rank, world_size)  # a wrong group still takes part: its members raise together
        error: Exception | None = problem
        root = me == 0
        comm = _Collectives(group, stats)
        mine: list[Seen] = []
        complete = True
        if error is None:
            try:
                mine, complete = ask_local()
            except Exception as exc:  # raised on every rank below, after the collectives
                error = exc
        shared = comm.share((_FAILED if error else encode_candidates(mine)) if root else None)
        if shared == _FAILED:
            _raise(error, "rank 0's store could not say which versions it holds")
        candidates = decode_candidates(shared)
        reduced = comm.minimum([*rank_vector(candidates, mine, rank), 1 if complete else 0, 0 if error else 1])
        if reduced[-1] == 0:
            _raise(error, "at least one rank could not ask its store (or passed a group that is not the job's)")
        decision = decide(candidates, reduced[:-2], world_size, step)
        complete = reduced[-2] == 1  # every rank's store listed its whole group
        scoped: Seen | None = None  # the version every rank's own store vouched for, if any
        if decision.version is not None:
            chosen = next(c for c in candidates if (c.step, c.timeline) == (decision.version.step, decision.version.timeline))
            scoped = Seen(chosen.step, chosen.timeline, world_size, decision.version.created_unix, (), chosen.durable)
        if not decision.fallback:
            return scoped, False
        stats.fallback = True
        result, cluster_complete = _fallback(comm, root, ask_cluster, scoped)
        if step is not None or (result is not None and result.step >= decision.newest_seen):
            return result, False
        # Older than a step some rank has seen: was every view whole? Decided together (rank 0's cluster-wide answer, and
        # every rank's deadline), so all ranks ask again or none does.
        return result, _ask_again(comm, complete and cluster_complete, may_retry, result, decision.newest_seen)

    deadline = time.monotonic() + retry_seconds
    while True:
        found, stale = one_round(time.monotonic() < deadline)
        if not stale:
            return found
        stats.retries += 1
        time.sleep(INCOMPLETE_RETRY_PAUSE)


def _ask_again(comm: _Collectives, complete: bool, may_retry: bool, result: Seen | None, newest_seen: int) -> bool:
    """Whether every rank asks again: some view was incomplete and no rank is past its deadline (decided together).
    Past it, ``result`` (older than ``newest_seen``) stands, with a warning."""
    flags = comm.minimum([1 if complete else 0, 1 if may_retry else 0])
    if flags[0] == 1:
        return False
    if flags[1] == 1:
        return True
    log.warning("latest_step(group=...): restoring %s although a rank has seen step %d: a store could not list a peer "
                "for %.0f s (a lost host: its newer copies are gone or on the durable tier)",
                "nothing" if result is None else f"step {result.step}", newest_seen, INCOMPLETE_RETRY_SECONDS)  # fmt: skip
    return False


def _fallback(comm: _Collectives, root: bool, ask_cluster: Callable[[], ClusterAnswer], scoped: Seen | None) -> ClusterAnswer:
    """Rank 0 asks the cluster-wide question and shares the answer: the version every rank restores, and whether every
    store answered rank 0's store (only rank 0 knows; the caller reduces it)."""
    error: Exception | None = None
    answer: list[Seen] = []
    complete = True
    if root:
        try:
            found, complete = ask_cluster()
            answer = [] if found is None else [found]
        except Exception as exc:
            error = exc
    shared = comm.share((_FAILED if error else encode_candidates(answer)) if root else None)
    if shared == _FAILED:
        _raise(error, "rank 0 could not ask the cluster which step is restorable")
    agreed = decode_candidates(shared)
    if not agreed and scoped is not None:
        # The cluster-wide listing found nothing restorable, yet every rank's store holds a verified copy of ``scoped``:
        # that listing missed stores (e.g. one whose slot a partial discovery answer left vacant for a moment). Every
        # rank decides this alike (the same decision, the same shared answer).
        log.warning("latest_step(group=...): the cluster-wide listing found no restorable step, yet every rank's store holds "
                    "step %d (%s): restoring that", scoped.step, scoped.timeline)  # fmt: skip
        return scoped, complete
    return (agreed[0] if agreed else None), complete


def _raise(error: Exception | None, what: str) -> None:
    if error is not None:
        raise error
    raise StoreUnavailableError(f"latest_step(group=...): {what}; every rank of the group raises")
