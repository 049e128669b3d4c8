"""Redundancy schemes side by side on the same failure traces: ``ec:K+M`` against replicas (issue 42).

``memstore simulate --redundancy ec:4+1 --compare-redundancy`` replays every trial's trace (the same traces: they
depend on the seed, the host count and the failure rates only) with memstore under each scheme and reports, per host
count and scheme: the RAM held per byte of checkpoint and per host, the hosts a group may lose, P(recover from RAM)
for one failed host and for a burst, the restore of a lost host (one peer's shard for replicas, K blocks per block
from the group's survivors for ``ec:K+M``), and ETTR. ``auto`` compares an ``ec:K+M`` scheme with the replicas that
survive as many losses (``replicas:M+1``, more RAM) and with the replicas that fit in its RAM (``replicas:1`` while
``M < K``: no copy at all).

Plain Python (the simulator's replay); rendering is :mod:`memstore.sim.report`'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from memstore.core.redundancy import Redundancy
from memstore.sim.replay import SimConfig, StrategySummary, failure_trace, ram_recovery_probability, simulate, summarize, trial_rng


@dataclass(frozen=True)
class SchemeResult:
    """One scheme at one host count (memstore only; GPU-hours per run, mean over trials)."""

    hosts: int
    redundancy: str
    ram_multiple: float  # RAM per byte of checkpoint, per kept step
    ram_gb_per_host: float  # per kept step
    survives: int  # hosts one group may lose at once
    p_recover_one: float  # P(recover from RAM) when one random host fails
    p_recover_burst: float  # ... when a burst of --burst-hosts fails
    restore_seconds: float  # a replacement host's restore from RAM
    replication_lag_seconds: float
    memstore: StrategySummary

    def to_dict(self) -> dict[str, Any]:
        s = self.memstore
        return {
            "hosts": self.hosts,
            "redundancy": self.redundancy,
            "ram_multiple": self.ram_multiple,
            "ram_gb_per_host": self.ram_gb_per_host,
            "survives": self.survives,
            "p_recover_one": self.p_recover_one,
            "p_recover_burst": self.p_recover_burst,
            "restore_seconds": self.restore_seconds,
            "replication_lag_seconds": self.replication_lag_seconds,
            "ettr": s.ettr_mean,
            "wasted_gpu_hours": s.wasted_gpu_hours["total"],
            "ram_recoveries": s.ram_recoveries,
            "durable_fallbacks": s.durable_fallbacks,
        }


def comparison_schemes(scheme: Redundancy, asked: str) -> list[Redundancy]:
    """The schemes to compare: ``scheme`` first, then those in ``asked`` (comma-separated texts, or ``auto``), each
    once. ``auto`` needs an ``ec:K+M`` scheme; a bad text raises ``ValueError`` naming it."""
    if asked.strip() == "auto":
        if not scheme.erasure_coded:
            raise ValueError(
                f"--compare-redundancy auto compares an ec:K+M --redundancy with replicas, not {scheme}; name the schemes instead"
            )
        others = [Redundancy.of_replicas(scheme.m + 1), Redundancy.of_replicas(math.floor(scheme.ram_multiple_per_step))]
    else:
        others = [Redundancy.parse(text) for text in asked.split(",")]
    out = [scheme]
    for other in others:
        if other not in out:
            out.append(other)
    return out


def compare(cfg: SimConfig, schemes: Sequence[Redundancy]) -> list[SchemeResult]:
    """Every scheme of ``schemes`` replayed on ``cfg``'s traces (``ValueError`` if one does not fit ``cfg``)."""
    traces = [failure_trace(cfg, trial_rng(cfg.seed, cfg.hosts, trial)) for trial in range(cfg.trials)]
    out = []
    for scheme in schemes:
        c = replace(cfg, replicas=scheme.replicas, redundancy=str(scheme))
        runs = [simulate(c, trace, "memstore") for trace in traces]
        out.append(
            SchemeResult(
                hosts=c.hosts,
                redundancy=str(scheme),
                ram_multiple=c.ram_multiple,
                ram_gb_per_host=c.ram_multiple * c.checkpoint_gb_per_host,
                survives=scheme.survives,
                p_recover_one=ram_recovery_probability(c, 1),
                p_recover_burst=ram_recovery_probability(c, c.effective_burst_hosts),
                restore_seconds=c.ram_load_seconds,
                replication_lag_seconds=c.replication_lag_seconds,
                memstore=summarize(c, runs),
            )
        )
    return out
