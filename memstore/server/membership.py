"""This store's view of the cluster: the slot table, the placement over its slots, and who to talk to.

The table changes in two ways, both through here:

- ``apply(members)``: the discovery watcher reports the current members (``memstore.membership``);
  the table moves on by :func:`memstore.core.slots.next_table`.
- ``adopt(table)``: gossip brought a peer's table that is newer (``SlotTable.newer_than``); its
  assignment replaces ours, with our own addresses for the hosts our source lists (addresses are each
  store's view). Our source's membership is applied again only when it *changes* (re-applying it on
  every adoption would make two stores whose sources disagree for a while bump the version forever).

Every change re-derives the placement and hands the new member list to the peer directory. Readers
take one consistent snapshot (:class:`ClusterView`) and answer from it, so a change in the middle of a
replication or repair pass never mixes two tables.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from memstore.core.placement import Placement
from memstore.core.redundancy import Redundancy
from memstore.core.slots import Slot, SlotTable, next_table
from memstore.membership.members import host_id_problem

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

    def ring_after_me(self) -> list[str]:
        """Every other current member in ring order, starting after this host's slot (slot order if it holds none)."""
        mine = self.my_slot
        slots = self.table.slots if mine is None else (*self.table.slots[mine.index + 1 :], *self.table.slots[: mine.index])
        return [s.host_id for s in slots if s.host_id and s.host_id != self.host_id]

    def replication_targets(self) -> list[str]:
        """Hosts that hold this host's slot's group now. A vacant group slot is stood in for by the next held
        slot after ours (ring order), so a save still reaches R copies while the slot waits for a new holder."""
        mine = self.my_slot
        if mine is None or self.placement is None:
            return []
        holders = [self.table.holder(name) for name in self.placement.peers_of(mine.name)]
        targets = [h for h in holders if h and h != self.host_id]
        missing = len(holders) - len(targets)
        if missing:
            targets += [h for h in self.ring_after_me() if h not in targets][:missing]
        return targets

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

    def __init__(
        self, host_id: str, strategy: str, replicas: int | Redundancy, on_change: Callable[[ClusterView], None] | None = None
    ) -> None:
        """``replicas``: R, or the redundancy scheme (``replicas:R`` or ``ec:K+M``) placement is computed for."""
        self.host_id = host_id
        self.strategy = strategy
        self.replicas = replicas
        self._on_change = on_change
        self._lock = threading.Lock()
        self._members: dict[str, tuple[str, str]] = {}
        self._view = ClusterView(host_id, SlotTable(), None)
        self._newer_at: set[str] = set()  # members whose Hello showed a newer table than ours: pull from them
        self._hint = threading.Event()

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
        """A peer (``source``) holds ``table``: take its assignment if it is newer than ours. True if ours changed."""
        bad = next((s.host_id for s in table.slots if s.host_id and host_id_problem(s.host_id)), None)
        if bad is not None:
            log.warning("gossip from %s: ignoring a slot table with an invalid host id %r", source, bad[:80])
            return False
        with self._lock:
            if not table.newer_than(self._view.table):
                return False
            local = {s.index: replace(s, address=self._members[s.host_id][0]) for s in table.slots if s.host_id in self._members}
            ours = SlotTable(table.version, tuple(local.get(s.index, s) for s in table.slots))
            return self._move_to(ours, f"gossip from {source}")

    def answer_gossip(self, ours: SlotTable, version: int, digest: str, asker: str) -> bool:
        """A member (``asker``) gossips with us holding table ``(version, digest)``; ``ours`` is the table we answer
        with. True if ours is newer (send it whole). If the asker's is newer, remember to pull it (push-pull:
        ``take_newer_at``); an asker our table does not list is left to the next rounds."""
        theirs = (version, digest)
        if theirs > (ours.version, ours.digest) and asker in ours.members() and asker != self.host_id:
            with self._lock:
                self._newer_at.add(asker)
            self._hint.set()
        return (ours.version, ours.digest) > theirs

    def take_newer_at(self, timeout: float) -> list[str]:
        """Wait up to ``timeout`` for a member known to hold a newer table; those heard of since the last call."""
        self._hint.wait(timeout)
        with self._lock:
            self._hint.clear()
            hosts, self._newer_at = sorted(self._newer_at), set()
        return hosts

    def wake(self) -> None:
        """End a ``take_newer_at`` wait now (shutdown)."""
        self._hint.set()

    def _move_to(self, table: SlotTable, why: str) -> bool:
        if table == self._view.table:
            return False
        old = self._view.table
        placement = old_placement = self._view.placement
        if not table.same_assignment(old):
            placement = table.placement(self.strategy, self.replicas)
            labels = [bool(s.domain) for s in table.slots]
            if any(labels) and not all(labels):
                log.warning("membership v%d: some slots have no failure-domain label: placement ignores domains", table.version)
        view = ClusterView(self.host_id, table, placement)
        if self._on_change is not None:
            self._on_change(view)  # the peer directory learns new members before anything uses the new view
        self._view = view
        if table.same_assignment(old) and placement is old_placement:
            return True  # addresses only
        log.info(
            "membership v%d -> v%d (%s): %s",
            old.version,
            table.version,
            why,
            ", ".join(f"{s.name}={s.host_id or '(vacant)'}" for s in table.slots),
        )
        return True
