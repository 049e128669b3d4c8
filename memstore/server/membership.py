"""This store's view of the cluster: the slot table, the placement over its slots, and who to talk to.

The table changes in two ways, both through here:

- ``apply(members)``: the discovery watcher reports the current members (``memstore.membership``);
  the table moves on by :func:`memstore.core.slots.next_table`.
- ``adopt(table)``: gossip brought a peer's table that is newer (``SlotTable.newer_than``); it replaces
  ours, then our own view of the members is applied on top (a no-op once the sources agree).

Every change re-derives the placement and hands the new member list to the peer directory. Readers
take one consistent snapshot (:class:`ClusterView`) and answer from it, so a change in the middle of a
replication or repair pass never mixes two tables.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from memstore.core.placement import Placement
from memstore.core.slots import Slot, SlotTable, next_table

log = logging.getLogger(__name__)

MemberView = Mapping[str, tuple[str, str]]  # host id -> (address, failure domain), in the source's order


@dataclass(frozen=True)
class ClusterView:
    """One consistent snapshot: the table, its placement, and this host's place in it."""

    host_id: str
    table: SlotTable
    placement: Placement | None

    @property
    def my_slot(self) -> Slot | None:
        return self.table.slot_of(self.host_id)

    def others(self) -> list[str]:
        """Every other current member, in slot order."""
        return [h for h in self.table.members() if h != self.host_id]

    def replication_targets(self) -> list[str]:
        """Hosts that hold this host's slot's group now (vacant slots are skipped: the copy is missing until filled)."""
        mine = self.my_slot
        if mine is None or self.placement is None:
            return []
        holders = (self.table.holder(name) for name in self.placement.peers_of(mine.name))
        return [h for h in holders if h and h != self.host_id]

    def owned_slots(self) -> set[str]:
        """Names of the slots whose shards this host must hold (its own first)."""
        mine = self.my_slot
        if mine is None or self.placement is None:
            return set()
        return set(self.placement.owners_held_by(mine.name))

    def repair_sources(self, owners: set[str]) -> list[str]:
        """Current holders of every slot that holds any of ``owners``' shards, this host excluded."""
        if self.placement is None:
            return []
        names = {h for o in owners for h in self.placement.holders(o)}
        return sorted(h for h in (self.table.holder(n) for n in names) if h and h != self.host_id)

    def slot_name_of_owner(self, owner_host: str) -> str:
        """The slot whose shards ``owner_host`` wrote ("" if the table does not know that host)."""
        slot = self.table.owner_slot(owner_host)
        return slot.name if slot else ""


class Membership:
    """Holds the current :class:`ClusterView` and moves it on; ``on_change(view)`` runs after each change."""

    def __init__(self, host_id: str, strategy: str, replicas: int, on_change: Callable[[ClusterView], None] | None = None) -> None:
        self.host_id = host_id
        self.strategy = strategy
        self.replicas = replicas
        self._on_change = on_change
        self._lock = threading.Lock()
        self._members: dict[str, tuple[str, str]] = {}
        self._view = ClusterView(host_id, SlotTable(), None)

    @property
    def view(self) -> ClusterView:
        return self._view

    @property
    def members(self) -> dict[str, tuple[str, str]]:
        """The last members the discovery source reported (host id -> (address, domain))."""
        with self._lock:
            return dict(self._members)

    def apply(self, members: MemberView) -> bool:
        """Our discovery source reports ``members``. True if the table changed."""
        with self._lock:
            self._members = dict(members)
            return self._move_to(next_table(self._view.table, self._members), "discovery")

    def adopt(self, table: SlotTable, source: str) -> bool:
        """A peer (``source``) holds ``table``: take it if it is newer than ours. True if ours changed."""
        with self._lock:
            if not table.newer_than(self._view.table):
                return False
            ours = next_table(table, self._members) if self._members else table
            return self._move_to(ours, f"gossip from {source}")

    def _move_to(self, table: SlotTable, why: str) -> bool:
        if table == self._view.table:
            return False
        placement = table.placement(self.strategy, self.replicas)
        old = self._view.table
        self._view = ClusterView(self.host_id, table, placement)
        log.info(
            "membership v%d -> v%d (%s): %s",
            old.version,
            table.version,
            why,
            ", ".join(f"{s.name}={s.host_id or '(vacant)'}" for s in table.slots),
        )
        if self._on_change is not None:
            self._on_change(self._view)
        return True
