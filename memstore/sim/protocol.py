"""The restore protocol at scale: message counts and restart timeline of one job's restart (``memstore simulate protocol``).

Plain standard-library Python, closed form, deterministic: the same :class:`ProtocolConfig` gives the same numbers.
These are *model outputs*, not measurements; ``docs/simulator.md`` ("Restore protocol at scale") lists the assumptions.

One job of ``N`` hosts with ``G`` ranks each (``W = N * G`` ranks), ``R`` replicas (mixed placement: disjoint
groups of ``R`` hosts), ``K`` versions kept per host. Every rank restarts at once after ``F`` hosts were replaced
(empty RAM, same slot).

**legacy** (``latest_step()`` / ``load()`` without a process group): every rank asks its local store
(1 RPC), which lists every other store (``N - 1`` ListShards through its peer pool of ``P`` threads, shared by the
``G`` ranks' calls) and then the durable tier (1 listing, paginated). ``load()`` asks the same question again, then
Fetch + Open. Per restart: ``2 W N`` RPCs; each store serves ``2 (W - G)`` ListShards; ``2 W`` durable listings
(``W`` when a store's listing cache, ``durable_cache_s``, is still fresh for the second round).

**group** (``latest_step(group=pg)`` / ``load(group=pg)``): every rank asks its local store about its own rank;
the store lists only its ``R - 1`` group peers; rank 0's store alone lists the durable tier. Three collectives
(candidate count, candidate bytes, element-wise MIN over the candidates) agree on the answer; ``load`` reuses it.
Per restart: ``W R`` RPCs, ``G (R - 1)`` ListShards served per store, 1 durable listing, 3 collectives. When the
newest step any rank saw is not complete in that view (a save that did not finish on every rank, ranks that moved
hosts), rank 0 asks the legacy cluster-wide question once (``1 + (N - 1)`` RPCs) and shares the answer the way it
shared the candidates (2 more collectives: its length, then its bytes, as ``trainer_client.agreement`` does):
:func:`group` with ``fallback=True``. ``load(step, group=pg)`` with the step ``latest_step(group=pg)`` returned
reuses the agreed answer.

Timing: a store serves ListShards one request at a time (one Python process), so ``n`` requests arriving together
finish ``n * service`` later; a store's fan-out is also bounded by its pool (``ceil(requests / P)`` round trips).
Durable LIST requests of one prefix are throttled to ``durable_list_rate`` per second (S3 documents 3,500
PUT/COPY/POST/DELETE and 5,500 GET/HEAD per second per prefix). Collectives cost ``collective_hop_s * 2 *
ceil(log2 W)`` (latency term of a tree / ring all-reduce; payloads are under 1 KiB). Restore: a surviving rank reads
its shard from local RAM; a replaced host's ranks pull their shards from a group peer: legacy one stream, one shard
after another; group ``G`` streams at once, capped by the replacement's NIC.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

#: Protocols in the order the tables list them.
PROTOCOLS = ("legacy", "group", "group_fallback")
PROTOCOL_LABELS = {
    "legacy": "legacy (no process group)",
    "group": "group",
    "group_fallback": "group + fallback",
    "group_expected": "group, expected",
}
#: Collectives of the agreement (candidate count, candidate bytes, MIN over the candidates), and the fallback's
#: (the cluster-wide answer's length, then its bytes): ``trainer_client.agreement.agree``.
AGREEMENT_COLLECTIVES = 3
FALLBACK_COLLECTIVES = 2
#: Metrics whose growth with N is reported, with how each protocol's grows (from the formulas).
COMPLEXITY: dict[str, tuple[str, str, str]] = {
    # metric: (label, legacy, group)
    "rpcs_per_rank": ("RPCs per rank", "O(N): 2N", "O(R): R (rank 0: +N on fallback)"),
    "rpcs_total": ("RPCs per restart", "O(N^2): 2GN^2", "O(N): RW (+N on fallback)"),
    "list_shards_served_per_store": ("ListShards served per store", "O(N): 2G(N-1)", "O(1): G(R-1) (+1 on fallback)"),
    "durable_listings": ("durable listings", "O(N): 2W (W when cached)", "O(1): 1"),
    "durable_list_requests": ("durable LIST requests", "O(N^2): listings x pages", "O(N): the pages of one listing"),
    "collectives": ("collectives", "none", "O(1): 3 (+2 on fallback), each O(log W) hops"),
    "latest_step_s": ("latest_step s", "O(N): store queue; O(N^2): LIST throttle", "O(log N) collectives + one listing of O(N) objects"),
    "load_s": ("load s", "as latest_step (asks again)", "O(1): reuses the answer"),
    "restart_s": ("restart s", "O(N) .. O(N^2)", "~O(1)"),
}


def transfer_seconds(gigabytes: float, gbps: float) -> float:
    """Seconds to move ``gigabytes`` (10**9 bytes) at ``gbps`` (10**9 bits/s)."""
    return gigabytes * 8.0 / gbps


@dataclass(frozen=True)
class ProtocolConfig:
    """One job's restart. Times in seconds (``_s``), bandwidths in 10**9 bits/s (``_gbps``), sizes as named.

    The defaults are assumptions, not measurements: ``fanout_threads`` is the store's peer-listing pool
    (``memstore.server.peers``: 32 workers), ``durable_cache_s`` the spiller's listing cache (1 s),
    ``stream_gbps`` about what ``memstore bench`` measured for one replication stream on loopback (~2.6 GiB/s).
    """

    hosts: int  #: N: hosts (one store each)
    ranks_per_host: int = 8  #: G: trainer ranks per host
    replicas: int = 2  #: R: copies of each shard, the owner's included
    keep: int = 2  #: K: versions each store keeps per job
    fanout_threads: int = 32  #: P: a store's pool for listing its peers, shared by all its concurrent calls
    failed_hosts: int = 1  #: F: replaced hosts (empty RAM) at this restart; at most R-1 per group
    durable: bool = True  #: a durable tier is configured (and listed)
    durable_steps: int = 2  #: spilled steps kept on the durable tier (W shard + W manifest objects + 1 each)
    start_s: float = 2.0  #: process start + connect to the local store
    rpc_s: float = 1e-3  #: round trip of one control RPC (local or to a peer), without the service time
    list_service_s: float = 2e-4  #: a store's fixed CPU time to serve one ListShards
    list_entry_s: float = 2e-6  #: its added CPU time per shard entry in the response
    entry_bytes: int = 100  #: bytes per shard entry in a ListShards response
    collective_hop_s: float = 20e-6  #: latency of one hop of a collective
    durable_list_s: float = 0.2  #: fixed time of one durable listing
    durable_list_per_1000_s: float = 1e-3  #: its added time per 1,000 objects listed
    durable_page_objects: int = 1000  #: objects per LIST request (S3 ListObjectsV2 returns at most 1,000)
    durable_list_rate: float = 3500.0  #: LIST requests per second the job's prefix sustains
    durable_cache_s: float = 1.0  #: a store reuses its durable listing for this long
    shard_gb: float = 1.0  #: S: one rank's shard, 10**9 bytes
    local_gbps: float = 100.0  #: reading a shard from local RAM
    stream_gbps: float = 20.0  #: one peer-to-peer pull stream
    link_gbps: float = 400.0  #: a host's NIC
    fallback_probability: float = 0.0  #: chance that a restart needs the group protocol's fallback (for the expected row)

    def __post_init__(self) -> None:
        problems = validate_protocol(self)
        if problems:
            raise ValueError("; ".join(problems))

    # --- derived ------------------------------------------------------------------------------------

    @property
    def world(self) -> int:
        """W: ranks of the job."""
        return self.hosts * self.ranks_per_host

    @property
    def list_entries(self) -> int:
        """Shard entries of the job in one ListShards response: the store's own G ranks and its peers', K versions each."""
        return self.ranks_per_host * self.replicas * self.keep

    @property
    def list_service_total_s(self) -> float:
        """CPU time a store spends serving one ListShards of this job."""
        return self.list_service_s + self.list_entries * self.list_entry_s

    @property
    def list_transfer_s(self) -> float:
        """Time the response of one ListShards takes on the wire."""
        return self.list_entries * self.entry_bytes * 8.0 / (min(self.stream_gbps, self.link_gbps) * 1e9)

    @property
    def list_round_trip_s(self) -> float:
        """One ListShards to an idle store."""
        return self.rpc_s + self.list_service_total_s + self.list_transfer_s

    @property
    def durable_objects(self) -> int:
        return self.durable_steps * (2 * self.world + 1) if self.durable else 0

    @property
    def durable_pages(self) -> int:
        """LIST requests of one durable listing."""
        return max(1, math.ceil(self.durable_objects / self.durable_page_objects)) if self.durable else 0

    @property
    def durable_listing_s(self) -> float:
        """One durable listing with the prefix otherwise idle."""
        return self.durable_list_s + self.durable_list_per_1000_s * self.durable_objects / 1000.0 if self.durable else 0.0

    @property
    def collective_s(self) -> float:
        """One small collective over the job's W ranks: 2 * ceil(log2 W) hops."""
        return self.collective_hop_s * 2 * math.ceil(math.log2(self.world)) if self.world > 1 else 0.0


def validate_protocol(cfg: ProtocolConfig) -> list[str]:
    """Human-readable problems with ``cfg`` (empty when valid), each naming the ``memstore simulate protocol`` flag."""
    out: list[str] = []

    def check(ok: bool, msg: str) -> None:
        if not ok:
            out.append(msg)

    check(cfg.hosts >= 1, f"--hosts must be >= 1, got {cfg.hosts}")
    for name in ("ranks_per_host", "replicas", "keep", "fanout_threads", "durable_steps", "entry_bytes", "durable_page_objects"):
        value = getattr(cfg, name)
        check(value >= 1, f"--{name.replace('_', '-')} must be >= 1, got {value}")
    check(cfg.replicas <= cfg.hosts, f"--replicas {cfg.replicas} is more than --hosts {cfg.hosts} (replicas counts the owner's copy)")
    check(0 <= cfg.failed_hosts < cfg.hosts, f"--failed-hosts must be between 0 and --hosts - 1 ({cfg.hosts - 1}), got {cfg.failed_hosts}")
    check(
        cfg.failed_hosts == 0 or cfg.replicas >= 2,
        f"--failed-hosts {cfg.failed_hosts} needs --replicas >= 2 (a replaced host restores from a group peer)",
    )
    for name in ("start_s", "rpc_s", "list_service_s", "list_entry_s", "collective_hop_s", "durable_list_s", "durable_cache_s"):
        value = getattr(cfg, name)
        check(math.isfinite(value) and value >= 0, f"{name} must be finite and >= 0, got {value}")
    per_1000 = cfg.durable_list_per_1000_s
    check(math.isfinite(per_1000) and per_1000 >= 0, f"durable_list_per_1000_s must be finite and >= 0, got {per_1000}")
    for name in ("durable_list_rate", "shard_gb", "local_gbps", "stream_gbps", "link_gbps"):
        value = getattr(cfg, name)
        check(math.isfinite(value) and value > 0, f"--{name.replace('_', '-')} must be > 0, got {value}")
    check(0.0 <= cfg.fallback_probability <= 1.0, f"--fallback-probability must be in [0, 1], got {cfg.fallback_probability}")
    return out


# --------------------------------------------------------------------------------------------------
# Building blocks of the timeline
# --------------------------------------------------------------------------------------------------


def fanout_seconds(cfg: ProtocolConfig, requests_out: int, served: int) -> float:
    """Until a store has the answers of ``requests_out`` ListShards it sent while every store serves ``served``.

    The larger of two bounds: the store's pool (``ceil(requests_out / P)`` round trips one after another) and the
    serving store's queue (``served`` requests arriving together, served one at a time; the last waits for all).
    """
    if requests_out <= 0:
        return 0.0
    pool = math.ceil(requests_out / cfg.fanout_threads) * cfg.list_round_trip_s
    queue = served * cfg.list_service_total_s + cfg.rpc_s + cfg.list_transfer_s
    return max(pool, queue)


def durable_phase_seconds(cfg: ProtocolConfig, listings: int) -> float:
    """Until ``listings`` durable listings started together are done: one listing's time, or the prefix's rate limit."""
    if listings <= 0 or not cfg.durable:
        return 0.0
    return max(cfg.durable_listing_s, listings * cfg.durable_pages / cfg.durable_list_rate)


def local_read_seconds(cfg: ProtocolConfig) -> float:
    return transfer_seconds(cfg.shard_gb, cfg.local_gbps)


def legacy_pull_seconds(cfg: ProtocolConfig) -> float:
    """A replaced host's G shards through one stream from one peer, one shard after another."""
    if cfg.failed_hosts == 0:
        return 0.0
    one = cfg.rpc_s + transfer_seconds(cfg.shard_gb, min(cfg.stream_gbps, cfg.link_gbps))
    return cfg.ranks_per_host * one


def group_pull_seconds(cfg: ProtocolConfig) -> float:
    """A replaced host's G shards as G streams at once from its R-1 group peers, capped by the NICs."""
    if cfg.failed_hosts == 0:
        return 0.0
    g = cfg.ranks_per_host
    rate = min(g * cfg.stream_gbps, cfg.link_gbps, (cfg.replicas - 1) * cfg.link_gbps)
    return cfg.rpc_s + transfer_seconds(g * cfg.shard_gb, rate)


# --------------------------------------------------------------------------------------------------
# The two protocols
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProtocolCost:
    """Messages and timeline of one restart under one protocol (counts are floats only in the expected mix).

    ``phases`` is the slowest rank's timeline, in order; ``latest_step_s`` / ``load_s`` / ``restart_s`` sum it.
    """

    protocol: str
    rpcs_per_rank: float  #: query RPCs (LatestStep + ListShards) per rank, mean over ranks
    rpcs_max_per_rank: float  #: the busiest rank's (rank 0 on a fallback)
    rpcs_total: float  #: query RPCs of the restart: LatestStep to local stores + ListShards to peers
    list_shards_total: float  #: of those, ListShards between stores
    list_shards_served_per_store: float  #: the busiest store's
    durable_listings: float
    durable_list_requests: float  #: LIST requests (pages) of those listings
    collectives: float
    restore_rpcs: float  #: Fetch + Open per rank, plus one peer pull per shard of a replaced host (both protocols)
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def latest_step_s(self) -> float:
        """From the processes' start to ``latest_step()`` answered on every rank (start not included)."""
        return sum(v for k, v in self.phases.items() if k.startswith("latest_step."))

    @property
    def load_s(self) -> float:
        """``load()`` on the slowest rank: its own query (legacy), Fetch + Open, the bytes."""
        return sum(v for k, v in self.phases.items() if k.startswith("load."))

    @property
    def restart_s(self) -> float:
        return sum(self.phases.values())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(latest_step_s=self.latest_step_s, load_s=self.load_s, restart_s=self.restart_s)
        return d


def _restore_rpcs(cfg: ProtocolConfig) -> int:
    return 2 * cfg.world + cfg.failed_hosts * cfg.ranks_per_host


def legacy(cfg: ProtocolConfig) -> ProtocolCost:
    """Every rank: LatestStep -> its store lists all N-1 others and the durable tier; ``load()`` asks again."""
    n, g, w = cfg.hosts, cfg.ranks_per_host, cfg.world
    per_round_out = g * (n - 1)  # ListShards one store sends per round: its G ranks' calls, N-1 peers each
    per_round_served = w - g  # ... and serves: every rank not on it
    fan = fanout_seconds(cfg, per_round_out, per_round_served)
    first_listings = w if cfg.durable else 0
    # A store's second listing reuses the first while its cache is fresh: from the first listing's end, the answer
    # travels back and the second question spends its fan-out before it reaches the durable tier.
    cached = cfg.durable_cache_s > cfg.rpc_s + fan
    second_listings = 0 if cached else first_listings
    listings = first_listings + second_listings
    data = max(local_read_seconds(cfg), legacy_pull_seconds(cfg))
    phases = {
        "start": cfg.start_s,
        "latest_step.local_rpc": cfg.rpc_s,
        "latest_step.peer_listing": fan,
        "latest_step.durable_listing": durable_phase_seconds(cfg, first_listings),
        "load.query": cfg.rpc_s + fan + durable_phase_seconds(cfg, second_listings),
        "load.fetch_open": 2 * cfg.rpc_s,
        "load.data": data,
    }
    return ProtocolCost(
        protocol="legacy",
        rpcs_per_rank=2 * n,
        rpcs_max_per_rank=2 * n,
        rpcs_total=2 * w * n,
        list_shards_total=2 * w * (n - 1),
        list_shards_served_per_store=2 * per_round_served,
        durable_listings=listings,
        durable_list_requests=listings * cfg.durable_pages,
        collectives=0,
        restore_rpcs=_restore_rpcs(cfg),
        phases=phases,
    )


def group(cfg: ProtocolConfig, *, fallback: bool = False) -> ProtocolCost:
    """Every rank asks its store about its own rank (R-1 peer listings); rank 0 also lists the durable tier; 3 collectives.

    With ``fallback``: rank 0 then asks the cluster-wide question once (1 + (N-1) RPCs, the durable listing again
    unless its store's cache is still fresh) and shares the answer (2 collectives).
    """
    n, g, w, r = cfg.hosts, cfg.ranks_per_host, cfg.world, cfg.replicas
    group_out = g * (r - 1)  # each store: its G ranks' questions, R-1 peers each; by symmetry it serves as many
    fan = fanout_seconds(cfg, group_out, group_out)
    durable = 1 if cfg.durable else 0
    phases = {
        "start": cfg.start_s,
        "latest_step.local_rpc": cfg.rpc_s,
        "latest_step.peer_listing": fan,
        "latest_step.durable_listing": durable_phase_seconds(cfg, durable),  # rank 0's store; the others wait for it
        "latest_step.collectives": AGREEMENT_COLLECTIVES * cfg.collective_s,
    }
    rpcs, list_shards, served, listings, collectives = w * r, w * (r - 1), group_out, durable, AGREEMENT_COLLECTIVES
    if fallback:
        fb_fan = fanout_seconds(cfg, n - 1, 1)
        refresh = cfg.durable and cfg.durable_cache_s <= AGREEMENT_COLLECTIVES * cfg.collective_s + cfg.rpc_s + fb_fan
        shared = FALLBACK_COLLECTIVES * cfg.collective_s
        phases["latest_step.fallback"] = cfg.rpc_s + fb_fan + durable_phase_seconds(cfg, int(refresh)) + shared
        rpcs, list_shards, served = rpcs + n, list_shards + n - 1, served + (1 if n > 1 else 0)
        listings, collectives = listings + int(refresh), collectives + FALLBACK_COLLECTIVES
    phases["load.query"] = 0.0  # load(group=pg) reuses the agreed answer
    phases["load.fetch_open"] = 2 * cfg.rpc_s
    phases["load.data"] = max(local_read_seconds(cfg), group_pull_seconds(cfg))
    return ProtocolCost(
        protocol="group_fallback" if fallback else "group",
        rpcs_per_rank=rpcs / w,
        rpcs_max_per_rank=r + (n if fallback else 0),
        rpcs_total=rpcs,
        list_shards_total=list_shards,
        list_shards_served_per_store=served,
        durable_listings=listings,
        durable_list_requests=listings * cfg.durable_pages,
        collectives=collectives,
        restore_rpcs=_restore_rpcs(cfg),
        phases=phases,
    )


def expected(plain: ProtocolCost, fallback: ProtocolCost, p: float) -> ProtocolCost:
    """The mix of ``plain`` and ``fallback`` with probability ``p`` of the fallback: every count and phase p-weighted."""
    counts = {
        f.name: (1 - p) * getattr(plain, f.name) + p * getattr(fallback, f.name)
        for f in fields(ProtocolCost)
        if f.name not in ("protocol", "phases")
    }
    names = list(dict.fromkeys([*plain.phases, *fallback.phases]))
    phases = {k: (1 - p) * plain.phases.get(k, 0.0) + p * fallback.phases.get(k, 0.0) for k in names}
    return ProtocolCost(protocol="group_expected", phases=phases, **counts)


@dataclass(frozen=True)
class ProtocolPoint:
    """Both protocols at one host count."""

    config: ProtocolConfig
    costs: dict[str, ProtocolCost]  #: PROTOCOLS, plus "group_expected" when the fallback probability is > 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "hosts": self.config.hosts,
            "ranks": self.config.world,
            "derived": {
                "list_entries": self.config.list_entries,
                "list_response_bytes": self.config.list_entries * self.config.entry_bytes,
                "list_service_s": self.config.list_service_total_s,
                "durable_objects": self.config.durable_objects,
                "durable_pages_per_listing": self.config.durable_pages,
                "durable_listing_s": self.config.durable_listing_s,
                "collective_s": self.config.collective_s,
            },
            "protocols": {k: c.to_dict() for k, c in self.costs.items()},
        }


def run_protocol(cfg: ProtocolConfig) -> ProtocolPoint:
    plain, fb = group(cfg), group(cfg, fallback=True)
    costs = {"legacy": legacy(cfg), "group": plain, "group_fallback": fb}
    if cfg.fallback_probability > 0:
        costs["group_expected"] = expected(plain, fb, cfg.fallback_probability)
    return ProtocolPoint(cfg, costs)


def run_protocol_sweep(base: ProtocolConfig, hosts: Sequence[int]) -> list[ProtocolPoint]:
    """``base`` at each host count, in the order given."""
    return [run_protocol(replace(base, hosts=n)) for n in hosts]


# --------------------------------------------------------------------------------------------------
# Growth with N
# --------------------------------------------------------------------------------------------------


def growth_exponent(n1: int, v1: float, n2: int, v2: float) -> float | None:
    """Empirical exponent ``e`` with ``v ~ N**e`` between two host counts: ``ln(v2/v1) / ln(n2/n1)``.

    0 when the value is the same (0 included); None when only one of them is 0 or the host counts are equal.
    """
    if n1 == n2:
        return None
    if v1 == v2:
        return 0.0
    if v1 <= 0 or v2 <= 0:
        return None
    return math.log(v2 / v1) / math.log(n2 / n1)


def metric(cost: ProtocolCost, name: str) -> float:
    return float(getattr(cost, name))


def growth(points: Sequence[ProtocolPoint]) -> dict[str, dict[str, list[float | None]]]:
    """metric -> protocol -> exponents between consecutive host counts (points sorted by hosts)."""
    ordered = sorted(points, key=lambda p: p.config.hosts)
    out: dict[str, dict[str, list[float | None]]] = {}
    for name in COMPLEXITY:
        out[name] = {
            proto: [
                growth_exponent(a.config.hosts, metric(a.costs[proto], name), b.config.hosts, metric(b.costs[proto], name))
                for a, b in itertools.pairwise(ordered)
            ]
            for proto in PROTOCOLS
        }
    return out
