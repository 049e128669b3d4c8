"""The headline table of a run (rich) and the run's closing lines; the other tables are in
:mod:`memstore.bench.render_details`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from memstore.bench.fmt import fmt_bps, fmt_faster, fmt_pct, fmt_ratio, fmt_ratio_over, fmt_s, fmt_share, verdict
from memstore.bench.render_details import render_diagnosis, render_floors, render_matrix, render_memory
from memstore.bench.render_first_save import render_first_save
from memstore.bench.scenario_results import LeakCheck
from memstore.bench.targets import (
    LEAK_MAX_PERCENT,
    PEER_RESTORE_LOAD_MIN,
    PEER_RESTORE_TCP_MIN,
    REPLICATION_MIN,
    STALL_DCP_MAX,
    STALL_DISK_MIN,
    STALL_MEMCPY_MAX,
)
from memstore.bench.units import fmt_bytes, percentile, short_size

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from memstore.bench.results import SizeResult
    from memstore.bench.run_result import BenchResult, ScenarioResult


def render(result: BenchResult, console: Console) -> None:
    head = result.cluster
    info = result.size_of(head)
    render_first_save(result, head, info, console)
    render_headline(result, head, info, console)
    render_floors(head, info, console)
    render_memory(head, result.leak_check, console)
    render_diagnosis(head, info, console)
    if len(result.scenarios) > 1 or result.skipped or result.failed:
        render_matrix(result, console)
    _render_footer(result, console)


def _render_footer(result: BenchResult, console: Console) -> None:
    m = result.machine
    cfg = result.config
    cond = result.conditions
    console.print(
        f"[dim]{m.cpu_count} CPUs ({m.cpu_model}), {fmt_bytes(m.ram_bytes)} RAM, Python {m.python}, torch {m.torch} "
        f"({m.torch_threads} threads), grpcio {m.grpcio}. Saves from the first of a fresh job on fresh stores, each timed "
        f"from the save() call: save 1, saves 2..{cfg.warmup + 1} (keep+2), then the steady state. "
        f"Peak memory (PSS, this process + stores + helpers): "
        f"{fmt_bytes(cond.memory_peak_pss_bytes)} during {cond.memory_peak_phase}. CPU pressure during the run: "
        f"{fmt_share(cond.cpu_pressure_some_share_during_run)} of the time some task (this bench's own included) waited for a CPU; "
        f"other processes took {fmt_share(cond.other_cpu_share_of_machine)} of the machine's CPU time. "
        f"Run took {result.duration_seconds:.0f} s.[/]"
    )
    if cfg.store_env or cfg.prefault is not None:
        env = {**cfg.store_env, **({"MEMSTORE_PREFAULT": cfg.prefault} if cfg.prefault is not None else {})}
        extra = " ".join(f"{k}={v}" for k, v in env.items())
        console.print(f"[yellow]store processes ran with extra environment: {extra}[/]")
    for f in result.failed:
        console.print(f"[bold red]scenario {f.name} failed: {f.error}[/]")
    for s in result.scenarios:
        for e in s.measured.errors:
            console.print(f"[bold yellow]{s.measured.name}: {e}[/]")
    if not result.ok:
        console.print("[bold red]not ok: a scenario failed or a restored state differed from the saved one[/]")


@dataclass
class _Headline:
    """What the headline table's rows read."""

    result: BenchResult
    cl: ScenarioResult
    info: SizeResult

    @property
    def nb(self) -> int:
        return self.info.state.shard_bytes

    @property
    def tcp_bps(self) -> float:
        return self.info.floors.tcp.bytes_per_second.p50

    @property
    def load_floor(self) -> str:
        disk = self.info.floors.disk
        return f"torch.load cached {fmt_s(disk.load_warm_seconds.p50)} / evicted {fmt_s(disk.load_cold_seconds.p50)}"


def _title(h: _Headline) -> str:
    cfg, m, st = h.result.config, h.cl.measured, h.info.state
    where = f"--endpoints {cfg.endpoints}" if cfg.endpoints else "127.0.0.1"
    return (
        f"memstore bench [{m.name}{', headline' if len(h.result.scenarios) > 1 else ''}]: steady state, older targets (issue 3) "
        f"and references; {fmt_bytes(st.bytes)} of float32 state ({st.tensors} tensors) on 1 rank, {m.hosts} hosts, R={m.replicas}, "
        f"{where}, data plane: {m.data_plane}"
    )


def _stall_rows(t: Table, h: _Headline) -> None:
    m, ra, tg, fl, nb = h.cl.measured, h.cl.ratios, h.cl.targets, h.info.floors, h.nb
    stall = m.stall_seconds
    paired = m.paired_memcpy_seconds.p50
    t.add_row(
        f"save() stall p50 (steady state, n={stall.n})",
        f"{fmt_s(stall.p50)} ({fmt_bps(nb / stall.p50)})",
        f"torch copy_ pre-faulted {fmt_s(paired)} ({fmt_bps(nb / paired)})",
        fmt_ratio(ra.stall_p50_over_memcpy),
        f"<= {STALL_MEMCPY_MAX}x",
        verdict(tg.stall_vs_memcpy),
    )
    t.add_row("save() stall p95 (steady state)", fmt_s(stall.p95), "same", fmt_ratio(ra.stall_p95_over_memcpy), "", "")
    t.add_row(
        "save 1 stall vs a copy into fresh memory (reference)",
        fmt_s(m.first_save.save_wall_seconds),
        f"torch copy_ into fresh memory {fmt_s(fl.memcpy.torch_copy_fresh_seconds.p50)}",
        fmt_ratio(ra.first_save_over_memcpy_fresh),
        "",
        "",
    )
    low = ra.torch_save_fsync_over_stall_p50
    t.add_row(
        "save() stall p50 vs torch.save",
        fmt_s(stall.p50),
        f"torch.save + fsync {fmt_s(fl.disk.save_fsync_seconds)}",
        "-" if low is None else f"{low:.1f}x lower",
        f">= {STALL_DISK_MIN:.0f}x lower",
        verdict(tg.stall_vs_torch_save_fsync),
    )


def _dcp_rows(t: Table, h: _Headline) -> None:
    m, ra, tg, fl = h.cl.measured, h.cl.ratios, h.cl.targets, h.info.floors
    stall, dcp = m.stall_seconds, fl.dcp
    default, reused, na = dcp.default, dcp.reused_stager, ra.unavailable
    returns = f"DCP async_save returns after {fmt_s(default.blocking_p50)} (default staging, n={dcp.reps})"
    t.add_row(
        "save() stall p50 vs DCP async_save (blocking)",
        fmt_s(stall.p50),
        f"DCP async_save (default staging) {default.unavailable}" if default.unavailable else returns,
        fmt_ratio_over(ra.stall_p50_over_dcp_async_blocking, na.get("stall_p50_over_dcp_async_blocking")),
        f"<= {STALL_DCP_MAX:.2f}x",
        verdict(tg.stall_vs_dcp_async_save),
    )
    returns = f"DCP async_save returns after {fmt_s(reused.blocking_p50)} (cached staging memory)"
    t.add_row(
        "  same, DCP with a reused stager (reference)",
        fmt_s(stall.p50),
        f"DCP async_save (reused stager) {reused.unavailable}" if reused.unavailable else returns,
        fmt_ratio_over(ra.stall_p50_over_dcp_async_blocking_reused_stager, na.get("stall_p50_over_dcp_async_blocking_reused_stager")),
        "",
        "",
    )
    com = m.committed_seconds
    dcp_done = f"DCP async_save done (fsynced) {fmt_s(default.total_p50)}"
    dcp_done = "DCP async_save unavailable (see above)" if default.unavailable else dcp_done
    t.add_row(
        f"time to committed p50 / p95 (R={m.replicas} copies)",
        f"{fmt_s(com.p50)} / {fmt_s(com.p95)}",
        f"{dcp_done}; torch.save + fsync {fmt_s(fl.disk.save_fsync_seconds)}",
        fmt_ratio_over(ra.committed_p50_over_dcp_async_total, na.get("committed_p50_over_dcp_async_total")),
        "",
        "",
    )
    if m.replicas >= 2:
        t.add_row(
            "replication throughput p50",
            f"{fmt_bps(m.replication_bytes_per_second.p50)} ({fmt_s(m.replication_seconds.p50)})",
            f"raw TCP loopback {fmt_bps(h.tcp_bps)}",
            fmt_ratio(ra.replication_over_raw_tcp),
            f">= {REPLICATION_MIN}x",
            verdict(tg.replication_vs_raw_tcp),
        )
    else:
        t.add_row("replication throughput", "n/a (R=1)", "", "", "", "n/a")


def _local_restore_rows(t: Table, h: _Headline) -> None:
    m, ra, nb = h.cl.measured, h.cl.ratios, h.nb
    lc = m.restore_local_copy
    t.add_row(
        "restore from local RAM after a trainer crash, load(zero_copy=False) (reference)",
        f"{fmt_s(lc.seconds.p50)} ({fmt_bps(nb / lc.seconds.p50)})",
        h.load_floor,
        fmt_faster(ra.torch_load_warm_over_restore_local_copy),
        "",
        "",
    )


def _peer_restore_rows(t: Table, h: _Headline) -> None:
    m, ra, tg = h.cl.measured, h.cl.ratios, h.cl.targets
    peer = m.restore_peer
    if peer:
        t.add_row(
            "restore from peer RAM after a host replacement (from the trainer's load call) vs torch.load",
            fmt_s(peer.seconds.p50),
            h.load_floor,
            f"{fmt_faster(ra.torch_load_warm_over_restore_peer)} / {fmt_faster(ra.torch_load_cold_over_restore_peer)}",
            f">= {PEER_RESTORE_LOAD_MIN:.0f}x faster",
            verdict(tg.restore_peer_vs_torch_load),
        )
        losses = [r.host_loss for r in peer.runs if r.host_loss]
        serving = percentile([x.serving_to_loaded_seconds for x in losses if x.serving_to_loaded_seconds is not None], 50)
        t.add_row("  same, from the replacement's 'serving on' log line (issue 3's timing; reference)", fmt_s(serving), "", "", "", "")
    elif m.replicas >= 2:
        t.add_row("restore from peer RAM after a host loss", "skipped", m.restore_peer_note or "", "", "", "")
    else:
        t.add_row("restore from peer RAM", "n/a (R=1)", m.restore_peer_note or "", "", "", "n/a")


def _peer_pull_rows(t: Table, h: _Headline) -> None:
    m, ra, tg, nb = h.cl.measured, h.cl.ratios, h.cl.targets, h.nb
    pd = m.restore_peer_deleted
    if pd:
        deleted_targets = not m.restore_peer
        warm = h.info.floors.disk.load_warm_seconds.p50
        t.add_row(
            f"{'restore from peer RAM' if deleted_targets else '  owner store up'}, its copy deleted: new process "
            f"(n={pd.seconds.n}, src {','.join(pd.source_hosts)})",
            f"{fmt_s(pd.seconds.p50)} ({fmt_bps(nb / pd.seconds.p50)})",
            f"raw TCP {fmt_bps(h.tcp_bps)}; torch.load cached {fmt_s(warm)}",
            f"{fmt_ratio(ra.restore_peer_deleted_over_raw_tcp)}; {fmt_faster(ra.torch_load_warm_over_restore_peer_deleted)}",
            f">= {PEER_RESTORE_TCP_MIN}x; >= {PEER_RESTORE_LOAD_MIN:.0f}x" if deleted_targets else "",
            f"{verdict(tg.restore_peer_vs_raw_tcp)} {verdict(tg.restore_peer_vs_torch_load)}" if deleted_targets else "",
        )
    pp = m.peer_pull
    if pp:
        t.add_row(
            f"  of which the store's pull (Fetch RPC alone, n={pp.seconds.n})",
            f"{fmt_s(pp.seconds.p50)} ({fmt_bps(pp.bytes_per_second.p50)})",
            f"raw TCP loopback {fmt_bps(h.tcp_bps)}",
            fmt_ratio(ra.peer_pull_over_raw_tcp),
            "",
            "",
        )


def _memory_rows(t: Table, h: _Headline) -> None:
    tg = h.cl.targets
    leak = h.result.leak_check
    if isinstance(leak, LeakCheck) and leak.processes:
        t.add_row(
            f"RSS growth, save {leak.reference_save} -> {leak.saves} ({short_size(leak.size)} state; worst: {leak.worst})",
            fmt_pct(leak.max_growth_percent),
            ", ".join(f"{k} {fmt_pct(v.growth_percent)}" for k, v in leak.processes.items()),
            "",
            f"< {LEAK_MAX_PERCENT:.0f}%",
            verdict(tg.rss_growth_over_saves),
        )
    else:
        t.add_row("RSS growth over consecutive saves", "skipped", "" if isinstance(leak, LeakCheck) else leak.skipped, "", "", "n/a")


def render_headline(result: BenchResult, cl: ScenarioResult, info: SizeResult, console: Console) -> None:
    from rich.table import Table

    h = _Headline(result, cl, info)
    t = Table(title=_title(h))
    t.add_column("figure")
    t.add_column("memstore", justify="right")
    t.add_column("baseline (same run)")
    t.add_column("ratio", justify="right")
    t.add_column("target", justify="right")
    t.add_column("", justify="center")
    for rows in (_stall_rows, _dcp_rows, _local_restore_rows, _peer_restore_rows, _peer_pull_rows, _memory_rows):
        rows(t, h)
    console.print(t)
    tg = cl.targets
    missed = [k for k, x in tg.items() if x.passed is False]
    console.print(f"targets: {tg.passed} PASS, {len(missed)} MISS{': ' + ', '.join(missed) if missed else ''}")
