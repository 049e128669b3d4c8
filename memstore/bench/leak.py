"""The leak check: RSS of the stores and of a saving process over many consecutive saves."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from memstore.bench.child import Child
from memstore.bench.cluster import start_stores
from memstore.bench.jsonable import to_json
from memstore.bench.results import CpuReport, ProcMemory, Summary
from memstore.bench.scenario_results import Endpoints, Leak, LeakCheck, LeakProcess, LeakSample, LeakSkipped
from memstore.bench.sysinfo import CpuWindow
from memstore.bench.units import MiB, ratio
from memstore.bench.workers import LeakConfig

if TYPE_CHECKING:
    from memstore.bench.options import BenchConfig
    from memstore.bench.sysinfo import Monitor

REFERENCE_SAVE = 10  # RSS after this save is the reference (the pools are warm by then)


def _growth(series: list[ProcMemory | None], ref: int) -> LeakProcess | None:
    a, b = series[ref - 1], series[-1]
    if a is None or b is None or a.rss is None or b.rss is None:
        return None
    return LeakProcess(
        rss_after_save_ref=a.rss,
        rss_after_last_save=b.rss,
        growth_percent=(b.rss - a.rss) / a.rss * 100.0,
        rss_anon_growth_bytes=(b.rss_anon or 0) - (a.rss_anon or 0),
        rss_shmem_growth_bytes=(b.rss_shmem or 0) - (a.rss_shmem or 0),
        pss_growth_percent=ratio(((b.pss or 0) - (a.pss or 0)) * 100.0, a.pss),
        rss_series=[m.rss if m else None for m in series],
    )


def summarize_leak(config: BenchConfig, hosts: int, replicas: int, samples: list[LeakSample], conditions: CpuReport) -> LeakCheck:
    procs: dict[str, list[ProcMemory | None]] = {"client": [s.client for s in samples]}
    for h in samples[0].stores:
        procs[f"store {h}"] = [s.stores.get(h) for s in samples]
    result: dict[str, LeakProcess] = {}
    for label, series in procs.items():
        growth = _growth(series, REFERENCE_SAVE)
        if growth is not None:
            result[label] = growth
    worst = max(result, key=lambda k: result[k].growth_percent) if result else None
    return LeakCheck(
        size=config.leak_size,
        saves=config.leak_saves,
        hosts=hosts,
        replicas=replicas,
        reference_save=REFERENCE_SAVE,
        processes=result,
        max_growth_percent=result[worst].growth_percent if worst else None,
        worst=worst,
        stall_seconds=Summary.of([s.stall_seconds for s in samples]),
        copies=sorted({s.copies for s in samples}),
        failed_saves=[f"step {s.save}: {s.error}" for s in samples if s.error],
        stores_measured=bool(len(result) > 1),
        conditions=conditions,
    )


def measure_leak(
    config: BenchConfig, hosts: int, replicas: int, endpoints: Endpoints | None, step_done: Callable[[str], None], monitor: Monitor
) -> Leak:
    if config.leak_saves == 0:
        return LeakSkipped(skipped="--leak-saves 0")
    size = config.leak_size
    monitor.phase = "leak check"
    cpu = CpuWindow()
    stores = start_stores(config, hosts, replicas, size + MiB, endpoints)
    samples: list[LeakSample] = []
    try:
        cfg = LeakConfig(
            addresses=stores.addresses(),
            pids={h: stores.pid(h) for h in stores.hosts},
            job=stores.job,
            size=size,
            seed=config.seed,
            saves=config.leak_saves,
            keep=config.keep,
        )
        with Child("leak", "leak-check process") as child:
            child.send(to_json(cfg))
            child.read(timeout=120.0)
            per_save = 120.0 + size / (10 * MiB)
            for i in range(config.leak_saves):
                samples.append(LeakSample.from_json(child.read(timeout=per_save)))
                if (i + 1) % 10 == 0:
                    monitor.sample()
                step_done(f"leak check: save {i + 1}/{config.leak_saves}")
            child.read(timeout=60.0)
    except BaseException:
        stores.dump_logs()
        raise
    finally:
        stores.stop()
    return summarize_leak(config, hosts, replicas, samples, cpu.report())
