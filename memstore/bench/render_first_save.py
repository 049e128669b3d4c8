"""The first table of a run (rich): what a user sees from the first save, against issue 16's targets: the saves from
the first one (store defaults, and with memory pre-faulted), the fixed costs (small states, per tensor), the path
without shared memory, the restores, and the stores' memory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memstore.bench.first_save import PhaseFigures, SeriesResult
from memstore.bench.fmt import fmt_bps, fmt_ratio, fmt_s, fmt_share, verdict
from memstore.bench.target import (
    COMMITTED_TCP_MIN,
    FIRST_SAVE_MEMCPY_MAX,
    LATER_SAVES_MEMCPY_MAX,
    NO_SHM_TCP_MIN,
    PER_TENSOR_MAX_US,
    SMALL_STATE_STALL_MAX,
    SMALL_STATE_TARGET_SIZE,
    STORE_RSS_MAX,
    Target,
)
from memstore.bench.targets import LOCAL_RESTORE_LOAD_MIN, PEER_RESTORE_TCP_MIN
from memstore.bench.units import fmt_bytes, percentile, short_size

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from memstore.bench.results import SizeResult
    from memstore.bench.run_result import BenchResult, ScenarioResult


def fmt_us(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} us"


def _faster(warm: float | None, cold: float | None) -> str:
    """torch.load (page cache warm / evicted) over the restore: > 1 is faster than torch.load."""
    return f"{fmt_ratio(warm)} / {fmt_ratio(cold)}"


def _row_check(value: float | None, ok: Callable[[float], bool]) -> str:
    """A row's own PASS/MISS: one part of a target (the target itself is the worst of its rows)."""
    return verdict(Target.check("", value, ok))


@dataclass
class _Ctx:
    result: BenchResult
    cl: ScenarioResult
    info: SizeResult

    @property
    def tcp_bps(self) -> float:
        return self.info.floors.tcp.bytes_per_second.p50

    @property
    def standalone(self) -> float:
        return self.info.floors.memcpy.torch_copy_seconds.p50

    @property
    def tcp_text(self) -> str:
        return f"raw TCP {fmt_bps(self.tcp_bps)} ({fmt_s(self.info.state.bytes / self.tcp_bps)})"


def _phase_rows(t: Table, c: _Ctx, p: PhaseFigures, what: str, first: bool, tg: Target | None) -> None:
    nb = c.info.state.bytes
    stall, com = p.stall_seconds, p.committed_seconds
    memcpy = p.paired_memcpy_seconds.p50 if p.paired_memcpy_seconds else None
    limit = FIRST_SAVE_MEMCPY_MAX if first else LATER_SAVES_MEMCPY_MAX
    stall_txt = fmt_s(stall.p50) if first else f"{fmt_s(stall.p50)}, max {fmt_s(stall.max)}"
    worst = "" if first else " worst"
    t.add_row(
        f"  {what}: stall{'' if first else ' p50, max'}",
        f"{stall_txt} ({fmt_bps(nb / stall.p50)})" if first else stall_txt,
        f"memcpy, paired{'' if first else ' p50'} {fmt_s(memcpy)} (standalone {fmt_s(c.standalone)})",
        fmt_ratio(p.stall_over_memcpy_max) + worst,
        f"<= {limit:g}x",
        verdict(tg) if tg else _row_check(p.stall_over_memcpy_max, lambda v: v <= limit),
    )
    com_txt = "not committed" if com is None else fmt_s(com.p50) if first else f"{fmt_s(com.p50)}, max {fmt_s(com.max)}"
    t.add_row(
        f"  {what}: call->committed{'' if first else ' p50, max'}",
        f"{com_txt} ({fmt_bps(p.committed_bytes_per_second_min)})" if first else com_txt,
        c.tcp_text,
        fmt_ratio(p.committed_over_raw_tcp_min) + worst,
        f">= {COMMITTED_TCP_MIN}x",
        _row_check(p.committed_over_raw_tcp_min, lambda v: v >= COMMITTED_TCP_MIN),
    )


def _series_rows(t: Table, c: _Ctx, s: SeriesResult) -> None:
    f, m = s.figures, s.measured
    t.add_row(f"[bold]{m.label}[/]: saves 1..{len(m.saves)} of a fresh job on fresh stores", "", "", "", "", "")
    if not m.saves:
        t.add_row("  failed", "", m.error[:120], "", "", "n/a")
        return
    tg = f.targets
    if f.first:
        _phase_rows(t, c, f.first, "save 1", True, tg.first_save_stall_vs_memcpy)
    for p, what in ((f.early, ""), (f.steady, " (steady)")):
        if p:
            _phase_rows(t, c, p, f"saves {p.saves}{what}", False, None)
    t.add_row(
        f"  every save: worst stall of 2..{len(m.saves)}; worst call->committed",
        "",
        "",
        f"{fmt_ratio(f.later_stall_over_memcpy_max)}; {fmt_ratio(f.committed_over_raw_tcp_min)}",
        f"<={LATER_SAVES_MEMCPY_MAX:g}x; >={COMMITTED_TCP_MIN}x",
        f"{verdict(tg.later_saves_stall_vs_memcpy)} {verdict(tg.committed_vs_raw_tcp_every_save)}",
    )


def _fixed_cost_rows(t: Table, c: _Ctx) -> None:
    first = c.result.from_first_save
    tg = c.cl.targets
    if first is None:
        return
    for r in first.small_states:
        m = r.measured
        target = m.size == SMALL_STATE_TARGET_SIZE
        t.add_row(
            f"fixed cost: {short_size(m.size)} state, stall p50 / p95 (n={r.stall_seconds.n} after save 1)",
            f"{fmt_s(r.stall_seconds.p50)} / {fmt_s(r.stall_seconds.p95)}",
            f"memcpy {fmt_s(r.paired_memcpy_seconds.p50 if r.paired_memcpy_seconds else None)}; save 1 {fmt_s(r.first_stall_seconds)}; "
            f"other CPU {fmt_share(m.conditions.other_cpu_share_of_machine)}",
            "",
            f"<= {SMALL_STATE_STALL_MAX * 1000:g} ms" if target else "",
            verdict(tg.small_state_stall) if target else "",
        )
        t.add_row(
            f"  {short_size(m.size)} state: call -> committed p50",
            fmt_s(r.committed_seconds.p50 if r.committed_seconds else None),
            f"save 1 {fmt_s(r.first_committed_seconds)}",
            "",
            "",
            "",
        )
    pt = first.per_tensor
    if pt:
        run = pt.measured
        what = f"{run.count:,} x {run.tensor_bytes // 1024} KiB vs 1 tensor"
        t.add_row(
            f"per tensor: save() stall, {what} (steady p50)",
            fmt_us(pt.save_stall_us_per_tensor),
            f"{fmt_s(pt.many_save_stall_seconds)} vs {fmt_s(pt.one_save_stall_seconds)} (save 1: {fmt_s(pt.many_first_save_seconds)} "
            f"vs {fmt_s(pt.one_first_save_seconds)})",
            "",
            f"<= {PER_TENSOR_MAX_US:g} us",
            verdict(tg.per_tensor_save_stall),
        )
        t.add_row(
            f"per tensor: load(), {what} (p50 of {run.many.load_seconds.n})",
            fmt_us(pt.load_us_per_tensor),
            f"{fmt_s(pt.many_load_seconds)} vs {fmt_s(pt.one_load_seconds)}",
            "",
            f"<= {PER_TENSOR_MAX_US:g} us",
            verdict(tg.per_tensor_load),
        )


def _no_shm_rows(t: Table, c: _Ctx) -> None:
    first = c.result.from_first_save
    r = first.no_shared_memory if first else None
    tg = c.cl.targets
    if r is None:
        t.add_row("no shared memory (use_shared_memory=False)", "not measured", tg.no_shm_save_vs_raw_tcp.note, "", "", "n/a")
        return
    nb = r.measured.state_bytes
    com = r.committed_seconds
    rows = (
        (f"no shared memory: save stall p50 (n={r.stall_seconds.n}; save 1 {fmt_s(r.first_stall_seconds)})",
         r.stall_seconds.p50, r.stall_over_raw_tcp, tg.no_shm_save_vs_raw_tcp),
        ("  no shared memory: call -> committed p50", com.p50 if com else None, r.committed_over_raw_tcp,
         tg.no_shm_committed_vs_raw_tcp),
        (f"  no shared memory: connect + load() p50 (n={r.measured.load_seconds.n})", r.measured.load_seconds.p50,
         r.load_over_raw_tcp, tg.no_shm_load_vs_raw_tcp),
    )  # fmt: skip
    for label, seconds, rat, target in rows:
        t.add_row(
            label, f"{fmt_s(seconds)} ({fmt_bps(nb / seconds if seconds else None)})", c.tcp_text, fmt_ratio(rat),
            f">= {NO_SHM_TCP_MIN}x", verdict(target),
        )  # fmt: skip


def _restore_rows(t: Table, c: _Ctx) -> None:
    m, ra, tg, nb = c.cl.measured, c.cl.ratios, c.cl.targets, c.info.state.shard_bytes
    disk = c.info.floors.disk
    load_floor = f"torch.load cached / evicted {fmt_s(disk.load_warm_seconds.p50)} / {fmt_s(disk.load_cold_seconds.p50)}"
    loc = m.restore_local
    t.add_row(
        f"restore from local RAM after a trainer crash (new process, n={loc.seconds.n})",
        f"{fmt_s(loc.seconds.p50)} ({fmt_bps(nb / loc.seconds.p50)})",
        load_floor,
        _faster(ra.torch_load_warm_over_restore_local, ra.torch_load_cold_over_restore_local),
        f">= {LOCAL_RESTORE_LOAD_MIN:.0f}x faster",
        verdict(tg.restore_local_vs_torch_load),
    )
    peer = m.restore_peer
    if peer:
        losses = [r.host_loss for r in peer.runs if r.host_loss]
        start = [x.start_to_loaded_seconds for x in losses if x.start_to_loaded_seconds]
        t.add_row(
            f"restore from peer RAM after a host replacement: first restore after it, from the load call (n={peer.seconds.n}, "
            f"src {','.join(peer.source_hosts)}, pulled by {'+'.join(peer.pulled_by or []) or '?'})",
            f"{fmt_s(peer.seconds.p50)} ({fmt_bps(peer.bytes_per_second)})",
            f"raw TCP {fmt_bps(c.tcp_bps)}; from the replacement's start {fmt_s(percentile(start, 50) if start else None)}",
            fmt_ratio(ra.restore_peer_over_raw_tcp),
            f">= {PEER_RESTORE_TCP_MIN}x",
            verdict(tg.restore_peer_vs_raw_tcp),
        )
    else:
        note = m.restore_peer_note or ""
        t.add_row("restore from peer RAM after a host replacement", "n/a", note, "", "", verdict(tg.restore_peer_vs_raw_tcp))
    d = m.restore_durable
    if d.restore:
        t.add_row(
            f"restore from durable storage (file:// spill, new process, n={d.restore.seconds.n}, src {','.join(d.restore.source_hosts)})",
            f"{fmt_s(d.restore.seconds.p50)} ({fmt_bps(nb / d.restore.seconds.p50)})",
            load_floor,
            _faster(ra.torch_load_warm_over_restore_durable, ra.torch_load_cold_over_restore_durable),
            "",
            "",
        )
    else:
        t.add_row("restore from durable storage", "n/a", (d.error or d.note)[:120], "", "", "n/a")


def _memory_row(t: Table, c: _Ctx) -> None:
    mem, ra, tg = c.cl.measured.store_memory, c.cl.ratios, c.cl.targets
    w = mem.stores[mem.worst_host] if mem.worst_host else None
    if w and w.held and w.memory:
        t.add_row(
            f"store RSS / (shard bytes held + pool) (worst: {mem.worst_host}, {w.held.shards} shards)",
            f"{fmt_bytes(w.memory.rss)} / {fmt_bytes(w.held.shard_bytes_held + w.held.pooled_bytes_estimate)}",
            f"held {fmt_bytes(w.held.shard_bytes_held)} + pooled/pre-faulted {fmt_bytes(w.held.pooled_bytes_estimate)}; "
            f"RSS / held alone {fmt_ratio(ra.store_rss_over_held_max)}",
            fmt_ratio(ra.store_rss_over_held_plus_pooled_max),
            f"<= {STORE_RSS_MAX}x",
            verdict(tg.store_rss_vs_held),
        )
    else:
        t.add_row("store RSS / (shard bytes held + pool)", "n/a", mem.note, "", "", "n/a")


def render_first_save(result: BenchResult, cl: ScenarioResult, info: SizeResult, console: Console) -> None:
    from rich.table import Table

    c = _Ctx(result, cl, info)
    m = cl.measured
    t = Table(
        title=f"memstore bench [{m.name}]: what a user sees from the first save (issue 16 targets); {fmt_bytes(info.state.bytes)} "
        f"of float32 state on 1 rank, {m.hosts} hosts, R={m.replicas}; memcpy: torch copy_ into pre-faulted memory right before each save"
    )
    t.add_column("figure", ratio=6)
    t.add_column("memstore", justify="right", ratio=3)
    t.add_column("baseline (same run)", ratio=4)
    t.add_column("ratio", justify="right", ratio=1)
    t.add_column("target", justify="right", ratio=1)
    t.add_column("", justify="center", width=9)
    first = result.from_first_save
    series = first.series if first else []
    for s in series:
        _series_rows(t, c, s)
        t.add_section()
    _fixed_cost_rows(t, c)
    _no_shm_rows(t, c)
    t.add_section()
    _restore_rows(t, c)
    _memory_row(t, c)
    console.print(t)
    console.print(
        "[dim]memcpy paired: right before each save (the ratios and targets use it); standalone: p50 of 5 before any store "
        "started, for reference. Ratio of a restore: torch.load (page cache warm / evicted) over it, > 1 is faster. Rows "
        "under a target show their own part of it; a target is the worst of its rows.[/]"
    )
    if first and not first.prefault_supported:
        console.print("[yellow]the stores of this checkout do not know --prefault: MEMSTORE_PREFAULT was ignored[/]")
    for note in first.notes if first else []:
        console.print(f"[yellow]{note}[/]")
