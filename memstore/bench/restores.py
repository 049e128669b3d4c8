"""The restores of one scenario, each in a NEW process: from local RAM after a trainer crash, from peer RAM
(the store's pull alone, the owner's copy deleted, and after a host loss: the owner store SIGKILLed and replaced).
The restore from durable storage, measured once per run on stores of its own, is :mod:`memstore.bench.durable`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memstore.bench import rpc
from memstore.bench.child import restore_in_new_process
from memstore.bench.cluster import Stores, caught_up, pull_notes, serving_unix, wait
from memstore.bench.results import Summary
from memstore.bench.scenario_results import DurableRestore, HostLoss, PeerPull, PullRun, RestoreRun, RestoreSummary

if TYPE_CHECKING:
    from memstore.bench.sysinfo import Monitor

HOST_LOSS_SKIPPED = (
    "host loss skipped: with --endpoints the stores are not processes of this bench, so it cannot kill and "
    "replace one; the peer-restore targets use the restore with the owner's copy deleted instead"
)
R1_NOTE = "R=1: no peer holds a copy, so a lost host's state is not restorable from RAM"


@dataclass
class RestoreContext:
    """One scenario's restores: the stores, the owner (the rank's store, h0) and how to report progress."""

    name: str
    stores: Stores
    owner: str
    restores: int
    replicas: int
    keep: int
    shard_bytes: int
    fingerprint: str
    timeout: float
    last_step: int
    step_done: Callable[[str], None]
    monitor: Monitor

    @property
    def owner_addr(self) -> str:
        return self.stores.address(self.owner)

    @property
    def job(self) -> str:
        return self.stores.job


@dataclass
class RestorePhase:
    restore_local: RestoreSummary
    restore_local_copy: RestoreSummary
    peer_pull: PeerPull | None
    restore_peer_deleted: RestoreSummary | None
    restore_peer: RestoreSummary | None
    restore_peer_note: str | None
    restore_durable: DurableRestore


def restore_summary(runs: list[RestoreRun], fingerprint: str, timed: str = "connect_load_seconds") -> RestoreSummary:
    for r in runs:
        r.verified_equal = r.fingerprint == fingerprint
    return RestoreSummary(
        seconds=Summary.of([r.seconds(timed) for r in runs]),
        timed=timed,
        load_seconds=Summary.of([r.report.load_seconds for r in runs]),
        connect_seconds=Summary.of([r.report.connect_seconds for r in runs]),
        source_hosts=sorted({r.report.source_host for r in runs}),
        verified_equal=all(r.verified_equal for r in runs),
        runs=runs,
    )


def restore_local(ctx: RestoreContext) -> tuple[RestoreSummary, RestoreSummary]:
    """A new process on the owner's store, zero-copy (``restores`` times), then once with zero_copy=False."""
    ctx.monitor.phase = f"{ctx.name}: restore local"
    runs = []
    for i in range(ctx.restores):
        runs.append(restore_in_new_process(ctx.owner_addr, ctx.job, True, ctx.timeout))
        ctx.monitor.sample()
        ctx.step_done(f"{ctx.name}: restore from local RAM, new process {i + 1}/{ctx.restores}")
    local = restore_summary(runs, ctx.fingerprint)
    r = restore_in_new_process(ctx.owner_addr, ctx.job, False, ctx.timeout)
    ctx.monitor.sample()
    local_copy = restore_summary([r], ctx.fingerprint)
    ctx.step_done(f"{ctx.name}: restore from local RAM, zero_copy=False")
    return local, local_copy


def peer_pull(ctx: RestoreContext) -> PeerPull:
    """The store's pull alone: delete the owner's copy, time its Fetch RPC."""
    ctx.monitor.phase = f"{ctx.name}: peer pull"
    pulls: list[PullRun] = []
    for i in range(ctx.restores):
        deleted = rpc.delete(ctx.owner_addr, ctx.job, ctx.last_step)
        seconds, source = rpc.fetch(ctx.owner_addr, ctx.job, ctx.last_step, ctx.timeout)
        pulls.append(PullRun(seconds=seconds, source_host=source, deleted_on_owner=deleted, bytes_per_second=ctx.shard_bytes / seconds))
        ctx.step_done(f"{ctx.name}: pull from peer RAM (Fetch RPC) {i + 1}/{ctx.restores}")
    return PeerPull(
        seconds=Summary.of([p.seconds for p in pulls]),
        bytes_per_second=Summary.of([p.bytes_per_second for p in pulls]),
        source_hosts=sorted({p.source_host for p in pulls}),
        runs=pulls,
    )


def restore_peer_deleted(ctx: RestoreContext) -> RestoreSummary:
    """Restore from peer RAM, owner store up but its copy gone: a new process."""
    ctx.monitor.phase = f"{ctx.name}: restore peer (copy deleted)"
    runs = []
    for i in range(ctx.restores):
        r = restore_in_new_process(
            ctx.owner_addr, ctx.job, True, ctx.timeout, before=lambda: rpc.delete(ctx.owner_addr, ctx.job, ctx.last_step)
        )
        runs.append(r)
        ctx.monitor.sample()
        ctx.step_done(f"{ctx.name}: restore from peer RAM, owner's copy deleted {i + 1}/{ctx.restores}")
    return restore_summary(runs, ctx.fingerprint)


def _host_loss_once(ctx: RestoreContext) -> RestoreRun:
    stores, owner = ctx.stores, ctx.owner
    wait(lambda: caught_up(stores, owner, ctx.keep), ctx.timeout, 0.05, f"{owner} to hold the newest steps")
    timing: dict[str, float] = {}

    def replace_owner() -> None:
        timing["start_unix"] = time.time()
        t = time.perf_counter()
        stores.restart(owner)
        timing["restart_seconds"] = time.perf_counter() - t

    r = restore_in_new_process(ctx.owner_addr, ctx.job, True, ctx.timeout, before=lambda: stores.kill(owner), during=replace_owner)
    # The replacement's port accepts TCP connections as soon as gRPC binds it, before the store has
    # wiped the dead store's segments and serves; its 'serving on' log line marks when it serves (and
    # its startup repair pass begins), so the figure is timed from that line.
    serving = serving_unix(stores.log_text(owner))
    serving_to_loaded = r.report.loaded_unix - serving if serving else None
    port_open = r.report.loaded_unix - r.report.accept_unix
    wait(lambda: caught_up(stores, owner, ctx.keep), ctx.timeout, 0.05, f"the replacement {owner}'s repair pass")
    pulls = pull_notes(stores.log_text(owner))
    by_key: dict[str, set[str]] = {}
    for p in pulls:
        by_key.setdefault(p.key, set()).add(p.by)
    r.host_loss = HostLoss(
        restart_seconds=timing.get("restart_seconds"),
        serving_unix=serving,
        serving_to_loaded_seconds=serving_to_loaded,
        port_open_to_loaded_seconds=port_open,
        restore_seconds=serving_to_loaded or port_open,
        pulls=pulls,
        fetch_pulls=sum(1 for p in pulls if p.by == "fetch"),
        repair_pulls=sum(1 for p in pulls if p.by == "repair"),
        pulled_twice=sorted(k for k, who in by_key.items() if len(who) > 1),
        start_to_loaded_seconds=r.report.loaded_unix - timing["start_unix"] if "start_unix" in timing else None,
    )
    return r


def restore_after_host_loss(ctx: RestoreContext) -> RestoreSummary:
    """SIGKILL the owner store, start its replacement (empty RAM), restore in a new process meanwhile."""
    ctx.monitor.phase = f"{ctx.name}: restore after host loss"
    runs = []
    for i in range(ctx.restores):
        runs.append(_host_loss_once(ctx))
        ctx.monitor.sample()
        ctx.step_done(f"{ctx.name}: restore from peer RAM after host loss {i + 1}/{ctx.restores}")
    # Timed from the trainer's load call: the new process calls CheckpointClient() + load() as soon as the replacement's
    # port accepts (each run is the first restore after its replacement); serving -> loaded and the replacement's process
    # start -> loaded are in each run (restore_seconds, start_to_loaded_seconds).
    peer = restore_summary(runs, ctx.fingerprint)
    peer.bytes_per_second = ctx.shard_bytes / peer.seconds.p50
    peer.pulled_by = sorted({p.by for r in runs if r.host_loss for p in r.host_loss.pulls})
    return peer


def measure_restores(ctx: RestoreContext) -> RestorePhase:
    local, local_copy = restore_local(ctx)
    pull = deleted = peer = None
    note: str | None = None
    if ctx.replicas >= 2:
        pull = peer_pull(ctx)
        deleted = restore_peer_deleted(ctx)
        if ctx.stores.local:
            peer = restore_after_host_loss(ctx)
        else:
            note = HOST_LOSS_SKIPPED
            for i in range(ctx.restores):
                ctx.step_done(f"{ctx.name}: host loss skipped (--endpoints) {i + 1}/{ctx.restores}")
    else:
        note = R1_NOTE
        for i in range(3 * ctx.restores):
            ctx.step_done(f"{ctx.name}: restore from peer RAM skipped (R=1) {i + 1}")
    return RestorePhase(
        restore_local=local,
        restore_local_copy=local_copy,
        peer_pull=pull,
        restore_peer_deleted=deleted,
        restore_peer=peer,
        restore_peer_note=note,
        restore_durable=DurableRestore(),
    )
