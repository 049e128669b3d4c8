"""Fixed costs (issue 16), measured once per run on the headline's cluster shape, fresh stores each: a save of a small
state (1 MiB, 16 MiB), and what each tensor of a state costs a save and a load (10,000 tensors of 4 KiB against one
tensor of the same bytes)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from memstore.bench import rpc
from memstore.bench.cluster import start_stores, wait_stores_idle
from memstore.bench.first_save_results import PerTensorRun, SmallState, TensorState
from memstore.bench.results import Summary
from memstore.bench.scenario_results import Endpoints
from memstore.bench.series import SeriesSpec, save_series
from memstore.bench.state import make_state, nbytes_of, state_tensors, states_equal
from memstore.bench.sysinfo import CpuWindow
from memstore.bench.units import short_size

if TYPE_CHECKING:
    from memstore.bench.cluster import Stores
    from memstore.bench.options import BenchConfig
    from memstore.bench.sysinfo import Monitor

TENSOR_COUNT = 10_000
TENSOR_ELEMENTS = 1024  # float32: 4 KiB per tensor
TENSOR_STEADY_SAVES = 10  # steady-state saves of each per-tensor state (the figure is their p50)
TENSOR_LOADS = 5


def measure_small_states(
    config: BenchConfig, sizes: tuple[int, ...], hosts: int, replicas: int, endpoints: Endpoints | None, command: str,
    step_done: Callable[[str], None], monitor: Monitor,
) -> list[SmallState]:  # fmt: skip
    """Per size: fresh stores and job, save 1 and ``config.small_saves`` more, each paired with a memcpy."""
    import torch

    from trainer_client import CheckpointClient, serialization

    out: list[SmallState] = []
    for size in sizes:
        label = short_size(size)
        monitor.phase = f"small state {label}"
        state = make_state(size, config.seed)
        tensors = state_tensors(state)
        state_bytes = nbytes_of(tensors)
        shard_bytes = serialization.plan(state).nbytes
        dst = torch.empty(state_bytes, dtype=torch.uint8)
        dst.fill_(1)
        cpu = CpuWindow()
        t0 = time.perf_counter()
        stores = start_stores(config, hosts, replicas, shard_bytes, endpoints, job=f"bench-small-{label}")
        start = time.perf_counter() - t0
        try:
            wait_stores_idle(stores)
            errors: list[str] = []
            with CheckpointClient(stores.job, 0, 1, store=stores.address(stores.hosts[0])) as client:
                spec = SeriesSpec(state, tensors, state_bytes, shard_bytes, 1 + config.small_saves, config.keep, paired=dst)
                saves = save_series(client, spec, stores, errors)
            small = SmallState(
                size=size, tensors=len(tensors), state_bytes=state_bytes, shard_bytes=shard_bytes, command=command,
                store_command=stores.command(), job=stores.job, cluster_start_seconds=start, saves=saves,
                conditions=cpu.report(), errors=errors,
            )  # fmt: skip
            out.append(small)
        except BaseException:
            stores.dump_logs()
            raise
        finally:
            stores.stop()
        step_done(f"small state {label}: {1 + config.small_saves} saves")
    return out


def tensor_states(count: int, elements: int, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``count`` float32 tensors of ``elements`` each, and one float32 tensor of the same bytes."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    many = {f"layer{i:05d}.weight": torch.rand(elements, generator=gen) for i in range(count)}
    one = {"flat.weight": torch.rand(count * elements, generator=gen)}
    return many, one


def _save_and_time(
    client: Any, stores: Stores, state: Any, layout: str, shard_bytes: int, count: int, keep: int, errors: list[str]
) -> TensorState:
    tensors = state_tensors(state)
    spec = SeriesSpec(state, tensors, nbytes_of(tensors), shard_bytes, count, keep)
    saves = save_series(client, spec, stores, errors)
    return TensorState(
        layout=layout, tensors=len(tensors), state_bytes=spec.state_bytes, shard_bytes=shard_bytes, job=client.job_id, saves=saves,
        load_seconds=Summary.of([0.0]), verified_equal=True,
    )  # fmt: skip


def _timed_load(client: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    loaded = client.load()
    return time.perf_counter() - t0, loaded


def measure_per_tensor(
    config: BenchConfig, hosts: int, replicas: int, endpoints: Endpoints | None, command: str, step_done: Callable[[str], None],
    monitor: Monitor,
) -> PerTensorRun:  # fmt: skip
    """Both states on one fresh cluster, a job each: save 1, saves 2..keep+2 and TENSOR_STEADY_SAVES more, then
    TENSOR_LOADS loads of each (in this process, zero-copy, alternating between the two)."""
    from trainer_client import CheckpointClient, serialization

    monitor.phase = "per-tensor cost"
    many, one = tensor_states(TENSOR_COUNT, TENSOR_ELEMENTS, config.seed)
    shard_bytes = max(serialization.plan(many).nbytes, serialization.plan(one).nbytes)
    stores = start_stores(config, hosts, replicas, shard_bytes, endpoints, job="bench-tensors", capacity_shards=2 * (config.keep + 1))
    count = 1 + config.warmup + min(config.small_saves, TENSOR_STEADY_SAVES)
    errors: list[str] = []
    try:
        wait_stores_idle(stores)
        address = stores.address(stores.hosts[0])
        layouts = {
            "many": (many, f"{TENSOR_COUNT} x float32[{TENSOR_ELEMENTS}]"),
            "one": (one, f"1 x float32[{TENSOR_COUNT * TENSOR_ELEMENTS}]"),
        }
        clients = {k: CheckpointClient(f"{stores.job}-{k}", 0, 1, store=address) for k in layouts}
        try:
            result: dict[str, TensorState] = {}
            for k, (state, layout) in layouts.items():
                result[k] = _save_and_time(clients[k], stores, state, layout, serialization.plan(state).nbytes, count, config.keep, errors)
                step_done(f"per-tensor cost: {count} saves of {layout}")
            loads: dict[str, list[float]] = {k: [] for k in layouts}
            for _ in range(TENSOR_LOADS):
                for k in layouts:
                    seconds, loaded = _timed_load(clients[k])
                    loads[k].append(seconds)
                    result[k].verified_equal = result[k].verified_equal and states_equal(layouts[k][0], loaded)
                    del loaded
                    gc.collect()
            for k in layouts:
                result[k].load_seconds = Summary.of(loads[k])
            step_done("per-tensor cost: loads")
        finally:
            for c in clients.values():
                c.close()
                if not stores.local:  # an --endpoints cluster: leave nothing of the bench's jobs behind
                    for a in stores.addresses():
                        rpc.delete(a, c.job_id)
    except BaseException:
        stores.dump_logs()
        raise
    finally:
        stores.stop()
    return PerTensorRun(
        count=TENSOR_COUNT, tensor_bytes=4 * TENSOR_ELEMENTS, command=command, store_command=stores.command(), many=result["many"],
        one=result["one"], errors=errors,
    )  # fmt: skip
