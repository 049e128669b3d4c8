"""The simulation model: failure traces and the two checkpointing strategies replayed on them.

Everything here is plain Python (standard library only, plus :mod:`memstore.core.placement` for the
exact RAM-recovery probability) and deterministic for a given seed. See ``docs/simulator.md`` for
the model, its assumptions and the formulas; the short version:

* **Failures** are job interruptions arriving as a Poisson process with rate
  ``gpus * failures_per_gpu_hour``. A fraction ``correlated_fraction`` of them are bursts that take
  down ``burst_hosts`` hosts at once (a rack / switch), the rest take down one host. The failed hosts
  are a uniformly random set, which is what :func:`~memstore.core.placement.recovery_probability`
  assumes.
* **memstore** checkpoints to peer RAM every ``every_iterations`` iterations (1 unless replication
  is slower than an iteration). A checkpoint costs a short training stall and is *committed* once its
  replicas (for ``ec:K+M``: its parity contributions, M shards' worth per host) are written, ``replication_lag``
  later. A background task spills the newest committed
  checkpoint to durable storage every ``spill_every_minutes``. On a failure the job restarts and
  every host reloads the newest committed checkpoint from RAM (the replacement host fetches its shard
  from a peer; under ``ec:K+M`` it rebuilds it from K blocks per block, read from its group's survivors in
  parallel) unless some owner lost *all* its holders (for ``ec:K+M``: some group lost more than M hosts) during the
  recovery window, in which case the job falls back to the newest completed spill and reloads it from storage.
* **baseline** writes the checkpoint to remote storage every ``baseline_interval`` seconds of
  training (Young/Daly optimum by default); the training stalls for the (synchronous part of the)
  write and a failure rolls back to the newest completed write, then reloads it from storage.

Both strategies replay the *same* trace. Time is simulated event to event (failure, spill start),
never iteration by iteration: between two events the number of iterations, stalls and committed
checkpoints follows in closed form from the periodic :class:`Cadence`.
"""

from __future__ import annotations

import functools
import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from memstore.core.placement import erasure_group_sizes, make_placement, recovery_probability
from memstore.core.redundancy import Redundancy

# --------------------------------------------------------------------------------------------------
# Published failure data -> per-GPU failure rate
# --------------------------------------------------------------------------------------------------

HOURS_PER_DAY = 24.0
SECONDS_PER_HOUR = 3600.0
SECONDS_PER_DAY = 86400.0


@dataclass(frozen=True)
class FailureData:
    """A published job-failure figure, turned into a per-GPU interruption rate.

    ``job_mttf_hours`` is the mean time between job interruptions observed (or projected) for a job of
    ``gpus`` GPUs; assuming independent GPUs (a series system) the per-GPU rate is
    ``1 / (job_mttf_hours * gpus)`` interruptions per GPU-hour.
    """

    name: str
    job_mttf_hours: float
    gpus: int
    source: str

    @property
    def failures_per_gpu_hour(self) -> float:
        return 1.0 / (self.job_mttf_hours * self.gpus)


FAILURE_DATA: dict[str, FailureData] = {
    d.name: d
    for d in (
        FailureData(
            "rsc16k",
            1.8,
            16384,
            "Meta RSC clusters, projected job MTTF 1.8 h at 16,384 GPUs (Kokolis et al., 'Revisiting Reliability in "
            "Large-Scale ML Research Clusters', HPCA'25)",
        ),
        FailureData("rsc1k", 7.9, 1024, "Meta RSC clusters, job MTTF 7.9 h at 1,024 GPUs (same paper)"),
        FailureData(
            "llama3",
            54 * HOURS_PER_DAY / 419,
            16384,
            "Llama 3 405B pre-training: 419 unexpected interruptions in 54 days on 16,384 H100s (The Llama 3 Herd of Models, 2024)",
        ),
    )
}
DEFAULT_FAILURE_DATA = "rsc16k"


def failures_per_gpu_hour_from_job(*, mttf_hours: float | None = None, failures_per_day: float | None = None, gpus: int) -> float:
    """Per-GPU rate from a job-level figure (exactly one of ``mttf_hours`` / ``failures_per_day``)."""
    if (mttf_hours is None) == (failures_per_day is None):
        raise ValueError("give exactly one of mttf_hours and failures_per_day")
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    if mttf_hours is not None:
        if not mttf_hours > 0:
            raise ValueError(f"mttf_hours must be > 0, got {mttf_hours}")
        return 1.0 / (mttf_hours * gpus)
    assert failures_per_day is not None
    if failures_per_day < 0:
        raise ValueError(f"failures_per_day must be >= 0, got {failures_per_day}")
    return failures_per_day / HOURS_PER_DAY / gpus


# --------------------------------------------------------------------------------------------------
# Configuration of one simulated job
# --------------------------------------------------------------------------------------------------


def transfer_seconds(gigabytes: float, gbps: float) -> float:
    """Seconds to move ``gigabytes`` (10**9 bytes) at ``gbps`` (10**9 bits/s)."""
    return gigabytes * 8.0 / gbps


@dataclass(frozen=True)
class SimConfig:
    """One simulated training job (one host count). Times in seconds unless the name says otherwise.

    ``checkpoint_gb`` is the *total* checkpoint (all hosts' shards together, 10**9 bytes); each host
    owns ``checkpoint_gb / hosts``. ``storage_gbps`` is the aggregate bandwidth of the remote storage
    the whole job writes to / reads from; ``network_gbps`` is each host's NIC.
    """

    hosts: int
    replicas: int = 2
    placement: str = "mixed"
    redundancy: str = ""  # "" = replicas:<replicas>; "ec:K+M" (with replicas 1: the owner's copy) or "replicas:R"
    gpus_per_host: int = 8
    days: float = 7.0
    seed: int = 0
    trials: int = 1
    failures_per_gpu_hour: float = FAILURE_DATA[DEFAULT_FAILURE_DATA].failures_per_gpu_hour
    correlated_fraction: float = 0.05
    burst_hosts: int = 4
    iteration_seconds: float = 10.0
    memstore_stall_seconds: float = 0.1
    restart_seconds: float = 300.0
    network_gbps: float = 400.0
    storage_gbps: float = 20.0
    checkpoint_gb: float = 1200.0
    spill_every_minutes: float = 30.0
    baseline_every_minutes: float | None = None  # None: Young/Daly optimum
    baseline_async_fraction: float = 0.0

    def __post_init__(self) -> None:
        problems = validate_config(self)
        if problems:
            raise ValueError("; ".join(problems))

    # --- derived quantities ------------------------------------------------------------------------

    @property
    def scheme(self) -> Redundancy:
        """The redundancy scheme: ``redundancy``, or ``replicas:<replicas>`` when it is empty."""
        return Redundancy.parse(self.redundancy) if self.redundancy else Redundancy.of_replicas(self.replicas)

    @property
    def gpus(self) -> int:
        return self.hosts * self.gpus_per_host

    @property
    def duration_seconds(self) -> float:
        return self.days * SECONDS_PER_DAY

    @property
    def job_failures_per_hour(self) -> float:
        """Job interruptions (failure events) per hour: ``gpus * failures_per_gpu_hour``."""
        return self.gpus * self.failures_per_gpu_hour

    @property
    def job_failures_per_day(self) -> float:
        return self.job_failures_per_hour * HOURS_PER_DAY

    @property
    def job_mttf_seconds(self) -> float:
        rate = self.job_failures_per_hour
        return math.inf if rate == 0 else SECONDS_PER_HOUR / rate

    @property
    def effective_burst_hosts(self) -> int:
        return min(self.burst_hosts, self.hosts)

    @property
    def checkpoint_gb_per_host(self) -> float:
        return self.checkpoint_gb / self.hosts

    @property
    def storage_transfer_seconds(self) -> float:
        """Writing (or reading) the whole checkpoint to (from) remote storage: ``checkpoint_gb / storage_gbps``."""
        return transfer_seconds(self.checkpoint_gb, self.storage_gbps)

    @property
    def data_columns(self) -> int:
        """``ec:K+M``: the data columns of the largest group (K, or more where the remainder hosts joined); 0 for replicas."""
        scheme = self.scheme
        if not scheme.erasure_coded:
            return 0
        return max(erasure_group_sizes(self.hosts, scheme.group_size)) - scheme.m

    @property
    def ram_load_seconds(self) -> float:
        """A replacement host restoring its shard: from one peer's RAM, ``checkpoint_gb_per_host / network_gbps``;
        under ``ec:K+M`` rebuilt from K blocks per lost block, pulled in parallel from its group's survivors into its
        one NIC: K times that (:attr:`data_columns`)."""
        return max(1, self.data_columns) * transfer_seconds(self.checkpoint_gb_per_host, self.network_gbps)

    @property
    def replication_lag_seconds(self) -> float:
        """Sending one shard to the ``replicas - 1`` peers over the host NIC (overlaps training); under ``ec:K+M`` its
        parity contributions, M shards' worth (1 for XOR parity). Both are the losses a group survives, times a shard."""
        return self.scheme.survives * transfer_seconds(self.checkpoint_gb_per_host, self.network_gbps)

    @property
    def ram_multiple(self) -> float:
        """RAM per byte of checkpoint, per kept step: R, or 1 + M/K (the largest group's K)."""
        scheme = self.scheme
        return 1 + scheme.m / self.data_columns if scheme.erasure_coded else float(scheme.replicas)

    @property
    def memstore_every_iterations(self) -> int:
        """Checkpoint every iteration unless replication of one checkpoint takes longer than that."""
        return max(1, math.ceil(self.replication_lag_seconds / self.iteration_seconds - 1e-12))

    @property
    def memstore_cadence(self) -> Cadence:
        return Cadence(
            compute=self.memstore_every_iterations * self.iteration_seconds,
            stall=self.memstore_stall_seconds,
            lag=self.replication_lag_seconds,
        )

    @property
    def baseline_stall_seconds(self) -> float:
        return (1.0 - self.baseline_async_fraction) * self.storage_transfer_seconds

    @property
    def young_daly_seconds(self) -> float:
        """Young's optimal compute time between checkpoints, ``sqrt(2 * stall * MTTF)`` (inf without failures)."""
        return math.sqrt(2.0 * self.baseline_stall_seconds * self.job_mttf_seconds)

    @property
    def baseline_interval_seconds(self) -> float:
        """Training (compute) seconds between two baseline checkpoints, a whole number of iterations.

        Young/Daly unless ``baseline_every_minutes`` is set; never shorter than the asynchronous part
        of a write (a new write can't start before the previous one is done) and capped at the run.
        """
        wanted = self.young_daly_seconds if self.baseline_every_minutes is None else self.baseline_every_minutes * 60.0
        wanted = min(max(wanted, self.storage_transfer_seconds - self.baseline_stall_seconds), self.duration_seconds)
        return max(1, math.ceil(wanted / self.iteration_seconds - 1e-9)) * self.iteration_seconds

    @property
    def baseline_cadence(self) -> Cadence:
        stall = self.baseline_stall_seconds
        return Cadence(compute=self.baseline_interval_seconds, stall=stall, lag=self.storage_transfer_seconds - stall)

    def derived(self) -> dict[str, Any]:
        """The derived figures the report shows next to the results."""
        return {
            "gpus": self.gpus,
            "job_failures_per_day": self.job_failures_per_day,
            "job_mttf_hours": self.job_mttf_seconds / SECONDS_PER_HOUR,
            "failures_per_gpu_hour": self.failures_per_gpu_hour,
            "checkpoint_gb_per_host": self.checkpoint_gb_per_host,
            "storage_transfer_seconds": self.storage_transfer_seconds,
            "ram_load_seconds": self.ram_load_seconds,
            "replication_lag_seconds": self.replication_lag_seconds,
            "redundancy": str(self.scheme),
            "ram_multiple": self.ram_multiple,
            "ram_gb_per_host": self.ram_multiple * self.checkpoint_gb_per_host,
            "memstore_every_iterations": self.memstore_every_iterations,
            "young_daly_minutes": self.young_daly_seconds / 60.0,
            "baseline_interval_minutes": self.baseline_interval_seconds / 60.0,
            "baseline_stall_seconds": self.baseline_stall_seconds,
            "effective_burst_hosts": self.effective_burst_hosts,
        }


def validate_config(cfg: SimConfig) -> list[str]:
    """Human-readable problems with ``cfg`` (empty when valid), each naming the CLI flag."""
    out: list[str] = []

    def check(ok: bool, msg: str) -> None:
        if not ok:
            out.append(msg)

    check(cfg.hosts >= 1, f"--hosts must be >= 1, got {cfg.hosts}")
    check(cfg.replicas >= 1, f"--replicas must be >= 1, got {cfg.replicas}")
    check(cfg.replicas <= cfg.hosts, f"--replicas {cfg.replicas} is more than --hosts {cfg.hosts} (replicas counts the owner's copy)")
    check(cfg.placement in ("mixed", "ring"), f"--placement must be mixed or ring, got {cfg.placement!r}")
    _check_redundancy(cfg, check)
    check(cfg.gpus_per_host >= 1, f"--gpus-per-host must be >= 1, got {cfg.gpus_per_host}")
    check(0 < cfg.days <= 3650, f"--days must be in (0, 3650], got {cfg.days}")
    check(cfg.trials >= 1, f"--trials must be >= 1, got {cfg.trials}")
    check(math.isfinite(cfg.failures_per_gpu_hour) and cfg.failures_per_gpu_hour >= 0, "failure rate must be finite and >= 0")
    check(0.0 <= cfg.correlated_fraction <= 1.0, f"--correlated-fraction must be in [0, 1], got {cfg.correlated_fraction}")
    check(cfg.burst_hosts >= 1, f"--burst-hosts must be >= 1, got {cfg.burst_hosts}")
    check(cfg.iteration_seconds > 0, f"--iteration-seconds must be > 0, got {cfg.iteration_seconds}")
    check(cfg.memstore_stall_seconds >= 0, f"--memstore-stall-seconds must be >= 0, got {cfg.memstore_stall_seconds}")
    check(cfg.restart_seconds >= 0, f"--restart-seconds must be >= 0, got {cfg.restart_seconds}")
    check(cfg.network_gbps > 0, f"--network-gbps must be > 0, got {cfg.network_gbps}")
    check(cfg.storage_gbps > 0, f"--storage-gbps must be > 0, got {cfg.storage_gbps}")
    check(cfg.checkpoint_gb > 0, f"--checkpoint-gb must be > 0, got {cfg.checkpoint_gb}")
    check(cfg.spill_every_minutes > 0, f"--spill-every-minutes must be > 0, got {cfg.spill_every_minutes}")
    check(
        cfg.baseline_every_minutes is None or cfg.baseline_every_minutes > 0,
        f"--baseline-every-minutes must be > 0 or 'auto', got {cfg.baseline_every_minutes}",
    )
    check(0.0 <= cfg.baseline_async_fraction < 1.0, f"--baseline-async-fraction must be in [0, 1), got {cfg.baseline_async_fraction}")
    return out


def _check_redundancy(cfg: SimConfig, check: Callable[[bool, str], None]) -> None:
    try:
        scheme = cfg.scheme
    except ValueError as exc:
        check(False, f"--{exc}")
        return
    check(scheme.replicas == cfg.replicas, f"--replicas {cfg.replicas} and --redundancy {scheme} disagree: give one of them")
    if scheme.erasure_coded:
        needs = scheme.group_size
        check(needs <= cfg.hosts, f"--redundancy {scheme} needs at least {needs} hosts (K+M), more than --hosts {cfg.hosts}")
        check(cfg.placement == "mixed", f"--placement {cfg.placement} does not apply to --redundancy {scheme}: it places disjoint groups")


# --------------------------------------------------------------------------------------------------
# Checkpoint cadence: the closed form between two events
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cadence:
    """Periodic checkpointing while training: ``compute`` seconds of training, then a ``stall``.

    Checkpoint ``j`` (1-based) is snapshotted at the end of its stall, ``j * period`` after training
    (re)started, and committed (replicated, or written to storage) ``lag`` seconds later.
    """

    compute: float
    stall: float
    lag: float

    @property
    def period(self) -> float:
        return self.compute + self.stall

    def split(self, elapsed: float) -> tuple[float, float]:
        """(compute seconds, stall seconds) in ``elapsed`` seconds of training."""
        n = math.floor(elapsed / self.period)
        rem = elapsed - n * self.period
        return n * self.compute + min(rem, self.compute), n * self.stall + max(0.0, rem - self.compute)

    def committed_compute(self, elapsed: float) -> float:
        """Compute seconds covered by the newest checkpoint committed ``elapsed`` seconds into training."""
        if elapsed < self.period + self.lag:
            return 0.0
        return math.floor((elapsed - self.lag) / self.period) * self.compute


# --------------------------------------------------------------------------------------------------
# Failure traces
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FailureEvent:
    """One job interruption: at ``time`` seconds, ``hosts`` hosts fail together.

    ``u`` is a uniform [0, 1) draw consumed by memstore's RAM-recovery decision, drawn with the trace
    so both strategies see exactly the same randomness.
    """

    time: float
    hosts: int
    u: float


def trial_rng(seed: int, hosts: int, trial: int) -> random.Random:
    """The random stream of one trial. Seeding with a string is stable across Python versions and
    runs, and independent of which other host counts are in the sweep."""
    return random.Random(f"memstore-sim/{seed}/{hosts}/{trial}")


def failure_trace(cfg: SimConfig, rng: random.Random) -> list[FailureEvent]:
    """Poisson failure events over the run (rate ``cfg.job_failures_per_hour``), sorted by time."""
    rate = cfg.job_failures_per_hour / SECONDS_PER_HOUR
    events: list[FailureEvent] = []
    if rate <= 0:
        return events
    t = 0.0
    horizon = cfg.duration_seconds
    burst = cfg.effective_burst_hosts
    while True:
        t += rng.expovariate(rate)
        if t >= horizon:
            return events
        is_burst = rng.random() < cfg.correlated_fraction
        events.append(FailureEvent(time=t, hosts=burst if is_burst else 1, u=rng.random()))


@functools.lru_cache(maxsize=64)
def _recovery_table(hosts: int, scheme: Redundancy, placement: str) -> Callable[[int], float]:
    p = make_placement(placement, [f"h{i}" for i in range(hosts)], scheme)

    @functools.cache
    def prob(k: int) -> float:
        return recovery_probability(p, min(max(k, 0), hosts))

    return prob


def ram_recovery_probability(cfg: SimConfig, k: int) -> float:
    """Probability that every owner keeps a live holder (``ec:K+M``: that no group loses more than M hosts) when ``k``
    random hosts of the job fail together."""
    return _recovery_table(cfg.hosts, cfg.scheme, cfg.placement)(k)


# --------------------------------------------------------------------------------------------------
# Replaying a trace
# --------------------------------------------------------------------------------------------------

STRATEGIES: tuple[str, ...] = ("memstore", "baseline")


@dataclass
class RunStats:
    """One strategy on one trace. Seconds are wall-clock seconds of the whole job."""

    strategy: str
    wall_seconds: float
    useful_seconds: float = 0.0
    compute_seconds: float = 0.0
    stall_seconds: float = 0.0
    recovery_seconds: float = 0.0
    lost_rollback_seconds: float = 0.0  # rolled back to the newest committed checkpoint (memstore: RAM; baseline: storage)
    lost_fallback_seconds: float = 0.0  # memstore only: RAM recovery failed, rolled back to the newest durable spill
    failure_events: int = 0
    host_failures: int = 0
    failures_during_recovery: int = 0
    ram_recoveries: int = 0
    durable_fallbacks: int = 0
    expected_durable_fallbacks: float = 0.0  # sum over events of the model's fallback probability
    spills_completed: int = 0
    spills_aborted: int = 0

    @property
    def lost_seconds(self) -> float:
        return self.lost_rollback_seconds + self.lost_fallback_seconds

    @property
    def ettr(self) -> float:
        return self.useful_seconds / self.wall_seconds


class _Replay:
    """The state of one :func:`simulate` run, advanced failure event by failure event.

    Training (re)started at ``resume_at`` from progress ``base`` (committed everywhere); before that,
    the job was recovering since ``rec_start``. memstore only: the recovery window (failures inside it
    add up to one ``window_k``) and the durable spills.
    """

    def __init__(self, cfg: SimConfig, strategy: str) -> None:
        self.cfg = cfg
        self.memstore = strategy == "memstore"
        self.horizon = cfg.duration_seconds
        self.cad = cfg.memstore_cadence if self.memstore else cfg.baseline_cadence
        self.storage_s = cfg.storage_transfer_seconds
        self.spill_every = cfg.spill_every_minutes * 60.0
        self.stats = RunStats(strategy=strategy, wall_seconds=self.horizon)
        self.base = 0.0
        self.rec_start = 0.0
        self.resume_at = 0.0
        self.window_end = -math.inf
        self.window_k = 0
        self.window_p = 1.0
        self.window_lost = False
        self.durable = 0.0
        self.pending: tuple[float, float] | None = None  # (progress, completes_at) of the spill being written
        self.next_spill = self.spill_every

    def committed_at(self, t: float) -> float:
        return self.base if t < self.resume_at else self.base + self.cad.committed_compute(t - self.resume_at)

    def settle_spills(self, until: float, *, failing: bool) -> None:
        """Start spills due before ``until``; complete those done by then, abort the rest if ``failing``."""
        while True:
            done_at = self.pending[1] if self.pending is not None else math.inf
            if done_at <= until and done_at <= self.next_spill:
                self._complete_spill()
            elif self.next_spill < until:
                if self.pending is None:  # one spill at a time: a spill due while one is in flight is skipped
                    self.pending = (self.committed_at(self.next_spill), self.next_spill + self.storage_s)
                self.next_spill += self.spill_every
            else:
                break
        if failing and self.pending is not None:
            self.stats.spills_aborted += 1
            self.pending = None

    def _complete_spill(self) -> None:
        assert self.pending is not None
        self.durable = max(self.durable, self.pending[0])
        self.stats.spills_completed += 1
        self.pending = None

    def close_phase(self, t: float) -> tuple[float, float]:
        """Account the recovery / training up to ``t``; return (progress, committed progress) at ``t``."""
        stats = self.stats
        if t < self.resume_at:
            stats.recovery_seconds += t - self.rec_start
            return self.base, self.base
        stats.recovery_seconds += self.resume_at - self.rec_start
        compute, stall = self.cad.split(t - self.resume_at)
        stats.compute_seconds += compute
        stats.stall_seconds += stall
        return self.base + compute, self.base + self.cad.committed_compute(t - self.resume_at)

    def ram_recovers(self, ev: FailureEvent) -> bool:
        """memstore: grow the recovery window by ``ev`` and decide whether every owner kept a live holder."""
        if ev.time < self.window_end:
            self.window_k = min(self.cfg.hosts, self.window_k + ev.hosts)
        else:
            self.window_k, self.window_p, self.window_lost = min(self.cfg.hosts, ev.hosts), 1.0, False
        if self.window_lost:  # a group is already gone in this window: the job is reloading from storage anyway
            self.stats.expected_durable_fallbacks += 1.0
            return False
        p_now = ram_recovery_probability(self.cfg, self.window_k)
        # The failed set grows from a surviving window_k-before set: P(ok | ok before) = p_now / window_p.
        cond = p_now / self.window_p if self.window_p > 0 else 0.0
        self.stats.expected_durable_fallbacks += 1.0 - cond
        self.window_p = p_now
        return ev.u < cond

    def memstore_restore(self, ev: FailureEvent, progress: float, committed: float) -> tuple[float, float]:
        """memstore: (restored progress, load seconds) after ``ev``: from peer RAM, else the newest spill."""
        stats = self.stats
        if self.ram_recovers(ev):
            stats.ram_recoveries += 1
            stats.lost_rollback_seconds += progress - committed
            return committed, self.cfg.ram_load_seconds
        self.window_lost = True
        stats.durable_fallbacks += 1
        stats.lost_fallback_seconds += progress - self.durable
        return self.durable, self.storage_s

    def baseline_restore(self, progress: float, committed: float) -> tuple[float, float]:
        """baseline: (restored progress, load seconds): the newest completed storage write."""
        self.stats.durable_fallbacks += 1
        self.stats.lost_rollback_seconds += progress - committed
        return committed, self.storage_s

    def on_failure(self, ev: FailureEvent) -> None:
        """Account everything up to ``ev`` and restart the job from the checkpoint it recovers."""
        b = ev.time
        stats = self.stats
        if self.memstore:
            self.settle_spills(b, failing=True)
        stats.failure_events += 1
        stats.host_failures += ev.hosts
        if b < self.resume_at:
            stats.failures_during_recovery += 1
        progress, committed = self.close_phase(b)
        if self.memstore:
            restore, load = self.memstore_restore(ev, progress, committed)
        else:
            restore, load = self.baseline_restore(progress, committed)
        self.base = restore
        self.rec_start = b
        self.resume_at = b + self.cfg.restart_seconds + load
        # Replicas are whole again once the first checkpoint after the restart is committed.
        self.window_end = self.resume_at + self.cad.period + self.cad.lag

    def finish(self) -> RunStats:
        """Account the rest of the run up to the horizon."""
        if self.memstore:
            self.settle_spills(self.horizon, failing=False)
        progress, _ = self.close_phase(self.horizon)
        self.stats.useful_seconds = progress
        return self.stats


def simulate(cfg: SimConfig, trace: Sequence[FailureEvent], strategy: str) -> RunStats:
    """Replay ``trace`` for one strategy (``"memstore"`` or ``"baseline"``)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")
    replay = _Replay(cfg, strategy)
    for ev in trace:
        if ev.time >= replay.horizon:
            break
        replay.on_failure(ev)
    return replay.finish()


# --------------------------------------------------------------------------------------------------
# Trials and summaries
# --------------------------------------------------------------------------------------------------


@dataclass
class StrategySummary:
    """A strategy over all trials of one host count. GPU-hours are per run (mean over trials);
    event counts are totals over all trials."""

    strategy: str
    trials: int
    ettr_mean: float
    ettr_min: float
    ettr_max: float
    ettr_stdev: float
    stall_overhead: float  # mean fraction of wall time spent in checkpoint stalls
    wasted_gpu_hours: dict[str, float]  # per run: checkpoint_stall, lost_work, restart_recovery, total
    failure_events: int
    host_failures: int
    failures_during_recovery: int
    ram_recoveries: int
    durable_fallbacks: int
    expected_durable_fallbacks: float
    lost_work_rollback_gpu_hours: float
    lost_work_fallback_gpu_hours: float
    seconds_lost_per_failure: float  # mean (lost work + restart/recovery) wall seconds per failure event

    @property
    def failures_per_run(self) -> float:
        return self.failure_events / self.trials


@dataclass
class PointResult:
    """Both strategies for one host count."""

    config: SimConfig
    strategies: dict[str, StrategySummary]
    runs: dict[str, list[RunStats]] = field(repr=False, default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        cfg = asdict(self.config)
        return {
            "hosts": self.config.hosts,
            "gpus": self.config.gpus,
            "config": cfg,
            "derived": self.config.derived(),
            "strategies": {name: {**asdict(s), "failures_per_run": s.failures_per_run} for name, s in self.strategies.items()},
        }


def summarize(cfg: SimConfig, runs: Sequence[RunStats]) -> StrategySummary:
    to_gpu_hours = cfg.gpus / SECONDS_PER_HOUR
    n = len(runs)
    ettrs = [r.ettr for r in runs]

    def mean(values: Sequence[float]) -> float:
        return math.fsum(values) / n

    stall = mean([r.stall_seconds for r in runs]) * to_gpu_hours
    lost = mean([r.lost_seconds for r in runs]) * to_gpu_hours
    recovery = mean([r.recovery_seconds for r in runs]) * to_gpu_hours
    events = sum(r.failure_events for r in runs)
    return StrategySummary(
        strategy=runs[0].strategy,
        trials=n,
        ettr_mean=mean(ettrs),
        ettr_min=min(ettrs),
        ettr_max=max(ettrs),
        ettr_stdev=statistics.stdev(ettrs) if n > 1 else 0.0,
        stall_overhead=mean([r.stall_seconds / r.wall_seconds for r in runs]),
        wasted_gpu_hours={
            "checkpoint_stall": stall,
            "lost_work": lost,
            "restart_recovery": recovery,
            "total": stall + lost + recovery,
        },
        failure_events=events,
        host_failures=sum(r.host_failures for r in runs),
        failures_during_recovery=sum(r.failures_during_recovery for r in runs),
        ram_recoveries=sum(r.ram_recoveries for r in runs),
        durable_fallbacks=sum(r.durable_fallbacks for r in runs),
        expected_durable_fallbacks=math.fsum(r.expected_durable_fallbacks for r in runs),
        lost_work_rollback_gpu_hours=mean([r.lost_rollback_seconds for r in runs]) * to_gpu_hours,
        lost_work_fallback_gpu_hours=mean([r.lost_fallback_seconds for r in runs]) * to_gpu_hours,
        seconds_lost_per_failure=math.fsum(r.lost_seconds + r.recovery_seconds for r in runs) / events if events else 0.0,
    )


def run_point(cfg: SimConfig, *, keep_runs: bool = False) -> PointResult:
    """All trials of one host count: each trial draws one trace and replays it for both strategies."""
    per_strategy: dict[str, list[RunStats]] = {s: [] for s in STRATEGIES}
    for trial in range(cfg.trials):
        trace = failure_trace(cfg, trial_rng(cfg.seed, cfg.hosts, trial))
        for strategy in STRATEGIES:
            per_strategy[strategy].append(simulate(cfg, trace, strategy))
    return PointResult(
        config=cfg,
        strategies={s: summarize(cfg, runs) for s, runs in per_strategy.items()},
        runs=per_strategy if keep_runs else {},
    )


def run_sweep(base: SimConfig, hosts: Sequence[int], rate_for_hosts: Callable[[int], float] | None = None) -> list[PointResult]:
    """:func:`run_point` for every host count; ``rate_for_hosts`` maps a host count to its per-GPU rate
    (default: ``base.failures_per_gpu_hour`` everywhere)."""
    out = []
    for n in hosts:
        cfg = replace(base, hosts=n)
        if rate_for_hosts is not None:
            cfg = replace(cfg, failures_per_gpu_hour=rate_for_hosts(n))
        out.append(run_point(cfg))
    return out
