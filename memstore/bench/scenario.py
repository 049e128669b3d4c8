"""One measured scenario (state size x hosts x R) on its own stores: the saves (stall, time to committed,
replication), the stores' memory, then the restores (:mod:`memstore.bench.restores`)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memstore.bench import rpc
from memstore.bench.cluster import Stores, start_stores, wait_stores_idle
from memstore.bench.plan import Scenario, ram_need
from memstore.bench.restores import RestoreContext, RestorePhase, measure_restores
from memstore.bench.results import ScenarioConditions, Summary
from memstore.bench.scenario_results import (
    Endpoints,
    SaveSample,
    ScenarioMeasurement,
    StoreMemory,
    StoreMemoryEntry,
    StoreRatios,
)
from memstore.bench.series import STEADY, SeriesSpec, save_series
from memstore.bench.state import nbytes_of, state_tensors
from memstore.bench.sysinfo import CpuWindow, proc_memory
from memstore.bench.units import MiB, ratio

if TYPE_CHECKING:
    from memstore.bench.options import BenchConfig
    from memstore.bench.sysinfo import Monitor


def data_plane_name(flag: str | None, store_data_port: int) -> str:
    if store_data_port:
        return "raw TCP data channel" if flag != "grpc" else "gRPC streams"
    return "gRPC streams"


def measure_store_memory(stores: Stores) -> StoreMemory:
    """Per store: its process's RSS/PSS (when it is a local process) against the shard bytes it holds."""
    per: dict[str, StoreMemoryEntry] = {}
    holding: dict[str, StoreRatios] = {}
    for h in stores.hosts:
        held = rpc.held(stores.address(h))
        pid = stores.pid(h)
        mem = proc_memory(pid) if pid else None
        entry = StoreMemoryEntry(pid=pid, memory=mem, held=held)
        if mem and held and held.shard_bytes_held:
            entry.ratios = StoreRatios(
                rss_over_held=ratio(mem.rss, held.shard_bytes_held),
                rss_over_held_plus_pooled=ratio(mem.rss, held.shard_bytes_held + held.pooled_bytes_estimate),
                pss_over_held=ratio(mem.pss, held.shard_bytes_held),
            )
            if entry.ratios.rss_over_held is not None:
                holding[h] = entry.ratios
        per[h] = entry
    worst = max(holding, key=lambda h: holding[h].rss_over_held or 0.0) if holding else None
    pooled = [r.rss_over_held_plus_pooled for r in holding.values() if r.rss_over_held_plus_pooled is not None]
    return StoreMemory(
        stores=per,
        worst_host=worst,
        rss_over_held_max=holding[worst].rss_over_held if worst else None,
        rss_over_held_plus_pooled_max=max(pooled, default=None),
        available=bool(holding),
        note="" if holding else "no local store process to read (remote --endpoints) or no store holds shards",
    )


@dataclass
class SavePhase:
    """The saves of one scenario: the session's facts and every save's sample."""

    shared_memory: bool
    store_version: str
    store_data_port: int
    data_plane: str
    errors: list[str]
    samples: list[SaveSample]
    stores_idle_wait_seconds: float = 0.0


def measure_saves(
    config: BenchConfig, scn: Scenario, stores: Stores, state: Any, shard_bytes: int, step_done: Callable[[str], None], monitor: Monitor
) -> SavePhase:
    """Save 1 of a fresh job on the fresh stores, saves 2..keep+2, then ``scn.saves`` steady-state ones: each timed from
    the save() call, right after a paired memcpy of the same bytes. Nothing is saved before save 1."""
    import torch

    from trainer_client import CheckpointClient

    monitor.phase = f"{scn.name}: saves"
    tensors = state_tensors(state)
    errors: list[str] = []
    floor_dst = torch.empty(nbytes_of(tensors), dtype=torch.uint8)
    floor_dst.fill_(1)
    idle = wait_stores_idle(stores)
    client = CheckpointClient(stores.job, 0, 1, store=stores.address(stores.hosts[0]))
    try:
        data_port = int(getattr(client.hello, "data_port", 0))  # 0: replicas and pulls travel over gRPC
        total = 1 + config.warmup + scn.saves
        spec = SeriesSpec(state, tensors, nbytes_of(tensors), shard_bytes, total, config.keep, paired=floor_dst)

        def each(i: int) -> None:
            monitor.sample()
            step_done(f"{scn.name}: save {i + 1}/{total}")

        samples = save_series(client, spec, stores, errors, each)
        phase = SavePhase(
            client.shared_memory, client.hello.version, data_port, data_plane_name(config.data_plane, data_port), errors, samples, idle
        )
    finally:
        client.close()
        del floor_dst
        gc.collect()
    return phase


def _measurement(
    scn: Scenario, config: BenchConfig, stores: Stores, cluster_start: float, saves: SavePhase, store_memory: StoreMemory,
    restores: RestorePhase, store_memory_end: StoreMemory, conditions: ScenarioConditions,
) -> ScenarioMeasurement:  # fmt: skip
    """The scenario's figures from its phases (at least one measured save reached R copies: _check_committed)."""
    samples = saves.samples
    measured = [s for s in samples if s.phase == STEADY]
    committed = [s for s in measured if not s.error]
    return ScenarioMeasurement(
        name=scn.name,
        size=scn.size,
        hosts=scn.hosts,
        replicas=scn.replicas,
        saves_measured=scn.saves,
        restores=scn.restores,
        headline=scn.headline,
        ram_need=ram_need(scn.size, scn.replicas, scn.hosts, config.keep),
        cluster_start_seconds=cluster_start,
        local_cluster=stores.local,
        job=stores.job,
        shared_memory=saves.shared_memory,
        store_version=saves.store_version,
        store_data_port=saves.store_data_port,
        data_plane=saves.data_plane,
        errors=saves.errors,
        last_step=samples[-1].step,
        saves=samples,
        stall_seconds=Summary.of([s.save_wall_seconds for s in measured]),
        stall_inside_save_seconds=Summary.of([s.stall_seconds for s in measured]),
        paired_memcpy_seconds=Summary.of([s.paired_memcpy_seconds or 0.0 for s in measured]),
        failed_saves=sum(1 for s in samples if s.error),
        committed_seconds=Summary.of([s.committed_seconds for s in committed]),
        replication_seconds=Summary.of([s.replication_seconds for s in committed]),
        replication_bytes_per_second=Summary.of([s.replication_bytes_per_second for s in committed]),
        first_save=samples[0],
        cold_saves_stall_seconds=Summary.of([s.save_wall_seconds for s in samples if s.phase != STEADY]),
        store_memory=store_memory,
        restore_local=restores.restore_local,
        restore_local_copy=restores.restore_local_copy,
        peer_pull=restores.peer_pull,
        restore_peer_deleted=restores.restore_peer_deleted,
        restore_peer=restores.restore_peer,
        restore_peer_note=restores.restore_peer_note,
        restore_durable=restores.restore_durable,
        store_memory_end=store_memory_end,
        conditions=conditions,
        prefault=config.prefault,
        store_command=stores.command(),
        stores_idle_wait_seconds=saves.stores_idle_wait_seconds,
    )


def _check_committed(scn: Scenario, saves: SavePhase) -> None:
    measured = [s for s in saves.samples if s.phase == STEADY]
    if not any(not s.error for s in measured):
        raise RuntimeError(f"no measured save of {scn.name} reached R={scn.replicas} copies: {measured[-1].error}")


def measure_scenario(
    config: BenchConfig, scn: Scenario, state: Any, fingerprint: str, shard_bytes: int, endpoints: Endpoints | None,
    step_done: Callable[[str], None], monitor: Monitor,
) -> ScenarioMeasurement:  # fmt: skip
    name = scn.name
    cpu = CpuWindow()
    monitor.reset_window()
    monitor.phase = f"{name}: cluster start"
    t0 = time.perf_counter()
    stores = start_stores(config, scn.hosts, scn.replicas, shard_bytes, endpoints)
    cluster_start = time.perf_counter() - t0
    try:
        step_done(f"{name}: cluster started")
        saves = measure_saves(config, scn, stores, state, shard_bytes, step_done, monitor)
        _check_committed(scn, saves)
        monitor.phase = f"{name}: store memory"
        store_memory = measure_store_memory(stores)
        step_done(f"{name}: store memory")
        ctx = RestoreContext(
            name=name, stores=stores, owner=stores.hosts[0], restores=scn.restores, replicas=scn.replicas, keep=config.keep,
            shard_bytes=shard_bytes, fingerprint=fingerprint, timeout=120.0 + shard_bytes / (20 * MiB),
            last_step=saves.samples[-1].step, step_done=step_done, monitor=monitor,
        )  # fmt: skip
        restores = measure_restores(ctx)
        store_memory_end = measure_store_memory(stores)
    except BaseException:
        stores.dump_logs()
        raise
    finally:
        monitor.phase = f"{name}: stop"
        stores.stop()
    conditions = ScenarioConditions(**vars(cpu.report()), memory_peak_pss_bytes=monitor.window_peak_bytes)
    step_done(f"{name}: done")
    return _measurement(scn, config, stores, cluster_start, saves, store_memory, restores, store_memory_end, conditions)
