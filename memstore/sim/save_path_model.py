"""The save path and membership gossip at scale: messages per saved step and per gossip interval
(``memstore simulate protocol``, after the restore tables).

Plain standard-library Python, closed form, deterministic. *Model outputs*, not measurements; ``docs/simulator.md``
("Save path and gossip at scale") lists the assumptions and the measured figures they are compared with.

One job of ``N`` hosts, ``G`` ranks each, ``R`` replicas. A message is one store RPC (a request and its reply)
unless named otherwise; a collective is one all-reduce of the job's process group (``O(log W)`` hops, no store
message).

**Save, per saved step beyond --keep.** Every rank sends Allocate, Commit and WaitCommitted to its store (3 per
rank) and its store pushes the shard to ``R - 1`` group peers (each push acknowledged in its reply).

- *today* (``retention: list``): every store lists every other store to learn the newest restorable step it must
  protect: ``N - 1`` List calls sent (and served) per store, ``N (N - 1)`` in all.
- *floor* (``retention: floor``): the ranks agree on a restorable floor through their process group (one
  all-reduce per save) and piggyback it on the Commit and on the replication pushes' headers: no List call.
  Per store ``3 G + G (R - 1)`` messages, none growing with N.

**Gossip, per store and ``--discovery-interval``.** Each store asks ``k`` random members for Hello and is asked
by ``k`` on average.

- *full* (before issue 28): every answer carries the whole slot table and member list, ``O(N)`` bytes.
- *push-pull*: the ask carries the asker's table version and digest, the answer carries the table only when it is
  newer, and an asked store that is behind pulls from the asker: answers of constant size while nothing changes.

Convergence (rounds until every store holds a new table that one store learnt): the mean-field recurrence of the
uninformed fraction ``s`` (informed ``i = 1 - s``), iterated until fewer than half a store is left uninformed:
pull only ``s' = s (1 - i)^k``; push-pull ``s' = s (1 - i)^k e^{-k i}`` (an informed asker also pushes). It
grows as ``log N``: about ``log_{1+2k} N`` rounds of spreading and ``O(log log N)`` of mopping up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

#: Bytes of one slot in a Hello answer (host id, address, index, domain) plus its member-list entry; and of the rest.
SLOT_BYTES = 48
HELLO_BASE_BYTES = 120


@dataclass(frozen=True)
class SaveConfig:
    hosts: int
    ranks_per_host: int = 1
    replicas: int = 2
    fanout: int = 3  # GOSSIP_FANOUT
    interval_s: float = 2.0  # --discovery-interval

    def __post_init__(self) -> None:
        if self.hosts < 2 or self.ranks_per_host < 1 or not 1 <= self.replicas <= self.hosts or self.fanout < 1 or self.interval_s <= 0:
            raise ValueError(f"save-path model: hosts >= 2, ranks >= 1, 1 <= R <= hosts, fanout >= 1, interval > 0: {self}")


@dataclass(frozen=True)
class SaveCost:
    """One host count: the save path per saved step and gossip per interval, today's protocols and the new ones."""

    hosts: int
    list_per_store: int  # today: List calls each store sends per saved step (and serves)
    save_per_store_today: int  # store messages per store per saved step
    save_per_store_floor: int
    save_total_today: int  # per saved step, the whole cluster
    save_total_floor: int
    collectives_floor: int  # all-reduces per saved step (the floor)
    hello_per_store: float  # Hellos each store sends and answers per interval (both protocols)
    hello_bytes_per_store_full: float  # answer bytes per store per interval
    hello_bytes_per_store_push_pull: float
    rounds_pull: int  # convergence, full answers (pull only)
    rounds_push_pull: int
    converge_s_push_pull: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def gossip_rounds(hosts: int, fanout: int, push: bool = True) -> int:
    """Rounds until every one of ``hosts`` stores holds a table one of them learnt (mean-field, see the module)."""
    s = 1.0 - 1.0 / hosts
    rounds = 0
    while s * hosts >= 0.5:
        i = 1.0 - s
        s *= (1.0 - i) ** fanout * (math.exp(-fanout * i) if push else 1.0)
        rounds += 1
    return rounds


def save_cost(cfg: SaveConfig) -> SaveCost:
    n, g, r, k = cfg.hosts, cfg.ranks_per_host, cfg.replicas, cfg.fanout
    client = 3 * g  # Allocate, Commit, WaitCommitted per rank
    pushes = g * (r - 1)
    today, floor = client + pushes + (n - 1), client + pushes
    answers = 2 * k * HELLO_BASE_BYTES  # k asked, k asking on average
    push_pull = gossip_rounds(n, k, push=True)
    return SaveCost(
        hosts=n,
        list_per_store=n - 1,
        save_per_store_today=today,
        save_per_store_floor=floor,
        save_total_today=n * today,
        save_total_floor=n * floor,
        collectives_floor=1,
        hello_per_store=2.0 * k,
        hello_bytes_per_store_full=float(answers + 2 * k * SLOT_BYTES * n),
        hello_bytes_per_store_push_pull=float(answers),
        rounds_pull=gossip_rounds(n, k, push=False),
        rounds_push_pull=push_pull,
        converge_s_push_pull=push_pull * cfg.interval_s,
    )


#: (field, label, order of growth) of the save-path table, in column order.
SAVE_METRICS: tuple[tuple[str, str, str], ...] = (
    ("list_per_store", "List per store (today)", "O(N): N-1"),
    ("save_per_store_today", "msgs per store per step (today)", "O(N): 3G + G(R-1) + N-1"),
    ("save_per_store_floor", "msgs per store per step (floor)", "O(R): 3G + G(R-1)"),
    ("save_total_today", "msgs per step, all (today)", "O(N^2)"),
    ("save_total_floor", "msgs per step, all (floor)", "O(N)"),
    ("hello_per_store", "Hello per store per interval", "O(1): 2k"),
    ("hello_bytes_per_store_full", "Hello bytes/store/interval (full)", "O(N)"),
    ("hello_bytes_per_store_push_pull", "Hello bytes/store/interval (push-pull)", "O(1)"),
    ("rounds_pull", "rounds to converge (pull)", "O(log N)"),
    ("rounds_push_pull", "rounds to converge (push-pull)", "O(log N)"),
)


def save_growth(costs: Sequence[SaveCost]) -> dict[str, list[float | None]]:
    """field -> empirical exponents between consecutive host counts."""
    from itertools import pairwise

    from memstore.sim.protocol import growth_exponent

    ordered = sorted(costs, key=lambda c: c.hosts)
    return {
        name: [growth_exponent(a.hosts, float(getattr(a, name)), b.hosts, float(getattr(b, name))) for a, b in pairwise(ordered)]
        for name, _, _ in SAVE_METRICS
    }
