"""``memstore simulate``: a seeded, event-driven scale simulator of checkpoint/recovery strategies.

:mod:`memstore.sim.replay` is the model (plain Python, deterministic per seed), :mod:`memstore.sim.report`
renders tables / JSON / plots and :mod:`memstore.sim.cli` is the ``memstore simulate`` command.
:mod:`memstore.sim.protocol` models the restore protocol's messages and restart time at scale
(``memstore simulate protocol``, flags in :mod:`memstore.sim.protocol_cli`). :mod:`memstore.sim.redundancy_compare`
replays the same traces under several redundancy schemes (``--compare-redundancy``).
"""

from memstore.sim.protocol import ProtocolConfig, ProtocolCost, ProtocolPoint, run_protocol, run_protocol_sweep
from memstore.sim.redundancy_compare import SchemeResult, compare, comparison_schemes
from memstore.sim.replay import (
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
    "ProtocolConfig",
    "ProtocolCost",
    "ProtocolPoint",
    "RunStats",
    "SchemeResult",
    "SimConfig",
    "StrategySummary",
    "compare",
    "comparison_schemes",
    "failure_trace",
    "failures_per_gpu_hour_from_job",
    "ram_recovery_probability",
    "run_point",
    "run_protocol",
    "run_protocol_sweep",
    "run_sweep",
    "simulate",
    "trial_rng",
]
