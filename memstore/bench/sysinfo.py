"""The machine and its processes: CPU model and pressure, process memory from /proc, a memory/CPU monitor.

Standard library only at module level (the helper processes import it too)."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import socket
import threading
import time
from pathlib import Path

from memstore.bench.results import CpuPressure, CpuReport, MachineInfo, ProcMemory, RunConditions


def _mem_total() -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def cpu_pressure() -> CpuPressure | None:
    """The 'some' line of /proc/pressure/cpu: share of time runnable tasks waited for a CPU."""
    with contextlib.suppress(OSError, ValueError, IndexError, KeyError):
        for line in Path("/proc/pressure/cpu").read_text().splitlines():
            if line.startswith("some"):
                fields = dict(item.split("=") for item in line.split()[1:])
                return CpuPressure(avg10=float(fields["avg10"]), avg60=float(fields["avg60"]), total_us=float(fields["total"]))
    return None


def _cpu_busy_seconds() -> tuple[float, float] | None:
    """(busy, steal) CPU seconds of the whole machine since boot, from /proc/stat."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
        hz = os.sysconf("SC_CLK_TCK")
        return (user + nice + system + irq + softirq) / hz, steal / hz
    return None


def _own_cpu_seconds() -> float:
    """CPU seconds of this process and of its reaped children (stores, helpers, restore processes)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _loadavg() -> tuple[float, float, float] | None:
    return os.getloadavg() if hasattr(os, "getloadavg") else None


class CpuWindow:
    """CPU conditions over a stretch of the run: PSI pressure, load average, and the CPU time taken by
    processes other than this bench and its children (other work on the machine)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.pressure0 = cpu_pressure()
        self.busy0 = _cpu_busy_seconds()
        self.own0 = _own_cpu_seconds()
        self.load0 = _loadavg()

    def report(self) -> CpuReport:
        elapsed = time.monotonic() - self.t0
        pressure = cpu_pressure()
        busy = _cpu_busy_seconds()
        own = _own_cpu_seconds() - self.own0
        ncpu = os.cpu_count() or 1
        out = CpuReport(
            seconds=elapsed,
            cpu_pressure_start=self.pressure0,
            cpu_pressure_end=pressure,
            cpu_pressure_some_share=None,
            loadavg_start=self.load0,
            loadavg_end=_loadavg(),
            bench_cpu_seconds=own,
            other_cpu_seconds=None,
            other_cpu_share_of_machine=None,
            steal_seconds=None,
        )
        if self.pressure0 and pressure and elapsed > 0:
            out.cpu_pressure_some_share = (pressure.total_us - self.pressure0.total_us) / 1e6 / elapsed
        if self.busy0 and busy and elapsed > 0:
            other = max(0.0, (busy[0] - self.busy0[0]) - own)
            out.other_cpu_seconds = other
            out.other_cpu_share_of_machine = other / (elapsed * ncpu)
            out.steal_seconds = busy[1] - self.busy0[1]
        return out


def machine_info() -> MachineInfo:
    import grpc
    import numpy as np
    import torch

    thp = {}
    for name in ("enabled", "shmem_enabled"):
        with contextlib.suppress(OSError):
            thp[name] = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
    shm = shutil.disk_usage("/dev/shm") if os.path.isdir("/dev/shm") else None
    return MachineInfo(
        cpu_count=os.cpu_count(),
        cpu_affinity=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        cpu_model=_cpu_model(),
        ram_bytes=_mem_total(),
        dev_shm_bytes=shm.total if shm else None,
        python=platform.python_version(),
        torch=torch.__version__,
        torch_threads=torch.get_num_threads(),
        numpy=np.__version__,
        grpcio=grpc.__version__,
        platform=platform.platform(),
        hostname=socket.gethostname(),
        transparent_hugepage=thp,
    )


_STATUS_KEYS = {"VmRSS": "rss", "RssAnon": "rss_anon", "RssFile": "rss_file", "RssShmem": "rss_shmem", "VmHWM": "rss_peak"}
_PSS_KEYS = {"Pss": "pss", "Pss_Anon": "pss_anon", "Pss_File": "pss_file", "Pss_Shmem": "pss_shmem"}


def _kib_fields(path: str, keys: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in Path(path).read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in keys:
            out[keys[name]] = int(rest.split()[0]) * 1024
    return out


def proc_memory(pid: int) -> ProcMemory | None:
    """RSS (VmRSS and its RssAnon / RssFile / RssShmem parts, VmHWM) from /proc/<pid>/status and PSS (and its
    anonymous / file / shmem parts) from /proc/<pid>/smaps_rollup, in bytes; None if the process is gone."""
    try:
        values = _kib_fields(f"/proc/{pid}/status", _STATUS_KEYS)
    except (OSError, ValueError, IndexError):
        return None
    with contextlib.suppress(OSError, ValueError, IndexError):
        values.update(_kib_fields(f"/proc/{pid}/smaps_rollup", _PSS_KEYS))
    return ProcMemory(**values)


def _pss(pid: int) -> int:
    mem = proc_memory(pid)
    return (mem.pss or 0) if mem else 0


def _children(ppid: int) -> list[int]:
    out = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{entry.name}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == ppid:
                    out.append(int(entry.name))
    return out


def _is_local(host: str) -> bool:
    local = {"127.0.0.1", "localhost", "::1", "0.0.0.0", socket.gethostname()}
    with contextlib.suppress(OSError):
        local.update(socket.gethostbyname_ex(socket.gethostname())[2])
    return host in local


def _listening_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A = LISTEN
                    inodes.add(f"socket:[{f[9]}]")
    return inodes


def _pid_with_socket(inodes: set[str]) -> int | None:
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                for fd in os.scandir(f"/proc/{entry.name}/fd"):
                    with contextlib.suppress(OSError):
                        if os.readlink(fd.path) in inodes:
                            return int(entry.name)
    return None


def listening_pid(address: str) -> int | None:
    """The pid of the local process listening on ``address`` (a loopback or local HOST:PORT), or None."""
    host, _, port_text = address.rpartition(":")
    if not _is_local(host.strip("[]")) or not port_text.isdigit():
        return None
    inodes = _listening_inodes(int(port_text))
    return _pid_with_socket(inodes) if inodes else None


class Monitor:
    """Samples, every ``interval`` s, the memory of this process and its children (PSS, so pages
    shared by a store and the client count once); remembers the peak, overall and since ``reset_window``."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.phase = "start"
        self.peak_bytes = 0
        self.peak_phase = ""
        self.window_peak_bytes = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-monitor", daemon=True)
        self.cpu = CpuWindow()

    def __enter__(self) -> Monitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def reset_window(self) -> None:
        self.window_peak_bytes = 0

    def sample(self) -> None:
        total = sum(_pss(pid) for pid in [os.getpid(), *_children(os.getpid())])
        self.samples += 1
        self.window_peak_bytes = max(self.window_peak_bytes, total)
        if total > self.peak_bytes:
            self.peak_bytes = total
            self.peak_phase = self.phase

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(Exception):
                self.sample()

    def report(self) -> RunConditions:
        cpu = self.cpu.report()
        return RunConditions(
            memory_peak_pss_bytes=self.peak_bytes,
            memory_peak_phase=self.peak_phase,
            memory_samples=self.samples,
            cpu_pressure_start=cpu.cpu_pressure_start,
            cpu_pressure_end=cpu.cpu_pressure_end,
            cpu_pressure_some_share_during_run=cpu.cpu_pressure_some_share,
            loadavg_start=cpu.loadavg_start,
            loadavg_end=cpu.loadavg_end,
            bench_cpu_seconds=cpu.bench_cpu_seconds,
            other_cpu_seconds=cpu.other_cpu_seconds,
            other_cpu_share_of_machine=cpu.other_cpu_share_of_machine,
            steal_seconds=cpu.steal_seconds,
        )
