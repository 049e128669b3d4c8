"""A memory cgroup of our own, with a limit the kernel enforces: its OOM killer SIGKILLs a process that exceeds it.

    cg = MemoryCgroup.create("memstore-oom-123")   # raises Unavailable (with the reason) where this cannot work
    cg.add(pid)                                     # charges from now on count against the limit
    cg.limit(cg.usage() + 32 * 2**20)
    cg.oom_kills()                                  # how many processes the kernel's OOM killer took in it
    cg.remove()

cgroup v1 (``/sys/fs/cgroup/memory``): a child of this process's own memory cgroup. cgroup v2: a child of the
root of the unified hierarchy (v2 lets processes live only in leaves, so not below ours). Either needs root (or
a delegated hierarchy) and a writable cgroupfs; a container without them raises :class:`Unavailable`.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


class Unavailable(Exception):
    """A memory cgroup cannot be made here; the message says why."""


class MemoryCgroup:
    def __init__(self, path: Path, v1: bool) -> None:
        self.path = path
        self.v1 = v1

    @classmethod
    def create(cls, name: str) -> MemoryCgroup:
        v1 = (ROOT / "memory").is_dir() and not (ROOT / "cgroup.controllers").exists()
        if v1:
            parent = ROOT / "memory" / _own_v1_memory_cgroup().lstrip("/")
        elif (ROOT / "cgroup.controllers").exists():
            parent = ROOT
            if "memory" not in (ROOT / "cgroup.subtree_control").read_text().split():
                raise Unavailable(f"the memory controller is not enabled for children of {ROOT} (cgroup.subtree_control)")
        else:
            raise Unavailable(f"no cgroup memory controller mounted at {ROOT} (neither {ROOT}/memory nor cgroup v2)")
        path = parent / name
        try:
            path.mkdir()
        except OSError as exc:
            raise Unavailable(f"cannot create the cgroup {path} (uid {os.getuid()}): {exc.strerror}") from None
        return cls(path, v1)

    def _file(self, v1: str, v2: str) -> Path:
        return self.path / (v1 if self.v1 else v2)

    def add(self, pid: int) -> None:
        self._file("cgroup.procs", "cgroup.procs").write_text(f"{pid}\n")

    def limit(self, nbytes: int) -> None:
        self._file("memory.limit_in_bytes", "memory.max").write_text(f"{nbytes}\n")

    def usage(self) -> int:
        return int(self._file("memory.usage_in_bytes", "memory.current").read_text())

    def oom_kills(self) -> int:
        """Processes the kernel's OOM killer SIGKILLed in this cgroup so far."""
        text = self._file("memory.oom_control", "memory.events").read_text()
        counts = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
        return int(counts.get("oom_kill", 0))

    def remove(self, timeout: float = 5.0) -> None:
        """Remove the cgroup once its processes are gone (the memory still charged to it moves to its parent)."""
        deadline = time.monotonic() + timeout
        while self.path.exists():
            try:
                self.path.rmdir()
            except OSError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)


def _own_v1_memory_cgroup() -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return path
    raise Unavailable("/proc/self/cgroup lists no memory cgroup for this process")


def available() -> str | None:
    """None if a memory cgroup can be made and removed here, else why not."""
    try:
        cg = MemoryCgroup.create(f"memstore-probe-{os.getpid()}")
    except (Unavailable, OSError) as exc:
        return str(exc)
    with contextlib.suppress(OSError):
        cg.remove()
    return None
