"""Typed results of the cluster measurements: the plan (RAM need, skipped scenarios), saves, store memory,
restores, one scenario's measurement, and the leak check. Field names are the JSON keys. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memstore.bench.jsonable import FLATTEN, OMIT_EMPTY, OMIT_NONE, SKIP
from memstore.bench.jsonable import key as json_key
from memstore.bench.results import CpuReport, ProcMemory, ScenarioConditions, Summary

DURABLE_NOTE = "measured once per run, for the headline scenario"
DURABLE_ENDPOINTS_NOTE = "skipped with --endpoints: it needs stores this bench starts with --spill"


# -- the plan ----------------------------------------------------------------------------------------


@dataclass
class RamNeed:
    stores_bytes: int
    bench_bytes: int
    processes_bytes: int
    total_bytes: int
    one_rank_per_host_bytes: int


@dataclass
class Skipped:
    size: int | None
    hosts: int
    replicas: int
    ram_need: RamNeed | None = field(default=None, metadata=OMIT_NONE)  # only when the scenario does not fit in --max-ram
    reason: str = ""


@dataclass
class FailedScenario:
    name: str
    size: int
    hosts: int
    replicas: int
    error: str


@dataclass
class Endpoints:
    """An already running cluster (--endpoints), as its first store describes it."""

    path: str
    hosts: dict[str, str]
    replicas: int
    capacity_bytes: int
    version: str
    placement: str
    data_port: int
    local_pids: dict[str, int | None]


# -- store memory ------------------------------------------------------------------------------------


@dataclass
class HeldBytes:
    """Shard bytes a store holds (sum of nbytes over its List, every job) and its accounted bytes (Health)."""

    shards: int
    shard_bytes_held: int
    used_bytes: int  # in-use segments + pooled free segments, as the store accounts them against capacity
    pooled_bytes_estimate: int  # the store's pooled_bytes where it reports them, else used_bytes - held (page-rounded)
    capacity_bytes: int
    pooled_bytes: int | None = field(default=None, metadata=OMIT_NONE)  # Health.pooled_bytes: free segments kept faulted in
    reserve_bytes: int | None = field(default=None, metadata=OMIT_NONE)  # Health.reserve_bytes: the --prefault reserve (in pooled)


@dataclass
class StoreRatios:
    rss_over_held: float | None
    rss_over_held_plus_pooled: float | None
    pss_over_held: float | None


@dataclass
class StoreMemoryEntry:
    pid: int | None
    memory: ProcMemory | None
    held: HeldBytes | None = field(metadata=FLATTEN)  # None: the store did not answer
    ratios: StoreRatios | None = field(default=None, metadata=FLATTEN)  # None: its process or its shards could not be read


@dataclass
class StoreMemory:
    stores: dict[str, StoreMemoryEntry]
    worst_host: str | None
    rss_over_held_max: float | None
    rss_over_held_plus_pooled_max: float | None
    available: bool
    note: str


# -- saves -------------------------------------------------------------------------------------------


@dataclass
class SaveSample:
    step: int
    phase: str  # "first" (save 1 of a fresh job on fresh stores) | "early" (saves 2..keep+2) | "steady" (the saves after them)
    save_wall_seconds: float  # the stall: save() call -> return
    stall_seconds: float  # SaveHandle.stall_seconds (measured inside save())
    committed_seconds: float  # save() call -> wait() returned (R copies)
    copies: int
    replication_seconds: float  # committed - save wall
    replication_bytes_per_second: float
    paired_memcpy_seconds: float | None  # torch copy_ into pre-faulted memory, right before this save
    error: str = ""  # why the save did not reach R copies (wait() raised); such saves are left out of the commit figures
    stall_over_memcpy: float | None = field(default=None, metadata=OMIT_NONE)  # save_wall_seconds / paired_memcpy_seconds
    committed_bytes_per_second: float | None = field(default=None, metadata=OMIT_NONE)  # state bytes / committed_seconds


# -- restores ----------------------------------------------------------------------------------------


@dataclass
class RestoreReport:
    """What a restore process (memstore.bench.workers restore) reports about its load()."""

    accept_unix: float
    loaded_unix: float
    connect_seconds: float
    load_seconds: float
    connect_load_seconds: float
    source_host: str
    shared_memory: bool
    zero_copy: bool
    memory_after_load: ProcMemory | None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RestoreReport:
        values = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        values["memory_after_load"] = ProcMemory.from_json(data.get("memory_after_load"))
        return cls(**values)


@dataclass
class PullNote:
    """One 'fetch: pulled' / 'repair: pulled' line of a store's log."""

    by: str
    key: str
    source: str = field(metadata=json_key("from"))


@dataclass
class HostLoss:
    """The parts of a restore after a host loss that only that restore has."""

    restart_seconds: float | None
    serving_unix: float | None
    serving_to_loaded_seconds: float | None
    port_open_to_loaded_seconds: float
    restore_seconds: float
    pulls: list[PullNote]
    fetch_pulls: int
    repair_pulls: int
    pulled_twice: list[str]
    start_to_loaded_seconds: float | None = None  # the replacement store's process started -> load() returned


@dataclass
class RestoreRun:
    report: RestoreReport = field(metadata=FLATTEN)
    fingerprint: str = field(metadata=SKIP)  # compared with the saved state's into verified_equal, not written
    bench_wall_seconds: float
    import_seconds: float
    pid: int
    host_loss: HostLoss | None = field(default=None, metadata=FLATTEN)
    verified_equal: bool = False

    def seconds(self, timed: str) -> float:
        """The timed figure: connect_load_seconds, or restore_seconds of a host loss."""
        if timed == "restore_seconds" and self.host_loss is not None:
            return self.host_loss.restore_seconds
        return self.report.connect_load_seconds


@dataclass
class RestoreSummary:
    seconds: Summary
    timed: str
    load_seconds: Summary
    connect_seconds: Summary
    source_hosts: list[str]
    verified_equal: bool
    runs: list[RestoreRun]
    bytes_per_second: float | None = field(default=None, metadata=OMIT_NONE)  # restore after a host loss only
    pulled_by: list[str] | None = field(default=None, metadata=OMIT_NONE)  # restore after a host loss only


@dataclass
class PullRun:
    seconds: float
    source_host: str
    deleted_on_owner: int
    bytes_per_second: float


@dataclass
class PeerPull:
    seconds: Summary
    bytes_per_second: Summary
    source_hosts: list[str]
    runs: list[PullRun]


@dataclass
class DurableRestore:
    """Restore from durable storage: stores started with --spill file://DIR --spill-every-steps 1, one save, the step
    spilled, then removed from every store's RAM (Delete): a new process load()s it, the owner pulling from the spill."""

    available: bool = False
    note: str = DURABLE_NOTE
    command: str | None = field(default=None, metadata=OMIT_NONE)
    store_command: str | None = field(default=None, metadata=OMIT_NONE)
    spill_url: str | None = field(default=None, metadata=OMIT_NONE)
    save: SaveSample | None = field(default=None, metadata=OMIT_NONE)
    spilled_seconds: float | None = field(default=None, metadata=OMIT_NONE)  # committed -> the owner reports the step spilled
    deleted_copies: list[int] | None = field(default=None, metadata=OMIT_NONE)  # RAM copies deleted before each restore
    restore: RestoreSummary | None = field(default=None, metadata=OMIT_NONE)  # new process, timed from its load call
    error: str = field(default="", metadata=OMIT_EMPTY)


# -- one scenario ------------------------------------------------------------------------------------


@dataclass
class ScenarioMeasurement:
    name: str
    size: int
    hosts: int
    replicas: int
    saves_measured: int
    restores: int
    headline: bool
    ram_need: RamNeed
    cluster_start_seconds: float
    local_cluster: bool
    job: str
    shared_memory: bool
    store_version: str
    store_data_port: int  # 0: replicas and pulls travel over gRPC
    data_plane: str
    errors: list[str] = field(metadata=OMIT_EMPTY)  # saves that did not reach R copies
    last_step: int
    saves: list[SaveSample]
    stall_seconds: Summary
    stall_inside_save_seconds: Summary
    paired_memcpy_seconds: Summary
    failed_saves: int
    committed_seconds: Summary
    replication_seconds: Summary
    replication_bytes_per_second: Summary
    first_save: SaveSample
    cold_saves_stall_seconds: Summary
    store_memory: StoreMemory
    restore_local: RestoreSummary
    restore_local_copy: RestoreSummary
    peer_pull: PeerPull | None = field(metadata=OMIT_NONE)  # R >= 2
    restore_peer_deleted: RestoreSummary | None = field(metadata=OMIT_NONE)  # R >= 2
    restore_peer: RestoreSummary | None  # after a host loss: local stores and R >= 2
    restore_peer_note: str | None = field(metadata=OMIT_NONE)  # why restore_peer is None
    restore_durable: DurableRestore
    store_memory_end: StoreMemory
    conditions: ScenarioConditions
    prefault: str | None = None  # MEMSTORE_PREFAULT its stores got; None: nothing (the store's default)
    store_command: str = ""  # how its first store ran
    stores_idle_wait_seconds: float = 0.0  # after the stores served, until their RSS stopped growing, before save 1


# -- the leak check ----------------------------------------------------------------------------------


@dataclass
class LeakSample:
    """What the leak check's saving process (memstore.bench.workers leak) reports after each save."""

    save: int
    stall_seconds: float
    copies: int
    error: str
    client: ProcMemory | None
    stores: dict[str, ProcMemory | None]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LeakSample:
        return cls(
            save=int(data["save"]),
            stall_seconds=float(data["stall_seconds"]),
            copies=int(data["copies"]),
            error=str(data.get("error") or ""),
            client=ProcMemory.from_json(data.get("client")),
            stores={h: ProcMemory.from_json(m) for h, m in data["stores"].items()},
        )


@dataclass
class LeakProcess:
    rss_after_save_ref: int
    rss_after_last_save: int
    growth_percent: float
    rss_anon_growth_bytes: int
    rss_shmem_growth_bytes: int
    pss_growth_percent: float | None
    rss_series: list[int | None]


@dataclass
class LeakCheck:
    size: int
    saves: int
    hosts: int
    replicas: int
    reference_save: int
    processes: dict[str, LeakProcess]
    max_growth_percent: float | None
    worst: str | None
    stall_seconds: Summary
    copies: list[int]
    failed_saves: list[str]
    stores_measured: bool
    conditions: CpuReport


@dataclass
class LeakSkipped:
    skipped: str
    failed: bool | None = field(default=None, metadata=OMIT_NONE)


Leak = LeakCheck | LeakSkipped
