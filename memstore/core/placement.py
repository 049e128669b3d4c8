"""Replica placement: which hosts hold copies of which host's checkpoint shards.

Every host runs a store holding the shards of the trainer ranks running on it (the *owner* copy) plus
copies of other hosts' shards. A :class:`Placement` maps each owner to its *holders*: the owner itself
first, then ``replicas - 1`` peers. The replication factor counts the owner's own copy (GEMINI's ``m``).

Two strategies, as in GEMINI (Wang et al., SOSP'23, section 4):

* **mixed** (the default). The ordered host list is cut into disjoint groups of ``m`` consecutive hosts
  and every member of a group holds every other member's shards. A checkpoint is lost only when *all*
  ``m`` members of one group fail, and GEMINI proves that when ``m`` divides ``N`` this group placement
  maximises the probability that every shard survives ``k`` simultaneous failures: disjoint groups
  make the failure sets that lose data as few as possible (``N/m`` of the ``C(N, m)`` possible
  ``m``-sets instead of ``N`` for a ring). When ``m`` does not divide ``N`` the remaining hosts cannot
  form a whole group, so the last ``m + (N mod m)`` hosts form a small *ring* among themselves (each
  replicates to the next ``m - 1`` hosts of that tail, cyclically): every host still gets exactly ``m``
  copies and the ring is as short as possible, so it adds as few lossy failure sets as possible.
* **ring**. Host ``i`` replicates to hosts ``i+1 .. i+m-1`` (mod ``N``). Load is perfectly even and a
  single failure's recovery traffic is spread over more peers, but ``N`` windows instead of ``N/m``
  groups can be wiped out, so the recovery probability is lower.

**Erasure coding** (``ec:K+M``, :func:`erasure_placement`): each host keeps its own shards whole, on itself only
(its holders are just itself), and the ordered hosts are cut into disjoint *groups* of ``K+M`` that keep parity for
each other (``memstore.core.erasure_layout``). When ``K+M`` does not divide ``N`` the remaining hosts join the last
groups, one each from the end, so every group has at least ``K+M`` hosts (a group of ``G`` then has ``G-M`` data
columns); fewer than ``K+M`` hosts is an error naming both numbers. A group loses a step only when more than ``M`` of
its hosts fail together.

**Failure domains** (rack, zone, node pool) are optional. Hosts in one domain tend to fail together, so
when labels are given the hosts are reordered before grouping so that the holders of one owner come
from different domains wherever the domain sizes allow; :func:`domain_violations` reports the holder
sets that still share a domain. The reordering is a pure deterministic function of
``(hosts, redundancy, domains)``, so every store computes the same placement independently.

:func:`recovery_probability` computes, exactly, the probability that no owner loses all of its holders (for
erasure coding: that no group loses more than ``M`` hosts) when ``k`` hosts chosen uniformly at random fail
together. It never enumerates failure sets: the placement splits into independent components (each disjoint
group, the ring tail, or the one big ring), each component contributes a generating polynomial that counts its *surviving* failure subsets
by size (for an erasure-coded group of ``G``: ``sum_{j<=M} C(G, j) x**j``), and the answer is the ``x**k``
coefficient of their product divided by ``C(N, k)``. This stays fast for ``N = 16384`` and any ``k``.

Pure Python (the standard library and ``memstore.core``): no ``torch`` or ``grpc`` imports.
"""

from __future__ import annotations

import heapq
import itertools
import math
import types
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from memstore.core.redundancy import Redundancy
from memstore.errors import PlacementError

STRATEGIES: tuple[str, ...] = ("mixed", "ring")

#: Largest host count :func:`brute_force_recovery_probability` accepts (it enumerates ``C(N, k)`` sets).
BRUTE_FORCE_MAX_HOSTS = 20

#: Largest component of unrecognised shape (a hand-built placement) whose survivor counts are found by
#: enumerating its subsets; components built by :func:`mixed_placement` / :func:`ring_placement` are
#: always recognised as a disjoint group or a ring and never enumerated.
_ENUMERATE_MAX_COMPONENT = 16


# --------------------------------------------------------------------------------------------------
# The placement value
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Which hosts hold each owner's shards.

    ``hosts`` is the ordered host list exactly as given (not the domain-reordered one).
    ``holders_by_owner`` maps every host to its holders: the owner first, then ``replicas - 1`` distinct
    peers. ``redundancy`` is the scheme (None: ``replicas:<replicas>``); for ``ec:K+M`` ``replicas`` is 1 (every
    owner is its only holder) and ``erasure_groups`` are the disjoint groups, in host order, that keep parity for
    each other (each at least ``K+M`` hosts). Constructing a ``Placement`` directly validates it, so a placement read
    back from status or a config is checked the same way as a computed one.
    """

    strategy: str
    hosts: tuple[str, ...]
    replicas: int
    holders_by_owner: Mapping[str, tuple[str, ...]] = field(hash=False)
    redundancy: Redundancy | None = None
    erasure_groups: tuple[tuple[str, ...], ...] = ()
    # Derived: owner lists per holder, and a cache for recovery_probability's component analysis.
    _held_by: Mapping[str, tuple[str, ...]] = field(init=False, repr=False, compare=False, hash=False, default_factory=dict)
    _cache: dict[str, Any] = field(init=False, repr=False, compare=False, hash=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise PlacementError(f"unknown placement strategy {self.strategy!r}; expected one of {', '.join(STRATEGIES)}")
        hosts = _validate_hosts(self.hosts)
        replicas = _validate_replicas(self.replicas, len(hosts))
        host_set = set(hosts)
        given = dict(self.holders_by_owner)
        missing = [h for h in hosts if h not in given]
        unknown = sorted(repr(o) for o in given if o not in host_set)
        if missing or unknown:
            raise PlacementError(
                f"holders_by_owner must have exactly one entry per host; missing owners: {missing}, unknown owners: {unknown}"
            )
        normalized: dict[str, tuple[str, ...]] = {}
        held_by: dict[str, list[str]] = {h: [h] for h in hosts}
        for owner in hosts:
            holders = tuple(given[owner])
            if len(holders) != replicas or holders[0] != owner or len(set(holders)) != replicas:
                raise PlacementError(f"holders of {owner!r} must be {replicas} distinct hosts starting with the owner, got {holders!r}")
            strangers = [h for h in holders if h not in host_set]
            if strangers:
                raise PlacementError(f"holders of {owner!r} include unknown hosts {strangers!r}")
            normalized[owner] = holders
            for holder in holders[1:]:
                held_by[holder].append(owner)
        object.__setattr__(self, "hosts", hosts)
        object.__setattr__(self, "holders_by_owner", types.MappingProxyType(normalized))
        scheme = Redundancy.of_replicas(replicas) if self.redundancy is None else self.redundancy
        object.__setattr__(self, "redundancy", scheme)
        object.__setattr__(self, "erasure_groups", _validate_erasure_groups(scheme, hosts, replicas, self.erasure_groups))
        object.__setattr__(
            self,
            "_held_by",
            types.MappingProxyType({h: tuple(o) for h, o in held_by.items()}),
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # mappingproxy cannot be pickled; rebuild (and re-validate) from plain values instead.
        return (
            Placement,
            (self.strategy, self.hosts, self.replicas, dict(self.holders_by_owner), self.redundancy, self.erasure_groups),
        )

    @property
    def scheme(self) -> Redundancy:
        """The redundancy scheme (``redundancy``, never None once constructed)."""
        assert self.redundancy is not None  # set by __post_init__
        return self.redundancy

    def holders(self, owner: str) -> tuple[str, ...]:
        """The hosts holding ``owner``'s shards: ``owner`` first, ``replicas`` hosts in all."""
        try:
            return self.holders_by_owner[owner]
        except KeyError:
            raise PlacementError(f"unknown host {owner!r}; not in this placement") from None

    def peers_of(self, owner: str) -> tuple[str, ...]:
        """The hosts ``owner`` replicates its shards to (its holders minus itself)."""
        return self.holders(owner)[1:]

    def owners_held_by(self, host: str) -> tuple[str, ...]:
        """Owners whose shards ``host`` must hold: ``host`` itself first, then others in host order."""
        try:
            return self._held_by[host]
        except KeyError:
            raise PlacementError(f"unknown host {host!r}; not in this placement") from None

    def groups(self) -> tuple[tuple[str, ...], ...]:
        """The distinct holder sets (for docs and status); for erasure coding the groups (``erasure_groups``).

        For a disjoint mixed group that is the group itself; for ring placement (and the ring tail of
        mixed placement) every window of ``replicas`` consecutive hosts. Each set is reported as the
        holder tuple of the first owner (in host order) that has it.
        """
        if self.erasure_groups:
            return self.erasure_groups
        seen: set[frozenset[str]] = set()
        out: list[tuple[str, ...]] = []
        for owner in self.hosts:
            holders = self.holders_by_owner[owner]
            key = frozenset(holders)
            if key not in seen:
                seen.add(key)
                out.append(holders)
        return tuple(out)

    def group_of(self, host: str) -> tuple[str, ...]:
        """The hosts ``host`` shares its protection with: its erasure-coded group (in host order), or for replicas
        its holders (``holders(host)``, itself first)."""
        if not self.erasure_groups:
            return self.holders(host)
        found = next((g for g in self.erasure_groups if host in g), None)
        if found is None:
            raise PlacementError(f"unknown host {host!r}; not in this placement")
        return found


# --------------------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------------------


def _validate_erasure_groups(
    scheme: Redundancy, hosts: tuple[str, ...], replicas: int, groups: Sequence[Sequence[str]]
) -> tuple[tuple[str, ...], ...]:
    """``groups`` as tuples, checked against the scheme: none for replicas; for ec a partition of ``hosts`` into
    groups of at least K+M, each in host order, ordered by their first host, and ``replicas`` 1."""
    out = tuple(tuple(g) for g in groups)
    if not scheme.erasure_coded:
        if out or scheme.replicas != replicas:
            raise PlacementError(f"a {scheme} placement has replicas {scheme.replicas} and no erasure groups, got {replicas}, {out!r}")
        return out
    if replicas != 1:
        raise PlacementError(f"an {scheme} placement keeps each owner's shards on the owner only (replicas 1), got {replicas}")
    index = {h: i for i, h in enumerate(hosts)}
    listed = [h for g in out for h in g]
    if sorted(listed, key=lambda h: index.get(h, -1)) != list(hosts) or len(set(listed)) != len(listed):
        raise PlacementError(f"erasure groups must cover every host exactly once, got {out!r}")
    small = [g for g in out if len(g) < scheme.group_size]
    if small:
        raise PlacementError(f"every {scheme} group needs at least {scheme.group_size} hosts (K+M); too small: {small!r}")
    if any(list(g) != sorted(g, key=index.__getitem__) for g in out) or [index[g[0]] for g in out] != sorted(index[g[0]] for g in out):
        raise PlacementError(f"erasure groups must list their hosts in host order, groups by their first host, got {out!r}")
    return out


def _validate_hosts(hosts: Sequence[str]) -> tuple[str, ...]:
    if isinstance(hosts, (str, bytes)):
        raise PlacementError("hosts must be a sequence of host id strings, not a single string")
    out = tuple(hosts)
    if not out:
        raise PlacementError("hosts must not be empty")
    bad = [h for h in out if not isinstance(h, str) or not h.strip()]
    if bad:
        raise PlacementError(f"host ids must be non-empty strings, got {bad!r}")
    seen: set[str] = set()
    dupes: list[str] = []
    for h in out:
        if h in seen and h not in dupes:
            dupes.append(h)
        seen.add(h)
    if dupes:
        raise PlacementError(f"host ids must be unique; duplicated: {dupes!r}")
    return out


def _validate_replicas(replicas: int, n: int) -> int:
    if isinstance(replicas, bool) or not isinstance(replicas, int):
        raise PlacementError(f"replicas must be an int, got {replicas!r}")
    if not 1 <= replicas <= n:
        raise PlacementError(f"replicas (which counts the owner's own copy) must be between 1 and the number of hosts {n}, got {replicas}")
    return replicas


def _validate_domains(hosts: Sequence[str], domains: Mapping[str, str]) -> dict[str, str]:
    host_set = set(hosts)
    missing = [h for h in hosts if h not in domains]
    unknown = sorted(repr(h) for h in domains if h not in host_set)
    if missing:
        raise PlacementError(f"failure-domain labels missing for hosts {missing!r}")
    if unknown:
        raise PlacementError(f"failure-domain labels given for unknown hosts {', '.join(unknown)}")
    bad = [h for h in hosts if not isinstance(domains[h], str)]
    if bad:
        raise PlacementError(f"failure-domain labels must be strings; bad labels for hosts {bad!r}")
    return {h: domains[h] for h in hosts}


# --------------------------------------------------------------------------------------------------
# Domain-aware ordering
# --------------------------------------------------------------------------------------------------


class _DomainPicker:
    """Hands out hosts one at a time, preferring the domain with the most hosts left.

    Ties go to the smallest label and each domain's hosts come out in their original relative order,
    so the result is a deterministic function of the inputs. Taking from the largest domain first is
    what makes the groups rainbow (all-distinct) whenever that is possible: with counts ``c_d`` and
    ``g`` groups still to fill, ``max(c_d) <= g`` is kept invariant.
    """

    def __init__(self, hosts: Sequence[str], labels: Mapping[str, str]) -> None:
        self._queues: dict[str, deque[str]] = {}
        for h in hosts:
            self._queues.setdefault(labels[h], deque()).append(h)
        self._heap: list[tuple[int, str]] = [(-len(q), lab) for lab, q in self._queues.items()]
        heapq.heapify(self._heap)

    def take(self, avoid: set[str] | frozenset[str]) -> tuple[str, str]:
        """Pop a host from the largest domain not in ``avoid`` (or the largest overall if all are)."""
        skipped: list[tuple[int, str]] = []
        chosen: tuple[int, str] | None = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            if entry[1] not in avoid:
                chosen = entry
                break
            skipped.append(entry)
        if chosen is None:
            # Every remaining domain is forbidden: a violation is unavoidable here.
            chosen = skipped.pop(0)
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        neg_count, label = chosen
        host = self._queues[label].popleft()
        if neg_count + 1 < 0:
            heapq.heappush(self._heap, (neg_count + 1, label))
        return host, label


def _window_violations(order: Sequence[str], replicas: int, labels: Mapping[str, str]) -> int:
    """Cyclic windows of ``replicas`` consecutive hosts in ``order`` that repeat a domain."""
    n = len(order)
    seq = [labels[h] for h in order]
    return sum(1 for i in range(n) if len({seq[(i + j) % n] for j in range(replicas)}) < replicas)


def _striped_ring_order(hosts: Sequence[str], replicas: int, labels: Mapping[str, str]) -> list[str]:
    """Cycle order by striping: list hosts grouped by domain (largest domain first, ties by
    label, original order inside a domain), deal that list column by column into
    ``q = N // replicas`` rows and read the rows one after another.

    Every row has at least ``replicas`` hosts and a domain's consecutive hosts land in
    consecutive rows, so any two hosts of one domain end up at least ``replicas`` apart around the
    cycle whenever every domain has at most ``q`` hosts -- which is also necessary (a domain with
    ``c`` hosts spaced ``replicas`` apart needs ``c * replicas <= N``). So this order has no
    violating window whenever one exists. Equal-size domains come out round-robin (a b c a b c).
    """
    rows_n = max(1, len(hosts) // replicas)
    by_domain: dict[str, list[str]] = {}
    for h in hosts:
        by_domain.setdefault(labels[h], []).append(h)
    ranked = sorted(by_domain, key=lambda lab: (-len(by_domain[lab]), lab))
    rows: list[list[str]] = [[] for _ in range(rows_n)]
    for t, h in enumerate(h for lab in ranked for h in by_domain[lab]):
        rows[t % rows_n].append(h)
    return [h for row in rows for h in row]


def _greedy_ring_order(hosts: Sequence[str], replicas: int, labels: Mapping[str, str]) -> list[str]:
    """Cycle order built position by position from the largest remaining domain not used in the
    current window (nor, near the end, in the window wrapping round to the start)."""
    n = len(hosts)
    picker = _DomainPicker(hosts, labels)
    order: list[str] = []
    seq: list[str] = []
    for p in range(n):
        avoid = set(seq[max(0, p - replicas + 1) : p])
        # Cyclic wrap: positions 0..wrap are also within the window starting at p.
        wrap = p + replicas - 1 - n
        if wrap >= 0:
            avoid.update(seq[: wrap + 1])
        host, label = picker.take(avoid)
        order.append(host)
        seq.append(label)
    return order


def _domain_ring_order(hosts: Sequence[str], replicas: int, labels: Mapping[str, str]) -> list[str]:
    """Order ``hosts`` as a cycle in which every ``replicas`` cyclically consecutive hosts come
    from distinct domains where possible.

    Striping is violation-free whenever that is possible at all; when it is not, the greedy order
    sometimes does better, so the one with fewer violating windows wins (striping on a tie).
    """
    striped = _striped_ring_order(hosts, replicas, labels)
    worst = _window_violations(striped, replicas, labels)
    if worst == 0:
        return striped
    greedy = _greedy_ring_order(hosts, replicas, labels)
    return greedy if _window_violations(greedy, replicas, labels) < worst else striped


def _domain_blocks(hosts: Sequence[str], sizes: Sequence[int], labels: Mapping[str, str]) -> list[list[str]]:
    """Partition ``hosts`` into blocks of the given sizes, each drawing from distinct domains."""
    picker = _DomainPicker(hosts, labels)
    blocks: list[list[str]] = []
    for size in sizes:
        used: set[str] = set()
        block: list[str] = []
        for _ in range(size):
            host, label = picker.take(used)
            used.add(label)
            block.append(host)
        blocks.append(block)
    return blocks


# --------------------------------------------------------------------------------------------------
# Constructors
# --------------------------------------------------------------------------------------------------


def _ring_holders(order: Sequence[str], replicas: int) -> dict[str, tuple[str, ...]]:
    n = len(order)
    return {order[i]: tuple(order[(i + j) % n] for j in range(replicas)) for i in range(n)}


def _group_holders(group: Sequence[str]) -> dict[str, tuple[str, ...]]:
    return {o: (o, *(h for h in group if h != o)) for o in group}


def mixed_placement(hosts: Sequence[str], replicas: int, domains: Mapping[str, str] | None = None) -> Placement:
    """GEMINI's mixed placement: disjoint groups of ``replicas`` consecutive hosts, ring tail.

    With ``N = q*m + r`` hosts and ``r > 0``, the first ``(q-1)*m`` hosts form ``q-1`` disjoint groups
    and the last ``m + r`` hosts form a ring in which each replicates to the next ``m - 1`` of the tail.
    Inside a group every member holds all members' shards; holders are the owner first, then the other
    members in host-list order. When ``domains`` is given, group membership is chosen so that every
    group (and the tail) spans distinct domains where the domain sizes allow.
    """
    host_tuple = _validate_hosts(hosts)
    n = len(host_tuple)
    m = _validate_replicas(replicas, n)
    q, r = divmod(n, m)
    n_groups = q if r == 0 else q - 1
    tail_len = 0 if r == 0 else m + r
    if domains is None:
        groups = [list(host_tuple[i * m : (i + 1) * m]) for i in range(n_groups)]
        tail = list(host_tuple[n_groups * m :])
    else:
        labels = _validate_domains(host_tuple, domains)
        index = {h: i for i, h in enumerate(host_tuple)}
        # The tail needs the most distinct domains (all m + r of its hosts share a window with each
        # other), so it is filled first, from the largest domains.
        sizes = ([tail_len] if tail_len else []) + [m] * n_groups
        blocks = _domain_blocks(host_tuple, sizes, labels)
        tail_members = sorted(blocks.pop(0), key=index.__getitem__) if tail_len else []
        tail = _domain_ring_order(tail_members, m, labels) if tail_members else []
        groups = sorted(
            (sorted(b, key=index.__getitem__) for b in blocks),
            key=lambda b: index[b[0]],
        )
    holders: dict[str, tuple[str, ...]] = {}
    for group in groups:
        holders.update(_group_holders(group))
    if tail:
        holders.update(_ring_holders(tail, m))
    return Placement("mixed", host_tuple, m, {h: holders[h] for h in host_tuple})


def ring_placement(hosts: Sequence[str], replicas: int, domains: Mapping[str, str] | None = None) -> Placement:
    """Ring placement: host ``i`` is held by hosts ``i, i+1, ..., i+m-1`` (indices mod ``N``).

    With ``domains`` the ring order is rearranged so that every window of ``replicas`` consecutive
    hosts spans distinct domains where possible.
    """
    host_tuple = _validate_hosts(hosts)
    m = _validate_replicas(replicas, len(host_tuple))
    if domains is None:
        order: Sequence[str] = host_tuple
    else:
        order = _domain_ring_order(host_tuple, m, _validate_domains(host_tuple, domains))
    holders = _ring_holders(order, m)
    return Placement("ring", host_tuple, m, {h: holders[h] for h in host_tuple})


def erasure_group_sizes(n: int, group_size: int) -> list[int]:
    """Sizes of the disjoint groups ``n`` hosts form for groups of ``group_size`` (K+M), in host order.

    ``q = n // group_size`` groups; the ``n mod group_size`` hosts left over join the last groups one each from the
    end (round after round if there are more of them than groups), so every group has at least ``group_size`` hosts
    and no two differ by more than one. ``n < group_size`` raises ``PlacementError`` naming both numbers.
    """
    if n < group_size:
        raise PlacementError(f"erasure coding with groups of {group_size} hosts (K+M) needs at least {group_size} hosts, got {n}")
    q, r = divmod(n, group_size)
    extra, more = divmod(r, q)
    return [group_size + extra + (1 if i >= q - more else 0) for i in range(q)]


def erasure_placement(hosts: Sequence[str], redundancy: Redundancy, domains: Mapping[str, str] | None = None) -> Placement:
    """``ec:K+M``: every owner its own only holder, the hosts cut into disjoint groups (:func:`erasure_group_sizes`).

    Without ``domains`` a group is consecutive hosts; with them, groups are drawn from distinct domains where the
    domain sizes allow, as :func:`mixed_placement` draws its groups (the largest groups first: they need the most
    distinct domains).
    """
    if not isinstance(redundancy, Redundancy) or not redundancy.erasure_coded:
        raise PlacementError(f"erasure_placement needs an ec:K+M redundancy, got {redundancy}")
    host_tuple = _validate_hosts(hosts)
    sizes = erasure_group_sizes(len(host_tuple), redundancy.group_size)
    if domains is None:
        starts = list(itertools.accumulate(sizes, initial=0))
        groups = [list(host_tuple[a:b]) for a, b in itertools.pairwise(starts)]
    else:
        labels = _validate_domains(host_tuple, domains)
        index = {h: i for i, h in enumerate(host_tuple)}
        blocks = _domain_blocks(host_tuple, sorted(sizes, reverse=True), labels)
        groups = sorted((sorted(b, key=index.__getitem__) for b in blocks), key=lambda b: index[b[0]])
    holders = {h: (h,) for h in host_tuple}
    return Placement("mixed", host_tuple, 1, holders, redundancy, tuple(tuple(g) for g in groups))


def make_placement(
    strategy: str,
    hosts: Sequence[str],
    replicas: int | Redundancy,
    domains: Mapping[str, str] | None = None,
) -> Placement:
    """Build a placement by strategy name (``"mixed"`` or ``"ring"``) for ``replicas`` R (an int, or
    ``replicas:R``) or ``ec:K+M`` (:func:`erasure_placement`: disjoint groups; the ring strategy does not apply)."""
    if isinstance(replicas, Redundancy):
        if replicas.erasure_coded:
            if strategy != "mixed":
                raise PlacementError(f"placement {strategy!r} does not apply to {replicas}: erasure coding places disjoint groups (mixed)")
            return erasure_placement(hosts, replicas, domains)
        replicas = replicas.replicas
    if strategy == "mixed":
        return mixed_placement(hosts, replicas, domains)
    if strategy == "ring":
        return ring_placement(hosts, replicas, domains)
    raise PlacementError(f"unknown placement strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")


def domain_violations(placement: Placement, domains: Mapping[str, str]) -> int:
    """How many distinct holder sets (:meth:`Placement.groups`; for erasure coding, groups) contain two hosts of one domain.

    0 means every owner's copies sit in distinct failure domains. A positive count is unavoidable
    when the domains are too few or too unbalanced (e.g. every host in one rack).
    """
    labels = _validate_domains(placement.hosts, domains)
    return sum(1 for g in placement.groups() if len({labels[h] for h in g}) < len(g))


# --------------------------------------------------------------------------------------------------
# Recovery probability
# --------------------------------------------------------------------------------------------------


def _check_k(placement: Placement, k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k (number of failed hosts) must be an int, got {k!r}")
    n = len(placement.hosts)
    if k < 0:
        raise ValueError(f"k (number of failed hosts) must be >= 0, got {k}")
    if k > n:
        raise ValueError(f"k={k} failed hosts is more than the {n} hosts in the placement")
    return k


def _power_truncated(p: Sequence[int], exponent: int, degree: int) -> list[int]:
    """Coefficients 0..degree of ``p(x) ** exponent`` (requires ``p[0] == 1``).

    J.C.P. Miller's recurrence, from ``p * F' == exponent * p' * F`` with ``F = p ** exponent``:
    ``c_j = (1/j) * sum_{a>=1} p_a * (a*(exponent+1) - j) * c_{j-a}``, exact in integers. That is
    ``O(degree * deg p)`` big-integer operations, cheaper than exponentiation by squaring.
    """
    assert p and p[0] == 1
    top = min(degree, exponent * (len(p) - 1))
    c = [1] + [0] * top
    for j in range(1, top + 1):
        acc = 0
        for a in range(1, min(j, len(p) - 1) + 1):
            if p[a]:
                acc += p[a] * (a * (exponent + 1) - j) * c[j - a]
        c[j] = acc // j
    return c


def _ring_survivors(length: int, window: int, j: int) -> int:
    """Number of ``j``-subsets of a cycle of ``length`` hosts containing no ``window`` cyclically
    consecutive hosts (the failure sets a ring component survives).

    With ``z = length - j >= 1`` surviving hosts the failed ones fall into ``z`` cyclic gaps of at most
    ``window - 1`` each. Counting (gap sequence, rotation) pairs gives ``length * A / z`` where ``A`` is
    the number of ``z``-tuples in ``[0, window-1]`` summing to ``j``, by inclusion-exclusion
    ``A = sum_i (-1)^i C(z, i) C(j - i*window + z - 1, z - 1)``. Successive terms differ by a small
    rational factor, so each is derived from the previous one instead of calling ``math.comb``.
    """
    if j < 0 or j >= length:
        return 0  # all hosts failed (window <= length): some window is entirely down
    z = length - j
    term = math.comb(length - 1, z - 1)  # i = 0: C(j + z - 1, z - 1)
    total = 0
    i = 0
    while True:
        total += -term if i % 2 else term
        if (i + 1) * window > j or term == 0:
            break
        a = length - 1 - i * window  # current top of C(a, z - 1)
        num = z - i
        den = i + 1
        for u in range(window):
            num *= j - i * window - u
            den *= a - u
        term = term * num // den
        i += 1
    result, rem = divmod(length * total, z)
    assert rem == 0
    return result


def _component_polynomial_by_enumeration(members: Sequence[str], holder_sets: Sequence[frozenset[str]], degree: int) -> list[int]:
    index = {h: i for i, h in enumerate(members)}
    masks = sorted({sum(1 << index[h] for h in s) for s in holder_sets})
    counts = [0] * (len(members) + 1)
    for subset in range(1 << len(members)):
        if not any(subset & mask == mask for mask in masks):
            counts[subset.bit_count()] += 1
    return counts[: degree + 1]


def _multiply_truncated(a: Sequence[int], b: Sequence[int], degree: int) -> list[int]:
    top = min(degree, len(a) - 1 + len(b) - 1)
    out = [0] * (top + 1)
    for i, ai in enumerate(a[: top + 1]):
        if ai:
            for j, bj in enumerate(b[: top + 1 - i]):
                out[i + j] += ai * bj
    return out


def _structure(
    placement: Placement,
) -> tuple[int, list[int], list[tuple[list[str], list[frozenset[str]]]]]:
    """Split the placement into independent components (hosts linked by shared holder sets).

    Returns ``(number of disjoint groups, ring lengths, other components)``. A component is a disjoint
    group when all its owners have the same holder set (the whole component); a ring when following
    ``holders[1]`` walks one cycle through it and every holder tuple is a window of that cycle. The
    result is cached on the placement (it is immutable).
    """
    cached = placement._cache.get("structure")
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    parent = {h: h for h in placement.hosts}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for owner, holders in placement.holders_by_owner.items():
        root = find(owner)
        for h in holders[1:]:
            other = find(h)
            if other != root:
                parent[other] = root
    components: dict[str, list[str]] = {}
    for h in placement.hosts:
        components.setdefault(find(h), []).append(h)

    m = placement.replicas
    n_groups = 0
    rings: list[int] = []
    others: list[tuple[list[str], list[frozenset[str]]]] = []
    for members in components.values():
        sets = [frozenset(placement.holders_by_owner[o]) for o in members]
        if all(s == sets[0] for s in sets) and len(sets[0]) == len(members):
            n_groups += 1
        elif m >= 2 and _is_ring(placement, members):
            rings.append(len(members))
        else:
            others.append((members, sets))
    result = (n_groups, sorted(rings), others)
    placement._cache["structure"] = result
    return result


def _is_ring(placement: Placement, members: Sequence[str]) -> bool:
    hb = placement.holders_by_owner
    succ = {o: hb[o][1] for o in members}
    start = members[0]
    node, steps = start, 0
    while True:
        node = succ[node]
        steps += 1
        if node == start or steps > len(members):
            break
    if node != start or steps != len(members):
        return False
    for o in members:
        cur = o
        for h in hb[o][1:]:
            cur = succ[cur]
            if h != cur:
                return False
    return True


def recovery_probability_exact(placement: Placement, k: int) -> Fraction:
    """Exact probability that every owner keeps at least one live holder when ``k`` hosts, chosen
    uniformly at random among the ``N``, fail at the same time.

    A failure set loses data iff it contains all holders of some owner. Components that share no
    holders fail independently, so the number of surviving ``k``-sets is the ``x**k`` coefficient of
    the product of per-component polynomials ``sum_j s_j x**j`` (``s_j`` = surviving ``j``-subsets):
    ``(1+x)**m - x**m`` for a disjoint group of ``m`` (raised to the number of groups in one go),
    :func:`_ring_survivors` for a ring. No failure set is ever enumerated, so ``N = 16384`` is fast.
    """
    k = _check_k(placement, k)
    n = len(placement.hosts)
    if k == 0:
        return Fraction(1)
    if placement.erasure_groups:
        return Fraction(_erasure_survivors(placement, k), math.comb(n, k))
    m = placement.replicas
    n_groups, rings, others = _structure(placement)
    group_poly = [math.comb(m, j) for j in range(m)]  # (1+x)^m - x^m
    acc = _power_truncated(group_poly, n_groups, k)
    for members, sets in others:
        if len(members) > _ENUMERATE_MAX_COMPONENT:
            raise PlacementError(
                f"cannot compute recovery probability: a component of {len(members)} hosts is neither a disjoint group nor a ring"
            )
        acc = _multiply_truncated(acc, _component_polynomial_by_enumeration(members, sets, k), k)
    for length in rings[:-1]:
        ring_poly = [_ring_survivors(length, m, j) for j in range(min(k, length - 1) + 1)]
        acc = _multiply_truncated(acc, ring_poly, k)
    if rings:
        # Only the x^k coefficient is needed: pair the last (largest) ring's s_t with acc[k - t].
        length = rings[-1]
        lo = max(0, k - (len(acc) - 1))
        survivors = sum(_ring_survivors(length, m, t) * acc[k - t] for t in range(lo, min(k, length - 1) + 1))
    else:
        survivors = acc[k] if k < len(acc) else 0
    return Fraction(survivors, math.comb(n, k))


def _erasure_survivors(placement: Placement, k: int) -> int:
    """The ``k``-sets of failed hosts no erasure-coded group survives more than M of: the ``x**k`` coefficient of the
    product over groups of ``sum_{j<=M} C(G, j) x**j`` (groups of one size raised to their count in one go)."""
    m = placement.scheme.m
    acc = [1]
    for size, count in sorted(Counter(len(g) for g in placement.erasure_groups).items()):
        group_poly = [math.comb(size, j) for j in range(min(m, size) + 1)]
        acc = _multiply_truncated(acc, _power_truncated(group_poly, count, k), k)
    return acc[k] if k < len(acc) else 0


def recovery_probability(placement: Placement, k: int) -> float:
    """:func:`recovery_probability_exact` as a float (computed exactly, rounded once).

    ``k == 0`` gives 1.0, ``k == N`` gives 0.0; ``k < 0`` or ``k > N`` raise ``ValueError``.
    """
    return float(recovery_probability_exact(placement, k))


def brute_force_recovery_probability(placement: Placement, k: int) -> Fraction:
    """Reference implementation by enumerating every ``k``-subset of hosts (tests only, ``N <= 20``)."""
    k = _check_k(placement, k)
    n = len(placement.hosts)
    if n > BRUTE_FORCE_MAX_HOSTS:
        raise ValueError(f"brute force enumerates C(N, k) sets; N={n} > {BRUTE_FORCE_MAX_HOSTS}")
    index = {h: i for i, h in enumerate(placement.hosts)}
    masks = {sum(1 << index[h] for h in hs) for hs in placement.holders_by_owner.values()}
    group_masks = [sum(1 << index[h] for h in g) for g in placement.erasure_groups]
    tolerated = placement.scheme.m
    survived = 0
    total = 0
    for failed in itertools.combinations(range(n), k):
        down = sum(1 << i for i in failed)
        total += 1
        if group_masks:
            survived += all((down & g).bit_count() <= tolerated for g in group_masks)
        elif not any(down & mask == mask for mask in masks):
            survived += 1
    return Fraction(survived, total)


def gemini_mixed_closed_form(n: int, m: int, k: int) -> float:
    """GEMINI's closed form for mixed placement: ``1 - (n/m) * C(n-m, k-m) / C(n, k)``.

    Domain: ``1 <= m <= n``, ``m`` divides ``n`` (pure disjoint groups, no ring tail) and
    ``0 <= k < 2m`` with ``k <= n``. It is exact there because fewer than ``2m`` failures can wipe out at
    most one group, and there are ``n/m`` groups each wiped out by ``C(n-m, k-m)`` failure sets; for
    ``k < m`` no group can be wiped out and the value is 1.0. For ``k >= 2m`` two groups can fail at
    once and the formula double-subtracts, so it raises ``ValueError`` there (use
    :func:`recovery_probability`, which is exact for every ``k``).
    """
    if m < 1 or n < m:
        raise ValueError(f"need 1 <= m <= n, got n={n}, m={m}")
    if n % m:
        raise ValueError(f"closed form needs m | n (no ring tail), got n={n}, m={m}")
    if not 0 <= k <= n or k >= 2 * m:
        raise ValueError(f"closed form is exact only for 0 <= k < 2m and k <= n, got k={k}, m={m}")
    if k < m:
        return 1.0
    return float(1 - Fraction(n // m * math.comb(n - m, k - m), math.comb(n, k)))
