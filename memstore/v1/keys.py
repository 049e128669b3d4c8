"""Validation of names that cross the wire. Both sides apply the same rules; each raises its own
typed error from the message returned here.
"""

from __future__ import annotations

import re

JOB_ID_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,128}")
HOST_ID_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")
TIMELINE_PATTERN = re.compile(r"[A-Za-z0-9._-]{0,128}")


def timeline_problem(timeline: str) -> str | None:
    """Why ``timeline`` (the save a shard belongs to; "" allowed) is not valid, or None."""
    if not isinstance(timeline, str) or not TIMELINE_PATTERN.fullmatch(timeline) or timeline in {".", ".."}:
        return f"timeline {timeline!r} is invalid: expected 0-128 characters of [A-Za-z0-9._-], not '.' or '..'"
    return None


def job_id_problem(job_id: str) -> str | None:
    if not isinstance(job_id, str) or not JOB_ID_PATTERN.fullmatch(job_id) or job_id in {".", ".."}:
        return f"job_id {job_id!r} is invalid: expected 1-128 characters of [A-Za-z0-9._-], not '.' or '..'"
    return None


def key_problem(job_id: str, step: int, rank: int, world_size: int | None = None, timeline: str = "") -> str | None:
    """Return why (job_id, step, rank[, world_size][, timeline]) is not a valid shard address, or None."""
    problem = job_id_problem(job_id) or timeline_problem(timeline)
    if problem:
        return problem
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"step {step!r} is invalid: expected an int >= 0"
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        return f"world_size {world_size!r} is invalid: expected an int >= 1"
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        return f"rank {rank!r} is invalid: expected an int >= 0"
    if world_size is not None and rank >= world_size:
        return f"rank {rank} is invalid: expected 0 <= rank < world_size ({world_size})"
    return None
