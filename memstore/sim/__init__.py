"""``memstore simulate``: a seeded, event-driven scale simulator of checkpoint/recovery strategies.

:mod:`memstore.sim.model` is the model (plain Python, deterministic per seed), :mod:`memstore.sim.report`
renders tables / JSON / plots and :mod:`memstore.sim.cli` is the ``memstore simulate`` command.
"""

from memstore.sim.model import (
    DEFAULT_FAILURE_DATA,
    FAILURE_DATA,
    STRATEGIES,
    Cadence,
    FailureData,
    FailureEvent,
    PointResult,
    RunStats,
    SimConfig,
    StrategySummary,
    failure_trace,
    failures_per_gpu_hour_from_job,
    ram_recovery_probability,
    run_point,
    run_sweep,
    simulate,
    trial_rng,
)

__all__ = [
    "DEFAULT_FAILURE_DATA",
    "FAILURE_DATA",
    "STRATEGIES",
    "Cadence",
    "FailureData",
    "FailureEvent",
    "PointResult",
    "RunStats",
    "SimConfig",
    "StrategySummary",
    "failure_trace",
    "failures_per_gpu_hour_from_job",
    "ram_recovery_probability",
    "run_point",
    "run_sweep",
    "simulate",
    "trial_rng",
]
