"""When to spill a step to durable storage, and which spilled steps to keep. Pure functions.

Every store decides on its own, so the decisions must agree without talking: the step-count
trigger picks steps by a rule every store computes alike (``step % every_steps == 0``); the time
trigger is coordinated through an intent marker in durable storage (see ``memstore.spill``).
Who spills a shard (``spill_duty``) is decided from the slot table every store holds, alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memstore.core.placement import Placement
    from memstore.core.slots import SlotTable


@dataclass(frozen=True)
class RetentionPolicy:
    keep_last: int = 2
    keep_best: int = 0
    metric: str = ""
    higher_is_better: bool = False

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (the newest spilled step is never deleted), got {self.keep_last}")
        if self.keep_best < 0:
            raise ValueError(f"keep_best must be >= 0, got {self.keep_best}")
        if self.keep_best and not self.metric:
            raise ValueError("keep_best needs a metric name")


def due_by_steps(step: int, every_steps: int) -> bool:
    """The step-count trigger: every store picks the same steps."""
    return every_steps > 0 and step > 0 and step % every_steps == 0


def due_by_time(last_spill_time: float | None, now: float, every_seconds: float) -> bool:
    return every_seconds > 0 and (last_spill_time is None or now - last_spill_time >= every_seconds)


def spill_duty(owner_host: str, table: SlotTable, placement: Placement | None) -> str:
    """The host that spills (and collects from durable storage) the shards ``owner_host`` captured.

    The owner's slot (the one it holds, else the one it left last: ``SlotTable.owner_slot``) and its group
    peers, in placement order (the owner's slot first): the current holder of the first of them that is
    held. So the owner spills its own shards while it holds its slot; once it is gone the slot's successor
    does (the same host id restarted, or a new host in its slot: it holds the shards again after repair);
    while the slot is vacant, the next group peer in placement order does. Every store computes this from
    the same table, so in steady state exactly one store spills each shard. "" when every slot of the
    group is vacant. Without a table (a single store), or for an owner the table never knew, the owner.
    """
    slot = table.owner_slot(owner_host) if owner_host else None
    if slot is None or placement is None:
        return owner_host
    return next((h for h in map(table.holder, placement.holders(slot.name)) if h), "")


def steps_to_keep(complete: Mapping[int, Mapping[str, float]], policy: RetentionPolicy) -> set[int]:
    """Of the complete spilled steps (step -> metrics), those retention keeps: the newest
    ``keep_last`` plus the best ``keep_best`` by ``metric`` (steps lacking the metric never rank)."""
    newest = sorted(complete, reverse=True)[: policy.keep_last]
    keep = set(newest)
    if policy.keep_best:
        scored = [(m[policy.metric], s) for s, m in complete.items() if policy.metric in m]
        scored.sort(key=lambda vs: (-vs[0] if policy.higher_is_better else vs[0], -vs[1]))
        keep.update(s for _, s in scored[: policy.keep_best])
    return keep


def steps_to_delete(complete: Mapping[int, Mapping[str, float]], incomplete: Iterable[int], policy: RetentionPolicy) -> set[int]:
    """Complete steps outside retention, and incomplete steps with ``keep_last`` complete steps after them.

    Another store may still be spilling an incomplete step; once ``keep_last`` newer steps are complete
    retention would drop it anyway, so only then is it debris. Before that it is left alone.
    """
    keep = steps_to_keep(complete, policy)
    doomed = {s for s in complete if s not in keep}
    newest_kept = sorted(complete, reverse=True)[: policy.keep_last]
    if len(newest_kept) == policy.keep_last:
        floor = min(newest_kept)
        doomed.update(s for s in incomplete if s < floor)
    return doomed
