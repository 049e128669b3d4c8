"""Typed results of what a user sees from the first save (issue 16), as measured: a series of saves from the first one of
a fresh job on fresh stores (the store's defaults, or with memory pre-faulted), small states, many small tensors, and
the path without shared memory. Field names are the JSON keys (:mod:`memstore.bench.jsonable`). Pure."""

from __future__ import annotations

from dataclasses import dataclass, field

from memstore.bench.jsonable import OMIT_EMPTY, OMIT_NONE
from memstore.bench.results import CpuReport, Summary
from memstore.bench.scenario_results import SaveSample
from memstore.bench.units import MiB, short_size


def prefault_for(shard_bytes: int, keep: int) -> str:
    """What docs/operations.md says to pre-fault: the segments one rank's shard cycles through, (keep+2) x the shard
    (state + header) rounded up to MiB, as a size the store parses. Before it has seen a shard the store cuts its
    reserve into keep+2 units, one shard each."""
    return short_size((keep + 2) * (-(-shard_bytes // MiB) * MiB))


def series_label(prefault: str | None, shard_bytes: int, keep: int) -> str:
    if prefault is None:
        return "store defaults"
    return f"--prefault {prefault}" + (f" ({keep + 2}x state)" if prefault == prefault_for(shard_bytes, keep) else "")


@dataclass
class SaveSeries:
    """Saves 1..N of a fresh job on freshly started stores, each timed from the save() call."""

    label: str  # "store defaults", "--prefault 4100MiB (4x state)", ...
    prefault: str | None  # what the stores got as MEMSTORE_PREFAULT; None: nothing (the store's default)
    command: str  # the bench command that measured it
    store_command: str  # how the first store ran
    job: str
    hosts: int
    replicas: int
    state_bytes: int
    shard_bytes: int
    cluster_start_seconds: float
    stores_idle_wait_seconds: float  # after the stores served, until their RSS stopped growing (start-up pre-faulting)
    saves: list[SaveSample]
    error: str = field(default="", metadata=OMIT_EMPTY)  # why the series did not run (e.g. the stores rejected the setting)


@dataclass
class SmallState:
    """Fixed cost per save: a small state on one rank, the headline's cluster shape, fresh stores and job."""

    size: int
    tensors: int
    state_bytes: int
    shard_bytes: int
    command: str
    store_command: str
    job: str
    cluster_start_seconds: float
    saves: list[SaveSample]  # save 1, then the saves after it
    conditions: CpuReport  # how idle the machine was meanwhile
    errors: list[str] = field(default_factory=list, metadata=OMIT_EMPTY)


@dataclass
class TensorState:
    """One of the two states of the per-tensor figure: many small tensors, or one tensor of the same bytes."""

    layout: str
    tensors: int
    state_bytes: int
    shard_bytes: int
    job: str
    saves: list[SaveSample]  # save 1, saves 2..keep+2, then the steady state
    load_seconds: Summary  # load() (latest step, zero-copy) in this process, repeated
    verified_equal: bool  # the last load gave back the saved state


@dataclass
class PerTensorRun:
    count: int
    tensor_bytes: int
    command: str
    store_command: str
    many: TensorState
    one: TensorState
    errors: list[str] = field(default_factory=list, metadata=OMIT_EMPTY)


@dataclass
class NoShmRun:
    """A trainer whose store is in another pod or host: CheckpointClient(use_shared_memory=False), bytes over gRPC."""

    command: str
    store_command: str
    job: str
    shared_memory: bool  # the client's path (False here)
    state_bytes: int
    shard_bytes: int
    saves: list[SaveSample]
    load_seconds: Summary  # a new client in this process: connect + load() (streamed, into fresh memory)
    verified_equal: bool
    errors: list[str] = field(default_factory=list, metadata=OMIT_EMPTY)


@dataclass
class FirstSaveRuns:
    """What a run measures once, for its headline scenario, beyond the scenario itself."""

    headline: str
    prefault_supported: bool  # whether the stores of this checkout know --prefault / MEMSTORE_PREFAULT
    prefault_series: SaveSeries | None = field(default=None, metadata=OMIT_NONE)  # (keep+2)x state pre-faulted (no --prefault given)
    small_states: list[SmallState] = field(default_factory=list)
    per_tensor: PerTensorRun | None = field(default=None, metadata=OMIT_NONE)
    no_shared_memory: NoShmRun | None = field(default=None, metadata=OMIT_NONE)
    notes: list[str] = field(default_factory=list)  # what was skipped or failed, and why
