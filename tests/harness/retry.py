"""Start a heavy shared server (a Ray head, a store cluster) with one retry of the start alone.

On a loaded 2-core machine a start sometimes misses its deadline (a Ray GCS that does not write its port file in
time). Such a start is retried once, and the cause is logged and reported as a warning in pytest's summary, so a
flaky start is visible without failing the run. Only starts go through here: an assertion is never retried.
"""

from __future__ import annotations

import logging
import os
import signal
import warnings
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


def _children() -> set[int]:
    """Every live descendant process of this one (from /proc)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    parent[int(entry)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found: set[int] = set()
    frontier = {os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - found
        found |= frontier
    return found


def start_with_one_retry(start: Callable[[], T], what: str) -> T:
    """``start()``; if it raises, kill what the failed try left running (only processes it started), log the
    cause, and call ``start()`` once more. A second failure propagates."""
    before = _children()
    try:
        return start()
    except Exception as exc:
        cause = f"{what} failed to start ({type(exc).__name__}: {exc}); retrying the start once"
        log.warning(cause, exc_info=True)
        warnings.warn(cause, RuntimeWarning, stacklevel=2)
        for pid in _children() - before:  # a half-started server's processes, by id
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return start()
