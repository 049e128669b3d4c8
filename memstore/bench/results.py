"""Typed results of the measurements that do not need a cluster: summaries, the machine and its load,
process memory, the state, the baselines (floors) and the in-process cost model.

Every dataclass's field names are its JSON keys (see :mod:`memstore.bench.jsonable`); the scenario, leak-check
and run results are in :mod:`memstore.bench.scenario_results`. Pure: no torch, no processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memstore.bench.jsonable import OMIT_NONE
from memstore.bench.units import percentile


@dataclass
class Summary:
    """Repeated timings (or throughputs) of one measurement."""

    n: int
    min: float
    p50: float
    p95: float
    max: float
    values: list[float]

    @classmethod
    def of(cls, values: list[float]) -> Summary:
        return cls(n=len(values), min=min(values), p50=percentile(values, 50), p95=percentile(values, 95), max=max(values), values=values)


# -- the machine and its load ------------------------------------------------------------------------


@dataclass
class CpuPressure:
    """The 'some' line of /proc/pressure/cpu."""

    avg10: float
    avg60: float
    total_us: float


@dataclass
class CpuReport:
    """CPU conditions over a stretch of the run (memstore.bench.sysinfo.CpuWindow)."""

    seconds: float
    cpu_pressure_start: CpuPressure | None
    cpu_pressure_end: CpuPressure | None
    cpu_pressure_some_share: float | None
    loadavg_start: tuple[float, float, float] | None
    loadavg_end: tuple[float, float, float] | None
    bench_cpu_seconds: float
    other_cpu_seconds: float | None
    other_cpu_share_of_machine: float | None
    steal_seconds: float | None


@dataclass
class ScenarioConditions(CpuReport):
    memory_peak_pss_bytes: int = 0


@dataclass
class RunConditions:
    """The whole run's conditions (memstore.bench.sysinfo.Monitor)."""

    memory_peak_pss_bytes: int
    memory_peak_phase: str
    memory_samples: int
    cpu_pressure_start: CpuPressure | None
    cpu_pressure_end: CpuPressure | None
    cpu_pressure_some_share_during_run: float | None
    loadavg_start: tuple[float, float, float] | None
    loadavg_end: tuple[float, float, float] | None
    bench_cpu_seconds: float
    other_cpu_seconds: float | None
    other_cpu_share_of_machine: float | None
    steal_seconds: float | None


@dataclass
class MachineInfo:
    cpu_count: int | None
    cpu_affinity: int | None
    cpu_model: str
    ram_bytes: int
    dev_shm_bytes: int | None
    python: str
    torch: str
    torch_threads: int
    numpy: str
    grpcio: str
    platform: str
    hostname: str
    transparent_hugepage: dict[str, str]


@dataclass
class ProcMemory:
    """RSS parts from /proc/<pid>/status and PSS parts from /proc/<pid>/smaps_rollup, in bytes; a key the kernel
    does not report is left out."""

    rss_peak: int | None = field(default=None, metadata=OMIT_NONE)
    rss: int | None = field(default=None, metadata=OMIT_NONE)
    rss_anon: int | None = field(default=None, metadata=OMIT_NONE)
    rss_file: int | None = field(default=None, metadata=OMIT_NONE)
    rss_shmem: int | None = field(default=None, metadata=OMIT_NONE)
    pss: int | None = field(default=None, metadata=OMIT_NONE)
    pss_anon: int | None = field(default=None, metadata=OMIT_NONE)
    pss_file: int | None = field(default=None, metadata=OMIT_NONE)
    pss_shmem: int | None = field(default=None, metadata=OMIT_NONE)

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> ProcMemory | None:
        return None if data is None else cls(**{k: int(v) for k, v in data.items()})


# -- the state ---------------------------------------------------------------------------------------


@dataclass
class StateInfo:
    bytes: int
    shard_bytes: int
    tensors: int
    dtype: str
    layout: str
    generate_seconds: float
    fingerprint: str


# -- baselines ---------------------------------------------------------------------------------------


@dataclass
class MemcpyFloor:
    bytes: int
    torch_threads: int
    torch_copy_fresh_seconds: Summary
    torch_copy_seconds: Summary
    memmove_single_thread_seconds: Summary
    shm_torch_copy_seconds: Summary | None


@dataclass
class TcpFloor:
    bytes: int
    reps: int
    send_slice_bytes: int
    receiver_so_rcvbuf: int
    seconds: Summary
    bytes_per_second: Summary


@dataclass
class GrpcFloor:
    mode: str
    bytes: int
    reps: int
    message_bytes: int
    seconds: Summary
    bytes_per_second: Summary


@dataclass
class DiskFloor:
    dir: str
    filesystem: str
    file_bytes: int
    save_seconds: float
    fsync_seconds: float
    save_fsync_seconds: float
    load_cold_seconds: Summary
    load_cold_page_cache_evicted: bool
    load_warm_seconds: Summary
    load_verified: bool


@dataclass
class DcpCall:
    blocking_seconds: float
    total_seconds: float


@dataclass
class DcpMode:
    """One staging mode of the DCP baseline: its timings, or (both None) why this torch could not measure it."""

    blocking_seconds: Summary | None
    total_seconds: Summary | None
    first_call: DcpCall | None = field(default=None, metadata=OMIT_NONE)  # reused stager: the call that fills its cache, reported apart
    unavailable: str | None = field(default=None, metadata=OMIT_NONE)  # e.g. "unavailable on torch 2.11.0: KeyError: ..."

    @classmethod
    def not_measured(cls, reason: str) -> DcpMode:
        return cls(blocking_seconds=None, total_seconds=None, unavailable=reason)

    @property
    def blocking_p50(self) -> float | None:
        return self.blocking_seconds.p50 if self.blocking_seconds else None

    @property
    def total_p50(self) -> float | None:
        return self.total_seconds.p50 if self.total_seconds else None


@dataclass
class DcpFloor:
    torch: str
    writer: str
    process_group: str
    reps: int
    dir: str
    filesystem: str
    file_bytes: int | None  # None: no async_save completed
    default: DcpMode
    reused_stager: DcpMode


@dataclass
class Floors:
    memcpy: MemcpyFloor
    tcp: TcpFloor
    grpc_bytes: GrpcFloor
    grpc_protobuf: GrpcFloor
    disk: DiskFloor
    dcp: DcpFloor


# -- diagnosis: in-process cost model ----------------------------------------------------------------


@dataclass
class FreshSegment:
    fallocate_seconds: Summary
    seconds: Summary


@dataclass
class SavePathModel:
    bytes: int
    dir: str | None
    plan_seconds: Summary
    write_into_shm_seconds: Summary
    fresh_segment_seconds: FreshSegment | None


@dataclass
class CostModel:
    bytes: int
    chunk_bytes: int
    chunks: int
    seconds: dict[str, float]  # per step of the replication pipeline, over every chunk
    bytes_per_second: dict[str, float]
    sender_cpu_seconds_estimate: float
    receiver_cpu_seconds_estimate: float
    notes: str
    save_path: SavePathModel | None = None


@dataclass
class SizeResult:
    """What is measured once per state size: the state, its baselines and the cost model."""

    state: StateInfo
    floors: Floors
    diagnosis: CostModel
