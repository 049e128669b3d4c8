"""The tables after the headline (rich): baselines, store memory and the leak check, diagnosis, all scenarios."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memstore.bench.floors import GRPC_REPS, TCP_REPS
from memstore.bench.fmt import fmt_bps, fmt_faster, fmt_pct, fmt_ratio, fmt_ratio_over, fmt_s, fmt_share
from memstore.bench.scenario_results import Leak, LeakCheck
from memstore.bench.units import MiB, fmt_bytes, percentile, ratio, short_size

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from memstore.bench.results import SizeResult
    from memstore.bench.run_result import BenchResult, ScenarioResult


def _table(title: str, *columns: str, left: str = "") -> Table:
    from rich.table import Table

    t = Table(title=title)
    for col in columns:
        t.add_column(col, justify="left" if col == left else "right")
    return t


def _memcpy_rows(f: Table, cl: ScenarioResult, info: SizeResult) -> None:
    mc = info.floors.memcpy
    nb = info.state.shard_bytes
    paired = cl.measured.paired_memcpy_seconds
    f.add_row(f"torch copy_ pre-faulted, paired with the saves (p50 of {paired.n})", fmt_s(paired.p50), fmt_bps(nb / paired.p50))
    copy_s = mc.torch_copy_seconds.p50
    f.add_row(f"torch copy_ pre-faulted, {mc.torch_threads} threads, standalone (p50 of 5)", fmt_s(copy_s), fmt_bps(nb / copy_s))
    mm = mc.memmove_single_thread_seconds.p50
    f.add_row("ctypes.memmove single thread, pre-faulted", fmt_s(mm), fmt_bps(nb / mm))
    if mc.shm_torch_copy_seconds:
        shm = mc.shm_torch_copy_seconds.p50
        f.add_row("torch copy_ into a pre-faulted /dev/shm MAP_SHARED mapping (p50 of 5)", fmt_s(shm), fmt_bps(nb / shm))
    fresh_s = mc.torch_copy_fresh_seconds.p50
    f.add_row("torch copy_ into fresh memory (incl. page faults, p50 of 2)", fmt_s(fresh_s), fmt_bps(nb / fresh_s))


def _network_rows(f: Table, info: SizeResult) -> None:
    fl = info.floors
    tcp_bps = fl.tcp.bytes_per_second.p50
    f.add_row(f"raw TCP loopback, 4 MiB sendall / recv_into (p50 of {TCP_REPS})", fmt_s(fl.tcp.seconds.p50), fmt_bps(tcp_bps))
    for g, label in ((fl.grpc_bytes, "raw bytes messages"), (fl.grpc_protobuf, "PutRequest protobuf messages")):
        f.add_row(
            f"gRPC-Python stream, 4 MiB {label} (p50 of {GRPC_REPS})",
            fmt_s(g.seconds.p50),
            f"{fmt_bps(g.bytes_per_second.p50)} = {fmt_ratio(ratio(g.bytes_per_second.p50, tcp_bps))} TCP",
        )


def _storage_rows(f: Table, info: SizeResult) -> None:
    disk, dcp = info.floors.disk, info.floors.dcp
    nb = info.state.shard_bytes
    f.add_row(
        f"torch.save + fsync ({disk.filesystem or 'local disk'})", fmt_s(disk.save_fsync_seconds), fmt_bps(nb / disk.save_fsync_seconds)
    )
    f.add_row("  of which fsync", fmt_s(disk.fsync_seconds), "")
    n_loads = disk.load_cold_seconds.n
    cold_load = disk.load_cold_seconds.p50
    warm = disk.load_warm_seconds.p50
    f.add_row(f"torch.load, page cache evicted (p50 of {n_loads})", fmt_s(cold_load), fmt_bps(nb / cold_load))
    f.add_row(f"torch.load, page cache warm (p50 of {n_loads})", fmt_s(warm), fmt_bps(nb / warm))
    for d, label in ((dcp.default, "default staging"), (dcp.reused_stager, "reused DefaultStager")):
        if d.blocking_seconds is None or d.total_seconds is None:
            f.add_row(f"DCP async_save, {label}", "unavailable", d.unavailable or "not measured")
            continue
        f.add_row(
            f"DCP async_save, {label}: blocking / total incl. fsync (p50 of {d.blocking_seconds.n})",
            f"{fmt_s(d.blocking_seconds.p50)} / {fmt_s(d.total_seconds.p50)}",
            f"{fmt_bps(nb / d.blocking_seconds.p50)} / {fmt_bps(nb / d.total_seconds.p50)}",
        )
    fc = dcp.reused_stager.first_call
    if fc:
        f.add_row("  reused DefaultStager, first call (fills its cache)", f"{fmt_s(fc.blocking_seconds)} / {fmt_s(fc.total_seconds)}", "")


def render_floors(cl: ScenarioResult, info: SizeResult, console: Console) -> None:
    f = _table(
        f"baselines and references ({short_size(cl.measured.size)}, same run)", "measurement", "time", "throughput", left="measurement"
    )
    _memcpy_rows(f, cl, info)
    _network_rows(f, info)
    _storage_rows(f, info)
    console.print(f)


def _render_leak(leak: LeakCheck, console: Console) -> None:
    lt = _table(
        f"RSS over {leak.saves} consecutive saves of {short_size(leak.size)} ({leak.hosts} hosts, R={leak.replicas})",
        "process", f"RSS after save {leak.reference_save}", f"after save {leak.saves}", "growth", "RssAnon growth", "PSS growth",
        left="process",
    )  # fmt: skip
    for k, v in leak.processes.items():
        lt.add_row(
            k,
            fmt_bytes(v.rss_after_save_ref),
            fmt_bytes(v.rss_after_last_save),
            fmt_pct(v.growth_percent),
            f"{v.rss_anon_growth_bytes / MiB:+.1f} MiB",
            fmt_pct(v.pss_growth_percent),
        )
    console.print(lt)


def render_memory(cl: ScenarioResult, leak: Leak, console: Console) -> None:
    mem = cl.measured.store_memory
    t = _table(
        f"store memory after the saves [{cl.measured.name}] (RSS from /proc/<pid>/status, PSS from smaps_rollup)",
        "store", "pid", "shards", "held", "pooled", "VmRSS", "RssShmem", "RssAnon", "Pss", "RSS/held", "RSS/(held+pooled)", left="store",
    )  # fmt: skip
    for h, e in mem.stores.items():
        m, held, r = e.memory, e.held, e.ratios
        t.add_row(
            h,
            str(e.pid or "-"),
            str(held.shards) if held else "-",
            fmt_bytes(held.shard_bytes_held if held else None),
            fmt_bytes(held.pooled_bytes_estimate if held else None),
            fmt_bytes(m.rss if m else None),
            fmt_bytes(m.rss_shmem if m else None),
            fmt_bytes(m.rss_anon if m else None),
            fmt_bytes(m.pss if m else None),
            fmt_ratio(r.rss_over_held if r else None),
            fmt_ratio(r.rss_over_held_plus_pooled if r else None),
        )
    console.print(t)
    if isinstance(leak, LeakCheck) and leak.processes:
        _render_leak(leak, console)


def _save_path_rows(c: Table, cl: ScenarioResult, info: SizeResult) -> None:
    sp = info.diagnosis.save_path
    nb = info.state.shard_bytes
    if sp is None:
        return
    c.add_row("save: serialization.plan()", fmt_s(sp.plan_seconds.p50), "")
    w = sp.write_into_shm_seconds.p50
    c.add_row("save: ShardLayout.write_into(pre-faulted /dev/shm mapping)", fmt_s(w), fmt_bps(nb / w))
    c.add_row("save: measured save() p50 (adds Allocate + Commit RPCs)", fmt_s(cl.measured.stall_seconds.p50), "")
    fresh = sp.fresh_segment_seconds
    if fresh:
        c.add_row(
            "store: a fresh segment (ftruncate + fallocate + MAP_POPULATE as SegmentPool._create; cold saves, pulls into an empty pool)",
            f"{fmt_s(fresh.seconds.p50)} (fallocate {fmt_s(fresh.fallocate_seconds.p50)})",
            fmt_bps(nb / fresh.seconds.p50),
        )


def _replication_rows(c: Table, cl: ScenarioResult, info: SizeResult) -> None:
    cm = info.diagnosis
    for k, v in cm.seconds.items():
        c.add_row(f"replication: {k}", fmt_s(v), fmt_bps(cm.bytes / v if v > 0 else None))
    c.add_row("replication: sender CPU estimate (xxh3 + build + serialize)", fmt_s(cm.sender_cpu_seconds_estimate), "")
    c.add_row("replication: receiver CPU estimate (parse + xxh3 + copy)", fmt_s(cm.receiver_cpu_seconds_estimate), "")
    m = cl.measured
    if m.replicas >= 2:
        c.add_row(f"replication: measured (committed - stall) p50, {m.data_plane}", fmt_s(m.replication_seconds.p50), "")


def _restore_rows(c: Table, cl: ScenarioResult, info: SizeResult) -> None:
    m = cl.measured
    loc = m.restore_local
    c.add_row("restore (local, new process): connect p50", fmt_s(loc.connect_seconds.p50), "")
    c.add_row(
        "restore (local, new process): load() p50 (LatestStep + Fetch + Open + map + verify + decode)", fmt_s(loc.load_seconds.p50), ""
    )
    peer = m.restore_peer
    if not peer:
        return
    losses = [r.host_loss for r in peer.runs if r.host_loss]
    restarts = [x.restart_seconds for x in losses if x.restart_seconds]
    c.add_row("restore (host loss): replacement store start -> serving p50 (not in the figure)", fmt_s(percentile(restarts, 50)), "")
    c.add_row(
        "restore (host loss): port open -> loaded p50 (includes the replacement's startup before it serves)",
        fmt_s(percentile([x.port_open_to_loaded_seconds for x in losses], 50)),
        "",
    )
    c.add_row(
        "restore (host loss): connect p50 / load() p50 (LatestStep + Fetch joining the repair's pull + Open + verify)",
        f"{fmt_s(peer.connect_seconds.p50)} / {fmt_s(peer.load_seconds.p50)}",
        "",
    )
    sp = info.diagnosis.save_path
    fresh = sp.fresh_segment_seconds if sp else None
    if fresh and m.peer_pull:
        model = fresh.seconds.p50 + m.peer_pull.seconds.p50 + loc.seconds.p50
        c.add_row(
            "restore (host loss): model = fresh segment + pull into a pooled segment + local restore (vs measured)",
            f"{fmt_s(model)} (measured {fmt_s(peer.seconds.p50)})",
            "",
        )


def render_diagnosis(cl: ScenarioResult, info: SizeResult, console: Console) -> None:
    c = _table(
        "diagnosis: CPU cost of the save path and of the gRPC data plane's per-chunk steps (this process, same bytes)",
        "step", "time", "throughput", left="step",
    )  # fmt: skip
    _save_path_rows(c, cl, info)
    _replication_rows(c, cl, info)
    _restore_rows(c, cl, info)
    console.print(c)


MATRIX_COLUMNS = (
    "scenario",
    "stall p50 (x memcpy)",
    "stall / DCP blocking",
    "committed p50",
    "replication (x TCP)",
    "local restore (vs torch.load)",
    "peer restore, host loss (x TCP)",
    "RSS/held (/held+pooled)",
    "targets (P/M)",
    "other CPU / pressure",
)


def _matrix_row(s: ScenarioResult) -> list[str]:
    m, ra = s.measured, s.ratios
    cond = m.conditions
    peer_txt = "-"
    if m.restore_peer:
        peer_txt = f"{fmt_s(m.restore_peer.seconds.p50)} ({fmt_ratio(ra.restore_peer_over_raw_tcp)})"
    elif m.restore_peer_deleted:
        peer_txt = f"deleted copy: {fmt_s(m.restore_peer_deleted.seconds.p50)} ({fmt_ratio(ra.restore_peer_over_raw_tcp)})"
    repl = "-" if m.replicas < 2 else f"{fmt_bps(m.replication_bytes_per_second.p50)} ({fmt_ratio(ra.replication_over_raw_tcp)})"
    verdicts = "".join({True: "P", False: "M", None: "-"}[t.passed] for t in s.targets.values())
    return [
        m.name + (" *" if m.headline else ""),
        f"{fmt_s(m.stall_seconds.p50)} ({fmt_ratio(ra.stall_p50_over_memcpy)})",
        fmt_ratio_over(ra.stall_p50_over_dcp_async_blocking, ra.unavailable.get("stall_p50_over_dcp_async_blocking")),
        fmt_s(m.committed_seconds.p50),
        repl,
        f"{fmt_s(m.restore_local.seconds.p50)} ({fmt_faster(ra.torch_load_warm_over_restore_local)})",
        peer_txt,
        f"{fmt_ratio(ra.store_rss_over_held_max)} ({fmt_ratio(ra.store_rss_over_held_plus_pooled_max)})",
        f"{s.targets_passed}/{s.targets_passed + s.targets_missed} {verdicts}",
        f"{fmt_share(cond.other_cpu_share_of_machine)} / {fmt_share(cond.cpu_pressure_some_share)}",
    ]


def render_matrix(result: BenchResult, console: Console) -> None:
    t = _table(
        f"all scenarios ({len(result.scenarios)} run, {len(result.failed)} failed, {len(result.skipped)} skipped); headline marked *",
        *MATRIX_COLUMNS,
        left="scenario",
    )
    for s in result.scenarios:
        t.add_row(*_matrix_row(s))
    console.print(t)
    order = ", ".join(f"{i + 1} {k}" for i, (k, _) in enumerate(result.scenarios[0].targets.items()))
    console.print(f"[dim]targets column: passed/evaluated, then P(ASS)/M(ISS)/-(n/a) per target in this order: {order}[/]")
    for sk in result.skipped:
        what = f"{short_size(sk.size)}, " if sk.size else ""
        console.print(f"[yellow]skipped {what}{sk.hosts} hosts, R={sk.replicas}: {sk.reason}[/]")
