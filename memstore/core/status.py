"""What a store reports about itself: its handshake (Hello), its health (Health) and what it holds per job (metrics)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from memstore.core.model import ShardKey, ShardState
from memstore.core.slots import SlotTable


@dataclass(frozen=True)
class HelloReport:
    """A store's identity and the cluster layout it runs with; peers compare layouts before serving."""

    host_id: str
    version: str
    replicas: int
    peer_ids: tuple[str, ...]  # the ordered host list (placement order)
    peer_addresses: tuple[str, ...]  # same order as peer_ids
    shm_dir: str  # where local shared-memory segments live ("" = none)
    boot_id: str  # kernel boot id: a client on the same machine sees the same one
    capacity_bytes: int
    max_chunk_bytes: int
    placement: str  # "mixed" | "ring"
    data_port: int  # the bulk data channel's port (0 = none)
    slots: SlotTable = SlotTable()  # this store's slot table (peers adopt a newer one)
    draining: bool = False  # leaving on purpose: takes no new copies
    failure_domain: str = ""  # this store's own failure-domain label ("" = none); DNS discovery learns labels here
    control_socket: str = ""  # the same-host control channel's Unix socket ("" = none)
    marked_captures: bool = False  # takes CommitRequest.captured_bytes (a large save pushed while it is copied)
    redundancy: str = ""  # "replicas:R" | "ec:K+M"; "" = an older store's: replicas:<replicas> (``cluster_redundancy``)

    @property
    def cluster_redundancy(self) -> str:
        """The store's redundancy scheme as text, ``replicas:<replicas>`` for a store that does not say."""
        return self.redundancy or f"replicas:{self.replicas}"


@dataclass(frozen=True)
class SpillReport:
    """The durable tier's progress for one job."""

    job_id: str
    last_spilled_step: int  # -1 = none yet
    last_spill_unix: float  # 0 = never
    consecutive_failures: int
    last_error: str
    bytes_written: int


@dataclass(frozen=True)
class Orphan:
    """A segment directory no running store owns: ``files`` segments, ``bytes`` on the tmpfs (sidecars included)."""

    path: str
    host_id: str
    bytes: int
    files: int


@dataclass(frozen=True)
class CaptureReport:
    """How clients' copies into this store's memory went (each Commit reports the client's counts since its last)."""

    registrations: int = 0  # cudaHostRegister calls that succeeded: after warm-up a client registers nothing more
    fallbacks: int = 0  # captures into memory that could not be registered (pageable and synchronous): should stay 0
    fallback_cause: str = ""  # the last fallback's cause, as the client's CUDA runtime named it

    def plus(self, registrations: int, fallbacks: int, cause: str) -> CaptureReport:
        return CaptureReport(self.registrations + registrations, self.fallbacks + fallbacks, cause or self.fallback_cause)


@dataclass(frozen=True)
class HealthReport:
    """A store's load and upkeep at one moment."""

    serving: bool
    host_id: str
    used_bytes: int
    capacity_bytes: int
    shards: int
    replications_in_flight: int
    repairs_in_flight: int
    uptime_seconds: float
    spill_url: str  # "" = no durable tier
    spill: tuple[SpillReport, ...]  # per job
    orphans: tuple[Orphan, ...]  # segment dirs under this store's --shm-dir that no running store owns
    adopted_shards: int  # shards taken over at start from the segments a previous incarnation left
    draining: bool = False
    drain_progress: str = ""
    slots: SlotTable = SlotTable()
    discovery: DiscoveryReport | None = None
    not_ready: str = ""  # "" = ready for saves (the readiness probe); else why not
    pooled_bytes: int = 0  # part of used_bytes: free segments kept faulted in (job pools and the reserve)
    reserve_bytes: int = 0  # part of pooled_bytes: the fresh reserve (--prefault), with what is being faulted in
    reserve_filling: bool = False  # the reserve is being faulted in toward its goal
    capture: CaptureReport = CaptureReport()  # clients' captures into this store, summed over their commits
    saves_superseded: int = 0  # saves not replicated because a newer save of the same rank came first
    jobs_memory: tuple[JobMemory, ...] = ()  # per job: the bytes of its segments here, in use and pooled
    ring_overflows: int = 0  # saves that grew a full capture ring past its bound
    ring_limit: int = 0  # segments a rank's capture ring holds once warm
    scrubbed_bytes: int = 0  # bytes the background scrub re-verified since the store started
    scrub_corrupt: int = 0  # copies the scrub found corrupt (each dropped, and pulled again by repair)


@dataclass(frozen=True)
class JobMemory:
    """The shared memory one job's segments hold on one store: in use (shards, replicas, leases) and pooled (spares)."""

    job_id: str
    in_use_bytes: int
    pooled_bytes: int


@dataclass(frozen=True)
class DiscoveryReport:
    """Where the store learns its members from and how the last polls went."""

    source: str
    members: int  # in the last good answer
    last_ok_unix: float
    error: str  # "" = the last poll was good
    consecutive_failures: int


@dataclass(frozen=True)
class JobCensus:
    """What one store holds of one job in RAM (its metrics): every copy, its own shards and replicas alike."""

    job_id: str
    nbytes: int  # shard bytes of the copies held, saves in flight included
    shards: int
    steps: int  # distinct step numbers among them
    newest_committed: int  # newest step of a committed copy held here (its own COMMITTED shard, or a REPLICA); -1 = none
    floor: int = -1  # the job's restorable floor this store knows (memstore.core.floors); -1 = none


def job_census(copies: Iterable[tuple[ShardKey, int, ShardState]], floors: Mapping[str, int] | None = None) -> list[JobCensus]:
    """Per job (sorted by id), from (key, nbytes, state) of every copy a store holds and the restorable floors it knows."""
    floors = floors or {}
    nbytes: dict[str, int] = {}
    shards: dict[str, int] = {}
    steps: dict[str, set[int]] = {}
    newest: dict[str, int] = {}
    for key, size, state in copies:
        job = key.job_id
        nbytes[job] = nbytes.get(job, 0) + size
        shards[job] = shards.get(job, 0) + 1
        steps.setdefault(job, set()).add(key.step)
        newest.setdefault(job, -1)
        if state in (ShardState.COMMITTED, ShardState.REPLICA):
            newest[job] = max(newest[job], key.step)
    return [JobCensus(job, nbytes[job], shards[job], len(steps[job]), newest[job], floors.get(job, -1)) for job in sorted(nbytes)]
