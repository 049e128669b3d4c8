"""Ratios of a scenario against the baselines of its state size, and the targets (PASS/MISS) they are held to: issue
16's (from the first save; :mod:`memstore.bench.target`) and the older ones of issue 3 that still apply.
Pure: :func:`evaluate` only reads typed results."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from memstore.bench.first_save import FirstSaveResult, no_shm_targets, series_figures
from memstore.bench.jsonable import OMIT_EMPTY
from memstore.bench.results import SizeResult
from memstore.bench.scenario_results import Leak, LeakSkipped, ScenarioMeasurement
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
from memstore.bench.units import ratio, short_size

__all__ = [
    "COMMITTED_TCP_MIN",
    "FIRST_SAVE_MEMCPY_MAX",
    "LATER_SAVES_MEMCPY_MAX",
    "NO_SHM_TCP_MIN",
    "PER_TENSOR_MAX_US",
    "SMALL_STATE_STALL_MAX",
    "STORE_RSS_MAX",
    "Ratios",
    "Target",
    "Targets",
    "evaluate",
]

HEADLINE_ONLY = "n/a: measured once per run, for the headline scenario"

# Targets (issue 3) that still apply, evaluated per scenario; the headline scenario is 1 GiB on one rank, 2 hosts, R=2.
STALL_MEMCPY_MAX = 1.5  # save() stall p50 (steady state) <= 1.5x torch copy_ into pre-faulted memory
STALL_DISK_MIN = 20.0  # torch.save + fsync >= 20x the stall
STALL_DCP_MAX = 0.2  # stall <= 1/5 of DCP async_save's blocking time
REPLICATION_MIN = 0.7  # replication throughput >= 0.7x raw TCP
PEER_RESTORE_TCP_MIN = 0.7  # restore from peer RAM >= 0.7x raw TCP throughput
PEER_RESTORE_LOAD_MIN = 3.0  # ... and >= 3x faster than torch.load
LOCAL_RESTORE_LOAD_MIN = 10.0  # restore from local RAM after a trainer crash >= 10x faster than torch.load
LEAK_MAX_PERCENT = 5.0  # < 5% RSS growth over the leak-check saves


@dataclass
class Ratios:
    """memstore over its baselines (or the inverse, as named); None where a part was not measured."""

    first_save_stall_over_memcpy: float | None  # save 1 of a fresh job on fresh stores, over its paired memcpy
    later_saves_stall_over_memcpy_max: float | None  # the worst of saves 2..N
    first_save_committed_over_raw_tcp: float | None  # state bytes / (save() call -> committed), over raw TCP
    committed_over_raw_tcp_min: float | None  # the worst save (0 for a save that did not reach R copies)
    stall_p50_over_memcpy: float | None
    stall_p95_over_memcpy: float | None
    stall_p50_over_memcpy_standalone: float | None
    stall_p50_over_shm_memcpy: float | None
    first_save_over_memcpy_fresh: float | None
    stall_p50_over_torch_save_fsync: float | None
    torch_save_fsync_over_stall_p50: float | None
    stall_p50_over_dcp_async_blocking: float | None
    stall_p50_over_dcp_async_blocking_reused_stager: float | None
    committed_p50_over_dcp_async_total: float | None
    committed_p50_over_torch_save_fsync: float | None
    replication_over_raw_tcp: float | None
    replication_over_grpc_bytes: float | None
    replication_over_grpc_protobuf: float | None
    grpc_bytes_over_raw_tcp: float | None
    grpc_protobuf_over_raw_tcp: float | None
    torch_load_warm_over_restore_local: float | None
    torch_load_cold_over_restore_local: float | None
    torch_load_warm_over_restore_local_copy: float | None
    restore_peer_over_raw_tcp: float | None
    torch_load_warm_over_restore_peer: float | None
    torch_load_cold_over_restore_peer: float | None
    restore_peer_deleted_over_raw_tcp: float | None
    torch_load_warm_over_restore_peer_deleted: float | None
    peer_pull_over_raw_tcp: float | None
    restore_durable_over_raw_tcp: float | None
    torch_load_warm_over_restore_durable: float | None
    torch_load_cold_over_restore_durable: float | None
    store_rss_over_held_max: float | None
    store_rss_over_held_plus_pooled_max: float | None
    # ratio name -> why its baseline was not measured (a DCP staging this torch cannot do): those ratios are n/a, not 0
    unavailable: dict[str, str] = field(default_factory=dict, metadata=OMIT_EMPTY)


@dataclass
class Targets:
    """Issue 16's targets first (from the first save), then the older ones that still apply."""

    first_save_stall_vs_memcpy: Target
    later_saves_stall_vs_memcpy: Target
    committed_vs_raw_tcp_every_save: Target
    small_state_stall: Target
    per_tensor_save_stall: Target
    per_tensor_load: Target
    no_shm_save_vs_raw_tcp: Target
    no_shm_committed_vs_raw_tcp: Target
    no_shm_load_vs_raw_tcp: Target
    restore_local_vs_torch_load: Target
    restore_peer_vs_raw_tcp: Target
    store_rss_vs_held: Target
    stall_vs_memcpy: Target
    stall_vs_torch_save_fsync: Target
    stall_vs_dcp_async_save: Target
    replication_vs_raw_tcp: Target
    restore_peer_vs_torch_load: Target
    rss_growth_over_saves: Target

    def items(self) -> list[tuple[str, Target]]:
        return [(f.name, getattr(self, f.name)) for f in fields(self)]

    def values(self) -> list[Target]:
        return [t for _, t in self.items()]

    @property
    def passed(self) -> int:
        return sum(1 for t in self.values() if t.passed is True)

    @property
    def missed(self) -> int:
        return sum(1 for t in self.values() if t.passed is False)


@dataclass
class _PeerFigures:
    """The peer restore the targets use: after a host loss, else (--endpoints) with the owner's copy deleted."""

    deleted: float | None
    host_loss: float | None

    @property
    def seconds(self) -> float | None:
        return self.host_loss if self.host_loss is not None else self.deleted

    @property
    def what(self) -> str:
        if self.host_loss is None and self.deleted is not None:
            return "with the owner's copy deleted (no host loss possible with --endpoints)"
        return "after a host loss (the first restore after the replacement, timed from the trainer's load call in a new process)"


def _peer(scn: ScenarioMeasurement) -> _PeerFigures:
    return _PeerFigures(
        deleted=scn.restore_peer_deleted.seconds.p50 if scn.restore_peer_deleted else None,
        host_loss=scn.restore_peer.seconds.p50 if scn.restore_peer else None,
    )


def _first_save_ratios(scn: ScenarioMeasurement, info: SizeResult) -> dict[str, float | None]:
    fig = series_figures(scn.saves, info.floors.tcp.bytes_per_second.p50)
    return {
        "first_save_stall_over_memcpy": fig.first.stall_over_memcpy_max if fig.first else None,
        "later_saves_stall_over_memcpy_max": fig.later_stall_over_memcpy_max,
        "first_save_committed_over_raw_tcp": fig.first.committed_over_raw_tcp_min if fig.first else None,
        "committed_over_raw_tcp_min": fig.committed_over_raw_tcp_min,
    }


def _stall_ratios(scn: ScenarioMeasurement, info: SizeResult) -> dict[str, float | None]:
    memcpy, disk, dcp = info.floors.memcpy, info.floors.disk, info.floors.dcp
    stall = scn.stall_seconds.p50
    paired = scn.paired_memcpy_seconds.p50
    return {
        "stall_p50_over_memcpy": ratio(stall, paired),
        "stall_p95_over_memcpy": ratio(scn.stall_seconds.p95, paired),
        "stall_p50_over_memcpy_standalone": ratio(stall, memcpy.torch_copy_seconds.p50),
        "stall_p50_over_shm_memcpy": ratio(stall, memcpy.shm_torch_copy_seconds.p50 if memcpy.shm_torch_copy_seconds else None),
        "first_save_over_memcpy_fresh": ratio(scn.first_save.save_wall_seconds, memcpy.torch_copy_fresh_seconds.p50),
        "stall_p50_over_torch_save_fsync": ratio(stall, disk.save_fsync_seconds),
        "torch_save_fsync_over_stall_p50": ratio(disk.save_fsync_seconds, stall),
        "stall_p50_over_dcp_async_blocking": ratio(stall, dcp.default.blocking_p50),
        "stall_p50_over_dcp_async_blocking_reused_stager": ratio(stall, dcp.reused_stager.blocking_p50),
        "committed_p50_over_dcp_async_total": ratio(scn.committed_seconds.p50, dcp.default.total_p50),
        "committed_p50_over_torch_save_fsync": ratio(scn.committed_seconds.p50, disk.save_fsync_seconds),
    }


def _transfer_ratios(scn: ScenarioMeasurement, info: SizeResult) -> dict[str, float | None]:
    fl = info.floors
    nb = info.state.shard_bytes
    tcp_bps = fl.tcp.bytes_per_second.p50
    repl_bps = scn.replication_bytes_per_second.p50 if scn.replicas >= 2 else None
    load_warm, load_cold = fl.disk.load_warm_seconds.p50, fl.disk.load_cold_seconds.p50
    local, local_copy = scn.restore_local.seconds.p50, scn.restore_local_copy.seconds.p50
    peer = _peer(scn)
    peer_bps = nb / peer.seconds if peer.seconds else None
    pull_bps = scn.peer_pull.bytes_per_second.p50 if scn.peer_pull else None
    return {
        "replication_over_raw_tcp": ratio(repl_bps, tcp_bps),
        "replication_over_grpc_bytes": ratio(repl_bps, fl.grpc_bytes.bytes_per_second.p50),
        "replication_over_grpc_protobuf": ratio(repl_bps, fl.grpc_protobuf.bytes_per_second.p50),
        "grpc_bytes_over_raw_tcp": ratio(fl.grpc_bytes.bytes_per_second.p50, tcp_bps),
        "grpc_protobuf_over_raw_tcp": ratio(fl.grpc_protobuf.bytes_per_second.p50, tcp_bps),
        "torch_load_warm_over_restore_local": ratio(load_warm, local),
        "torch_load_cold_over_restore_local": ratio(load_cold, local),
        "torch_load_warm_over_restore_local_copy": ratio(load_warm, local_copy),
        "restore_peer_over_raw_tcp": ratio(peer_bps, tcp_bps),
        "torch_load_warm_over_restore_peer": ratio(load_warm, peer.seconds),
        "torch_load_cold_over_restore_peer": ratio(load_cold, peer.seconds),
        "restore_peer_deleted_over_raw_tcp": ratio(nb / peer.deleted if peer.deleted else None, tcp_bps),
        "torch_load_warm_over_restore_peer_deleted": ratio(load_warm, peer.deleted),
        "peer_pull_over_raw_tcp": ratio(pull_bps, tcp_bps),
    }


def _durable_ratios(scn: ScenarioMeasurement, info: SizeResult) -> dict[str, float | None]:
    fl = info.floors
    d = scn.restore_durable.restore
    seconds = d.seconds.p50 if d else None
    return {
        "restore_durable_over_raw_tcp": ratio(info.state.shard_bytes / seconds if seconds else None, fl.tcp.bytes_per_second.p50),
        "torch_load_warm_over_restore_durable": ratio(fl.disk.load_warm_seconds.p50, seconds),
        "torch_load_cold_over_restore_durable": ratio(fl.disk.load_cold_seconds.p50, seconds),
    }


def _unavailable_ratios(info: SizeResult) -> dict[str, str]:
    """The ratios over a DCP staging this torch could not measure, with the reason (the mode's ``unavailable``)."""
    dcp = info.floors.dcp
    needs = {
        "stall_p50_over_dcp_async_blocking": dcp.default,
        "stall_p50_over_dcp_async_blocking_reused_stager": dcp.reused_stager,
        "committed_p50_over_dcp_async_total": dcp.default,
    }
    return {k: mode.unavailable for k, mode in needs.items() if mode.unavailable}


def _na_dcp(reason: str | None) -> str:
    return f"n/a: DCP async_save (default staging) {reason}" if reason else ""


def compute_ratios(scn: ScenarioMeasurement, info: SizeResult) -> Ratios:
    mem = scn.store_memory
    return Ratios(
        **_first_save_ratios(scn, info),
        **_stall_ratios(scn, info),
        **_transfer_ratios(scn, info),
        **_durable_ratios(scn, info),
        store_rss_over_held_max=mem.rss_over_held_max,
        store_rss_over_held_plus_pooled_max=mem.rss_over_held_plus_pooled_max,
        unavailable=_unavailable_ratios(info),
    )


def _leak_target(leak: Leak) -> Target:
    if isinstance(leak, LeakSkipped):
        text = f"RSS growth < {LEAK_MAX_PERCENT:.0f}% from save 10 to save - (stores and client; - state, - hosts, R=-; percent)"
        return Target.check(text, None, lambda v: v < LEAK_MAX_PERCENT, leak.skipped)
    text = (
        f"RSS growth < {LEAK_MAX_PERCENT:.0f}% from save {leak.reference_save} to save {leak.saves} "
        f"(stores and client; {short_size(leak.size) if leak.size else '-'} state, {leak.hosts} hosts, R={leak.replicas}; percent)"
    )
    return Target.check(text, leak.max_growth_percent, lambda v: v < LEAK_MAX_PERCENT)


def _first_save_targets(scn: ScenarioMeasurement, info: SizeResult) -> dict[str, Target]:
    t = series_figures(scn.saves, info.floors.tcp.bytes_per_second.p50).targets
    return dict(t.items())


def _headline_targets(first: FirstSaveResult | None) -> dict[str, Target]:
    """The figures measured once per run (small states, per tensor, without shared memory): the headline's only."""
    size = short_size(SMALL_STATE_TARGET_SIZE)
    small_text = f"a save of a {size} state: stall p50 <= {SMALL_STATE_STALL_MAX * 1000:.0f} ms (fixed cost per save; seconds)"
    save_text = f"per-tensor cost of save() stall, (10,000 x 4 KiB - 1 tensor of the same bytes) / 10,000 <= {PER_TENSOR_MAX_US:.0f} us"
    load_text = f"per-tensor cost of load(), (10,000 x 4 KiB - 1 tensor of the same bytes) / 10,000 <= {PER_TENSOR_MAX_US:.0f} us"
    if first is None:
        no_shm = no_shm_targets(None, HEADLINE_ONLY)
        small, per_save, per_load = (Target.na(x, HEADLINE_ONLY) for x in (small_text, save_text, load_text))
    else:
        no_shm = no_shm_targets(first.no_shared_memory, "; ".join(first.notes) or "not measured")
        small_r = next((r for r in first.small_states if r.measured.size == SMALL_STATE_TARGET_SIZE), None)
        note = "" if small_r or first.small_states else "not measured (--small-saves 0)"
        small = Target.check(small_text, small_r.stall_seconds.p50 if small_r else None, lambda v: v <= SMALL_STATE_STALL_MAX, note)
        pt = first.per_tensor
        pt_note = "" if pt else "not measured (--small-saves 0)"
        per_save = Target.check(save_text, pt.save_stall_us_per_tensor if pt else None, lambda v: v <= PER_TENSOR_MAX_US, pt_note)
        per_load = Target.check(load_text, pt.load_us_per_tensor if pt else None, lambda v: v <= PER_TENSOR_MAX_US, pt_note)
    return {
        "small_state_stall": small,
        "per_tensor_save_stall": per_save,
        "per_tensor_load": per_load,
        "no_shm_save_vs_raw_tcp": no_shm[0],
        "no_shm_committed_vs_raw_tcp": no_shm[1],
        "no_shm_load_vs_raw_tcp": no_shm[2],
    }


def compute_targets(
    scn: ScenarioMeasurement, info: SizeResult, ratios: Ratios, leak: Leak, first: FirstSaveResult | None = None
) -> Targets:
    r1 = scn.replicas < 2
    no_peer = "n/a: R=1 keeps no peer copy" if r1 else ""
    peer_what = _peer(scn).what
    return Targets(
        **_first_save_targets(scn, info),
        **_headline_targets(first),
        restore_local_vs_torch_load=Target.check(
            f"restore from local RAM after a trainer crash (new process, zero-copy) >= {LOCAL_RESTORE_LOAD_MIN:.0f}x faster than "
            "torch.load (page cache warm)", ratios.torch_load_warm_over_restore_local, lambda v: v >= LOCAL_RESTORE_LOAD_MIN,
        ),
        restore_peer_vs_raw_tcp=Target.check(
            f"restore from peer RAM {peer_what} >= {PEER_RESTORE_TCP_MIN}x raw TCP throughput", ratios.restore_peer_over_raw_tcp,
            lambda v: v >= PEER_RESTORE_TCP_MIN, no_peer,
        ),
        store_rss_vs_held=Target.check(
            f"store RSS <= {STORE_RSS_MAX}x the shard bytes it holds plus its pool (used_bytes: pooled and pre-faulted segments; "
            "worst store holding shards)", ratios.store_rss_over_held_plus_pooled_max, lambda v: v <= STORE_RSS_MAX,
            scn.store_memory.note,
        ),
        stall_vs_memcpy=Target.check(
            f"save() stall p50, steady state, <= {STALL_MEMCPY_MAX}x torch copy_ of the same bytes into pre-faulted memory (paired p50)",
            ratios.stall_p50_over_memcpy, lambda v: v <= STALL_MEMCPY_MAX,
        ),
        stall_vs_torch_save_fsync=Target.check(
            f"save() stall p50 >= {STALL_DISK_MIN:.0f}x lower than torch.save + fsync", ratios.torch_save_fsync_over_stall_p50,
            lambda v: v >= STALL_DISK_MIN,
        ),
        stall_vs_dcp_async_save=Target.check(
            f"save() stall p50 <= 1/{1 / STALL_DCP_MAX:.0f} of DCP async_save's blocking time (default staging)",
            ratios.stall_p50_over_dcp_async_blocking, lambda v: v <= STALL_DCP_MAX,
            _na_dcp(ratios.unavailable.get("stall_p50_over_dcp_async_blocking")),
        ),
        replication_vs_raw_tcp=Target.check(
            f"replication throughput p50 >= {REPLICATION_MIN}x raw TCP on loopback", ratios.replication_over_raw_tcp,
            lambda v: v >= REPLICATION_MIN, "n/a: R=1 replicates nothing" if r1 else "",
        ),
        restore_peer_vs_torch_load=Target.check(
            f"restore from peer RAM {peer_what} >= {PEER_RESTORE_LOAD_MIN:.0f}x faster than torch.load (page cache warm)",
            ratios.torch_load_warm_over_restore_peer, lambda v: v >= PEER_RESTORE_LOAD_MIN, no_peer,
        ),
        rss_growth_over_saves=_leak_target(leak),
    )  # fmt: skip


def evaluate(scn: ScenarioMeasurement, info: SizeResult, leak: Leak, first: FirstSaveResult | None = None) -> tuple[Ratios, Targets]:
    """Ratios and targets (PASS/MISS) of one scenario against the baselines of its state size; ``first``: the figures
    measured once per run, for the headline scenario (None for the others: their targets are n/a)."""
    ratios = compute_ratios(scn, info)
    return ratios, compute_targets(scn, info, ratios, leak, first)
