"""What a run measures once on the headline's state, on stores of its own (issue 16): the saves from the first one with
memory pre-faulted (MEMSTORE_PREFAULT = (keep+2)x the state, when --prefault is not given), and the path without shared
memory (a trainer whose store is in another pod or host)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from memstore.bench.cluster import Stores, start_stores, wait_stores_idle
from memstore.bench.first_save_results import NoShmRun, SaveSeries, prefault_for, series_label
from memstore.bench.results import Summary
from memstore.bench.scenario_results import Endpoints
from memstore.bench.series import SeriesSpec, save_series
from memstore.bench.state import nbytes_of, state_fingerprint, state_tensors

if TYPE_CHECKING:
    from memstore.bench.options import BenchConfig
    from memstore.bench.plan import Scenario
    from memstore.bench.sysinfo import Monitor

PREFAULT_STEADY_SAVES = 3  # steady-state saves of the pre-faulted series (the headline's own series has --saves)
NO_SHM_SAVES = 3  # saves after the first on the path without shared memory


def prefault_supported() -> bool:
    """Whether the stores of this checkout know --prefault (MEMSTORE_PREFAULT); a store that does not ignores the variable."""
    from memstore.config import StoreConfig

    return any(f.name == "prefault" for f in fields(StoreConfig))


def _floor_dst(nbytes: int) -> Any:
    import torch

    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.fill_(1)  # pre-faulted, like the buffer of the paired memcpy of the headline's saves
    return dst


def measure_prefault_series(
    config: BenchConfig, scn: Scenario, state: Any, shard_bytes: int, command: str, step_done: Callable[[str], None], monitor: Monitor,
) -> SaveSeries:  # fmt: skip
    """Saves 1..N of a fresh job on fresh stores started with MEMSTORE_PREFAULT = (keep+2)x the state; a failure is recorded."""
    from trainer_client import CheckpointClient

    value = prefault_for(shard_bytes, config.keep)
    monitor.phase = f"{scn.name}: saves, --prefault {value}"
    tensors = state_tensors(state)
    state_bytes = nbytes_of(tensors)
    series = SaveSeries(
        label=series_label(value, shard_bytes, config.keep), prefault=value, command=command, store_command="", job="bench-prefault",
        hosts=scn.hosts, replicas=scn.replicas, state_bytes=state_bytes, shard_bytes=shard_bytes, cluster_start_seconds=0.0,
        stores_idle_wait_seconds=0.0, saves=[],
    )  # fmt: skip
    stores: Stores | None = None
    dst = _floor_dst(state_bytes)
    try:
        t0 = time.perf_counter()
        stores = start_stores(config, scn.hosts, scn.replicas, shard_bytes, None, job=series.job, prefault=value)
        series.cluster_start_seconds = time.perf_counter() - t0
        series.store_command = stores.command()
        series.stores_idle_wait_seconds = wait_stores_idle(stores)
        errors: list[str] = []
        count = 1 + config.warmup + min(scn.saves, PREFAULT_STEADY_SAVES)
        with CheckpointClient(series.job, 0, 1, store=stores.address(stores.hosts[0])) as client:
            spec = SeriesSpec(state, tensors, state_bytes, shard_bytes, count, config.keep, paired=dst)
            series.saves = save_series(client, spec, stores, errors, lambda i: step_done(f"{scn.name}: --prefault {value}: save {i + 1}"))
        if errors:
            series.error = "; ".join(errors)
    except Exception as exc:  # e.g. the stores reject the setting: the run goes on without this series
        if stores is not None:
            stores.dump_logs()
        series.error = repr(exc)
    finally:
        if stores is not None:
            stores.stop()
        del dst
        gc.collect()
    return series


def _loads(job: str, address: str, reps: int, fingerprint: str) -> tuple[list[float], bool]:
    """A new client in this process per load (connect + load(), streamed into fresh memory), ``reps`` times."""
    from trainer_client import CheckpointClient

    times: list[float] = []
    same = True
    for _ in range(reps):
        t0 = time.perf_counter()
        client = CheckpointClient(job, 0, 1, store=address, use_shared_memory=False)
        loaded = client.load()
        times.append(time.perf_counter() - t0)
        client.close()
        same = same and state_fingerprint(loaded) == fingerprint
        del loaded
        gc.collect()
    return times, same


def measure_no_shm(
    config: BenchConfig, scn: Scenario, state: Any, fingerprint: str, shard_bytes: int, endpoints: Endpoints | None, command: str,
    step_done: Callable[[str], None], monitor: Monitor,
) -> NoShmRun:  # fmt: skip
    """CheckpointClient(use_shared_memory=False) on fresh stores: save 1 and NO_SHM_SAVES more, then --restores loads."""
    from trainer_client import CheckpointClient

    monitor.phase = f"{scn.name}: without shared memory"
    tensors = state_tensors(state)
    state_bytes = nbytes_of(tensors)
    stores = start_stores(config, scn.hosts, scn.replicas, shard_bytes, endpoints, job="bench-noshm")
    try:
        wait_stores_idle(stores)
        address = stores.address(stores.hosts[0])
        errors: list[str] = []
        with CheckpointClient(stores.job, 0, 1, store=address, use_shared_memory=False) as client:
            shared = client.shared_memory
            spec = SeriesSpec(state, tensors, state_bytes, shard_bytes, 1 + NO_SHM_SAVES, config.keep)
            saves = save_series(client, spec, stores, errors, lambda i: step_done(f"{scn.name}: without shared memory: save {i + 1}"))
        times, same = _loads(stores.job, address, scn.restores, fingerprint)
        step_done(f"{scn.name}: without shared memory: loads")
        return NoShmRun(
            command=command, store_command=stores.command(), job=stores.job, shared_memory=shared, state_bytes=state_bytes,
            shard_bytes=shard_bytes, saves=saves, load_seconds=Summary.of(times), verified_equal=same, errors=errors,
        )  # fmt: skip
    except BaseException:
        stores.dump_logs()
        raise
    finally:
        stores.stop()
