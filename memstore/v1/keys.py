"""Validation of names that cross the wire. Both sides apply the same rules; each raises its own
typed error from the message returned here.

Every id and name a store receives (job ids, host ids, timelines, shard keys, a manifest's metrics) is
checked with these before it reaches the engine; the durable layout (``memstore.spill.layout``) checks
the parts of a path once more on its own.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

JOB_ID_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,128}")
HOST_ID_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")
TIMELINE_PATTERN = re.compile(r"[A-Za-z0-9._-]{0,128}")
# Ranks of one job: the durable layout names a rank's files with 6 digits (rank-000000 .. rank-999999).
MAX_WORLD_SIZE = 1_000_000
# Metrics passed with save(): how many per shard, and how long a name may be.
MAX_METRICS = 1024
MAX_METRIC_NAME_CHARS = 256


def timeline_problem(timeline: str) -> str | None:
    """Why ``timeline`` (the save a shard belongs to; "" allowed) is not valid, or None."""
    if not isinstance(timeline, str) or not TIMELINE_PATTERN.fullmatch(timeline) or timeline in {".", ".."}:
        return f"timeline {timeline!r:.160} is invalid: expected 0-128 characters of [A-Za-z0-9._-], not '.' or '..'"
    return None


def job_id_problem(job_id: str) -> str | None:
    if not isinstance(job_id, str) or not JOB_ID_PATTERN.fullmatch(job_id) or job_id in {".", ".."}:
        return f"job_id {job_id!r:.160} is invalid: expected 1-128 characters of [A-Za-z0-9._-], not '.' or '..'"
    return None


def host_id_problem(host_id: str, what: str = "host id") -> str | None:
    """Why ``host_id`` (a store's --host-id, as named by a peer or a manifest) is not valid, or None."""
    if not isinstance(host_id, str) or not HOST_ID_PATTERN.fullmatch(host_id) or host_id in {".", ".."}:
        return f"{what} {host_id!r:.100} is invalid: expected 1-64 characters of [A-Za-z0-9._-], not '.' or '..'"
    return None


def ip_host_id(ip: str) -> str:
    """The host id of a store known only by its IP: ``10.0.0.7`` -> ``10-0-0-7`` (IPv6 ':' too), the name Kubernetes
    gives a pod without a hostname; DNS discovery and a store started without ``--host-id`` both use it."""
    return ip.strip("[]").replace(".", "-").replace(":", "-")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def key_problem(job_id: str, step: int, rank: int, world_size: int | None = None, timeline: str = "") -> str | None:
    """Return why (job_id, step, rank[, world_size][, timeline]) is not a valid shard address, or None."""
    problem = job_id_problem(job_id) or timeline_problem(timeline)
    if problem:
        return problem
    if not _is_int(step) or step < 0:
        return f"step {step!r} is invalid: expected an int >= 0"
    if world_size is not None and (not _is_int(world_size) or not 1 <= world_size <= MAX_WORLD_SIZE):
        return f"world_size {world_size!r} is invalid: expected an int in 1..{MAX_WORLD_SIZE} (MAX_WORLD_SIZE)"
    if not _is_int(rank) or not 0 <= rank < MAX_WORLD_SIZE:
        return f"rank {rank!r} is invalid: expected an int in 0..{MAX_WORLD_SIZE - 1}"
    if world_size is not None and rank >= world_size:
        return f"rank {rank} is invalid: expected 0 <= rank < world_size ({world_size})"
    return None


MAX_CAPTURE_COUNT = 1 << 20  # registrations or fallbacks one Commit may report (a client makes a handful)
MAX_CAUSE_CHARS = 512  # a reported fallback cause, as the CUDA runtime names it


def capture_problem(registrations: int, fallbacks: int, cause: str) -> str | None:
    """Why the capture counts a client reported with a Commit cannot be taken (out of range, a cause too long), or None."""
    for name, value in (("registrations", registrations), ("fallbacks", fallbacks)):
        if not 0 <= value <= MAX_CAPTURE_COUNT:
            return f"capture.{name} {value} is out of range: a commit reports 0..{MAX_CAPTURE_COUNT} (MAX_CAPTURE_COUNT)"
    if len(cause) > MAX_CAUSE_CHARS or "\0" in cause:
        return f"capture.fallback_cause is invalid: at most {MAX_CAUSE_CHARS} characters (MAX_CAUSE_CHARS), no NUL"
    return None


def metrics_problem(metrics: Mapping[str, float]) -> str | None:
    """Why the metrics passed with a save cannot be kept (too many, a name too long or empty), or None."""
    if len(metrics) > MAX_METRICS:
        return f"{len(metrics)} metrics were passed with the save: at most {MAX_METRICS} (MAX_METRICS) per shard"
    for name in metrics:
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_METRIC_NAME_CHARS or "\0" in name:
            return f"metric name {name!r:.80} is invalid: expected 1..{MAX_METRIC_NAME_CHARS} characters (MAX_METRIC_NAME_CHARS), no NUL"
    return None
