"""Which scenarios a run measures (state size x hosts x R), and the RAM each needs on this machine. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from memstore.bench.options import MATRIX_RESTORES, MATRIX_SAVES, BenchConfig
from memstore.bench.scenario_results import Endpoints, RamNeed, Skipped
from memstore.bench.units import GiB, MiB, fmt_bytes, round_page, short_size

BENCH_COPIES = 3  # state + up to two transient copies of it in this process (floor buffers, torch.load, DCP staging, a restore)
PROCESS_OVERHEAD = 448 * MiB  # PSS of the bench and a restore process (Python + torch + gRPC) without the state
STORE_OVERHEAD = 64 * MiB  # PSS of one idle store process
SHARD_HEADER = 64 * 1024  # a shard adds a small header to the state's bytes
HEADLINE = (GiB, 2, 2)


@dataclass
class Scenario:
    size: int
    hosts: int
    replicas: int
    saves: int
    restores: int
    headline: bool = False

    @property
    def name(self) -> str:
        return f"{short_size(self.size)}-{self.hosts}h-R{self.replicas}"


def ram_need(size: int, replicas: int, hosts: int, keep: int) -> RamNeed:
    """Estimated RAM a scenario needs on this machine.

    The stores: keep steps, one being saved and the two segments of the automatic reserve (--prefault auto)
    of the one benchmarked rank on each of its R holders, (keep+3) x size x R. With one rank per host (a real
    job) that would be x hosts more, reported as ``one_rank_per_host_bytes`` for reference. The bench
    process: the state plus up to two transient copies. Plus the processes themselves (Python, torch,
    gRPC): the bench, a restore process, ~40-60 MiB per store.
    """
    segment = round_page(size + SHARD_HEADER)
    stores = (keep + 3) * segment * replicas
    bench = BENCH_COPIES * size
    processes = PROCESS_OVERHEAD + STORE_OVERHEAD * hosts
    return RamNeed(
        stores_bytes=stores,
        bench_bytes=bench,
        processes_bytes=processes,
        total_bytes=stores + bench + processes,
        one_rank_per_host_bytes=stores * hosts + bench + processes,
    )


def _combos(config: BenchConfig, endpoints: Endpoints | None, skipped: list[Skipped]) -> list[tuple[int, int]]:
    if endpoints is not None:
        return [(len(endpoints.hosts), endpoints.replicas)]
    combos = []
    for h, r in config.combos:
        if r > h:
            skipped.append(Skipped(size=None, hosts=h, replicas=r, reason=f"R={r} needs at least {r} hosts"))
        else:
            combos.append((h, r))
    return combos


def _why_not(config: BenchConfig, size: int, hosts: int, replicas: int, endpoints: Endpoints | None) -> Skipped | None:
    """Why a scenario cannot run here (RAM, or the --endpoints cluster's capacity), or None."""
    need = ram_need(size, replicas, hosts, config.keep)
    if endpoints is not None:
        # The stores are not ours to budget; the cluster's capacity is.
        cap = endpoints.capacity_bytes
        if (config.keep + 1) * round_page(size + SHARD_HEADER) > cap:
            reason = f"keep+1 shards of {short_size(size)} exceed the store capacity {fmt_bytes(cap)}"
            return Skipped(size=size, hosts=hosts, replicas=replicas, reason=reason)
        total = need.bench_bytes
    else:
        total = need.total_bytes
    if total <= config.max_ram:
        return None
    reason = (
        f"needs ~{fmt_bytes(total)} of RAM ((keep+1)={config.keep + 1} x {short_size(size)} x R={replicas} in the "
        f"stores + {BENCH_COPIES} x {short_size(size)} in the bench + processes) > --max-ram {fmt_bytes(config.max_ram)}"
    )
    return Skipped(size=size, hosts=hosts, replicas=replicas, ram_need=need, reason=reason)


def _mark_headline(config: BenchConfig, scenarios: list[Scenario]) -> None:
    head = next((s for s in scenarios if (s.size, s.hosts, s.replicas) == HEADLINE), None)
    if head is None:
        head = max(scenarios, key=lambda s: (s.size, s.replicas >= 2, -s.hosts))
    head.headline = True
    if config.matrix:
        for s in scenarios:
            if not s.headline:
                s.saves = min(config.saves, MATRIX_SAVES)
                s.restores = min(config.restores, MATRIX_RESTORES)
    config.size, config.hosts_headline, config.replicas_headline = head.size, head.hosts, head.replicas


def plan_scenarios(config: BenchConfig, endpoints: Endpoints | None) -> tuple[list[Scenario], list[Skipped]]:
    """The scenarios to run, and the ones skipped with their reason."""
    scenarios: list[Scenario] = []
    skipped: list[Skipped] = []
    combos = _combos(config, endpoints, skipped)
    for size in config.sizes:
        for h, r in combos:
            why = _why_not(config, size, h, r, endpoints)
            if why is not None:
                skipped.append(why)
            else:
                scenarios.append(Scenario(size, h, r, config.saves, config.restores))
    if scenarios:
        _mark_headline(config, scenarios)
    return scenarios, skipped
