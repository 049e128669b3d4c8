"""The CPU a measured interval took: per process (the trainer, which is this process, and each store) and on the
whole machine, from ``/proc`` (Linux; elsewhere nothing is measured).

Why the bench reports it: on a machine with few cores, a save whose trainer, owner and replica share them is bound
by their CPU, not by the wire. ``cores_busy`` near 1 says every core was busy for the whole save, and
``tcp_over_cpu_floor`` is the best save -> committed over raw TCP those CPU seconds allow there.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import TracebackType

PROC = Path("/proc")
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# /proc/stat's cpu line: user nice system idle iowait irq softirq steal ...; busy is everything but idle and iowait.
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


def process_seconds(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) process ``pid`` has used; None if it cannot be read."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / _TICKS


def machine_seconds() -> float | None:
    """Busy CPU seconds of the whole machine since boot, all cores; None if ``/proc/stat`` cannot be read."""
    try:
        line = (PROC / "stat").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    values = [int(v) for v in line.split()[1:]]
    return sum(values[i] for i in _BUSY_FIELDS if i < len(values)) / _TICKS


class CpuMeter:
    """``with CpuMeter({"h0": pid, ...}) as cpu: ...``: then ``cpu.report()`` is the CPU seconds each named process,
    this one (``trainer``) and the machine (``machine``) used inside the block, and the wall seconds (``wall``)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._start: dict[str, float | None] = {}
        self._took: dict[str, float | None] = {}
        self._wall = 0.0

    def _sample(self) -> dict[str, float | None]:
        times = os.times()
        sample = {name: process_seconds(pid) for name, pid in self.pids.items()}
        return sample | {"trainer": times.user + times.system, "machine": machine_seconds()}

    def __enter__(self) -> CpuMeter:
        self._start = self._sample()
        self._wall = time.perf_counter()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._wall = time.perf_counter() - self._wall
        end = self._sample()
        self._took = {k: None if v is None or end[k] is None else end[k] - v for k, v in self._start.items()}  # type: ignore[operator]

    def report(self, cpus: int) -> dict[str, float | None]:
        """The seconds each used, the wall seconds, and ``cores_busy``: the machine's busy seconds over wall x ``cpus``."""
        machine = self._took.get("machine")
        busy = None if machine is None or self._wall <= 0 else machine / (self._wall * cpus)
        return self._took | {"wall": self._wall, "cores_busy": busy}
