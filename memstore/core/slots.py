"""Slots: the ordered places of a cluster that placement is computed over, and who holds each now.

Placement (GEMINI mixed or ring, with failure domains) is a function of the *slots*, never of host
names: a host that replaces a lost one under a new name takes over the lost host's slot, so every
other slot keeps its group and every committed step keeps the holders it was written with.

The rules (every store applies them to the same inputs and gets the same table):

- ``next_table(table, members)``: a slot whose holder is no longer a member is vacated (its holder is
  remembered in ``former``, with the version at which it left). A member that holds a slot keeps it.
  Each member without a slot, in the order the discovery source lists them, takes: the vacant slot it
  held most recently, if any; else the lowest vacant slot; else a new slot at the end. The table's
  version goes up by one when the *assignment* (who holds which slot) changed.
- Addresses are each store's own view (a peer may be reached through a proxy or another name): they
  are not part of the assignment, never bump the version and are not compared between stores.
- Two tables are ordered by ``(version, digest)`` (the digest covers the assignment only); a store
  adopts a peer's table when it is newer and applies its own discovery source's *changes* on top of
  whatever it holds. Every store's last change is the sources' final membership, and the newest table
  is some store's last change, so stores converge on one assignment once their sources agree.
- Shards record their owner's host id; ``owner_slot(host)`` maps it to the slot that host held (its
  current slot, else the slot it left last), so a replacement repairs its predecessor's shards.

Plain Python: no gRPC, no torch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from memstore.core.placement import Placement, make_placement
from memstore.core.redundancy import Redundancy

FORMER_KEPT = 8  # earlier holders remembered per slot (enough to map recent shards to their slot)
MAX_SLOTS = 4096  # a table from the network with more is refused


class SlotTableError(ValueError):
    """A slot table received from a peer is malformed."""


@dataclass(frozen=True)
class Slot:
    index: int
    host_id: str = ""  # "" while vacant
    address: str = ""
    domain: str = ""  # failure-domain label of the current (or last) holder
    former: tuple[str, ...] = ()  # earlier holders, oldest first
    former_until: tuple[int, ...] = ()  # the table version at which each of them left (same length)

    @property
    def vacant(self) -> bool:
        return not self.host_id

    @property
    def name(self) -> str:
        """The slot's identity in placement."""
        return slot_name(self.index)

    @property
    def assignment(self) -> tuple[object, ...]:
        """Everything but the address: what stores must agree on."""
        return (self.index, self.host_id, self.domain, self.former, self.former_until)

    def left_at(self, host_id: str) -> int:
        """The version at which ``host_id`` last left this slot (-1 if it never held it)."""
        return max((v for h, v in zip(self.former, self.former_until, strict=True) if h == host_id), default=-1)


def slot_name(index: int) -> str:
    return f"slot{index}"


@dataclass(frozen=True)
class SlotTable:
    version: int = 0
    slots: tuple[Slot, ...] = ()
    _digest: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        problem = table_problem(self)
        if problem:
            raise SlotTableError(problem)
        canonical = json.dumps([self.version, [s.assignment for s in self.slots]], separators=(",", ":"))
        object.__setattr__(self, "_digest", hashlib.sha256(canonical.encode()).hexdigest()[:16])

    @property
    def digest(self) -> str:
        """Content hash: two tables of one version with different slots are told apart (and ordered) by it."""
        return self._digest

    def newer_than(self, other: SlotTable) -> bool:
        return (self.version, self.digest) > (other.version, other.digest)

    @property
    def layout(self) -> tuple[tuple[int, str, str], ...]:
        """(index, holder, domain) of every slot: what decides which shards each store holds, whatever the version."""
        return tuple((s.index, s.host_id, s.domain) for s in self.slots)

    def same_assignment(self, other: SlotTable) -> bool:
        return self.version == other.version and self.digest == other.digest

    def slot_of(self, host_id: str) -> Slot | None:
        """The slot ``host_id`` holds now, if any."""
        return next((s for s in self.slots if s.host_id == host_id), None)

    def owner_slot(self, owner_host: str) -> Slot | None:
        """The slot whose shards ``owner_host`` wrote: the one it holds, else the one it held most recently."""
        held = self.slot_of(owner_host)
        if held is not None:
            return held
        best = max(self.slots, key=lambda s: s.left_at(owner_host), default=None)
        return best if best is not None and best.left_at(owner_host) >= 0 else None

    def members(self) -> dict[str, str]:
        """host id -> address of every current holder, in slot order."""
        return {s.host_id: s.address for s in self.slots if not s.vacant}

    def holder(self, name: str) -> str:
        """Current holder of the slot named ``name`` ("" if vacant or unknown)."""
        for s in self.slots:
            if s.name == name:
                return s.host_id
        return ""

    def placement(self, strategy: str, replicas: int | Redundancy) -> Placement | None:
        """Placement over the slots (vacant ones included: they keep their place) for ``replicas`` R (an int or
        ``replicas:R``) or ``ec:K+M``. None without slots, and for ``ec:K+M`` while there are fewer than K+M slots
        (no group can form yet).

        With fewer slots than ``replicas`` every slot holds everything (R is capped at the slot count).
        Failure domains apply when every slot has a label.
        """
        scheme = replicas if isinstance(replicas, Redundancy) else Redundancy.of_replicas(replicas)
        if not self.slots or (scheme.erasure_coded and len(self.slots) < scheme.group_size):
            return None
        names = [s.name for s in self.slots]
        domains = {s.name: s.domain for s in self.slots}
        labelled = all(domains.values())
        capped = scheme if scheme.erasure_coded else Redundancy.of_replicas(min(scheme.replicas, len(names)))
        return make_placement(strategy, names, capped, domains if labelled else None)

    def to_dict(self) -> dict[str, object]:
        return {
            "version": self.version,
            "slots": [
                {
                    "index": s.index,
                    "host_id": s.host_id,
                    "address": s.address,
                    "domain": s.domain,
                    "former": list(s.former),
                    "former_until": list(s.former_until),
                }
                for s in self.slots
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> SlotTable:
        """Parse (and validate) a table from its ``to_dict`` form; SlotTableError names what is wrong."""
        try:
            raw = data["slots"]
            if not isinstance(raw, list):
                raise SlotTableError("slot table: 'slots' must be a list")
            version = data["version"]
            if not isinstance(version, int):
                raise SlotTableError(f"slot table: version {version!r} is not an int")
            return cls(version, tuple(_slot_from_dict(s) for s in raw))
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            if isinstance(exc, SlotTableError):
                raise
            raise SlotTableError(f"slot table is malformed: {type(exc).__name__}: {exc}") from None


def _slot_from_dict(s: object) -> Slot:
    if not isinstance(s, Mapping):
        raise SlotTableError(f"slot table: slot {s!r} is not an object")
    former, until = s.get("former", []), s.get("former_until", [])
    if not isinstance(former, list) or not isinstance(until, list):
        raise SlotTableError(f"slot table: 'former'/'former_until' of slot {s.get('index')!r} is not a list")
    return Slot(int(s["index"]), str(s["host_id"]), str(s["address"]), str(s.get("domain", "")), tuple(map(str, former)),
                tuple(int(v) for v in until))  # fmt: skip


def table_problem(table: SlotTable) -> str | None:
    if table.version < 0:
        return f"slot table version {table.version} is negative"
    if table.version == 0 and table.slots:
        return "slot table of version 0 must be empty"
    if len(table.slots) > MAX_SLOTS:
        return f"slot table has {len(table.slots)} slots; at most {MAX_SLOTS}"
    seen: set[str] = set()
    for i, s in enumerate(table.slots):
        if s.index != i:
            return f"slot table: slot at position {i} has index {s.index}"
        if s.vacant and s.address:
            return f"slot {i} is vacant but has address {s.address!r}"
        if len(s.former) != len(s.former_until) or len(s.former) > FORMER_KEPT:
            return f"slot {i}: {len(s.former)} former holders with {len(s.former_until)} versions (at most {FORMER_KEPT})"
        if not s.vacant:
            if s.host_id in seen:
                return f"slot table: host {s.host_id!r} holds two slots"
            seen.add(s.host_id)
            if not s.address:
                return f"slot {i} (host {s.host_id!r}) has no address"
    return None


def next_table(table: SlotTable, members: Mapping[str, tuple[str, str]]) -> SlotTable:
    """Apply the current members (host id -> (address, domain), in the source's order) to ``table``.

    Returns ``table`` itself when nothing changes; the same version with new addresses when only those
    changed; otherwise a table one version newer.
    """
    version = table.version + 1
    slots = [_vacate_or_update(s, members, version) for s in table.slots]
    placed = {s.host_id for s in slots if not s.vacant}
    newcomers = [h for h in members if h not in placed]
    # Hosts coming back first take their own vacant slot back, then the rest fill vacancies in order.
    returning = [h for h in newcomers if any(s.vacant and s.left_at(h) >= 0 for s in slots)]
    for host_id in [*returning, *(h for h in newcomers if h not in returning)]:
        address, domain = members[host_id]
        index = _slot_for(slots, host_id)
        previous = slots[index] if index < len(slots) else Slot(index)
        slots[index : index + 1] = [replace(previous, host_id=host_id, address=address, domain=domain)]
    if tuple(slots) == table.slots:
        return table
    if [s.assignment for s in slots] == [s.assignment for s in table.slots]:
        return SlotTable(table.version, tuple(slots))  # addresses only: this store's own view
    return SlotTable(version, tuple(slots))


def _vacate_or_update(s: Slot, members: Mapping[str, tuple[str, str]], version: int) -> Slot:
    if s.vacant:
        return s
    if s.host_id not in members:
        kept = [(h, v) for h, v in zip(s.former, s.former_until, strict=True) if h != s.host_id][-(FORMER_KEPT - 1) :]
        former = (*(h for h, _ in kept), s.host_id)
        until = (*(v for _, v in kept), version)
        return Slot(s.index, "", "", s.domain, former, until)
    address, domain = members[s.host_id]
    return replace(s, address=address, domain=domain)


def _slot_for(slots: Sequence[Slot], host_id: str) -> int:
    vacant = [s for s in slots if s.vacant]
    own = max(vacant, key=lambda s: s.left_at(host_id), default=None)
    if own is not None and own.left_at(host_id) >= 0:
        return own.index
    if vacant:
        return vacant[0].index
    return len(slots)
