"""The small interface every system implements, and what the runner measures with it: memory and fresh processes.

A system is driven by the runner (:mod:`benchmarks.peers.run`) in this order: :meth:`System.start`, then
``saves`` x (:meth:`System.save`, :meth:`System.wait_durable`), :meth:`System.memory`, :meth:`System.restore_local`,
:meth:`System.restore_after_loss` (which loses the saving host first), :meth:`System.stop`. The restores run in a
fresh python process (:mod:`benchmarks.peers.child`, or memstore's own restore process); each reports its seconds,
timed from the restore call, and the restored state's fingerprint, compared with the saved one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from memstore.bench.rig import RestoreProcess
from memstore.bench.state import module_env

HOSTS, REPLICAS = 2, 2


class Unavailable(Exception):
    """The system cannot run here; the message says exactly why (the import error, the missing engine...)."""


@dataclass
class Context:
    """What a system gets to start with: where to keep its files, the state's size and fingerprint."""

    workdir: Path
    nbytes: int
    fingerprint: str
    timeout: float
    spec: dict[str, Any] = field(default_factory=dict)  # the StateSpec, for a system whose trainer is another process
    notes: list[str] = field(default_factory=list)  # what the system did differently from the brief, and why


class System(Protocol):
    name: str

    def version(self) -> str:
        """The installed version of the system (and of what it runs on)."""

    def unavailable(self) -> str | None:
        """Why the system cannot run here, or None."""

    def start(self, ctx: Context) -> None:
        """Start its servers or agents: 2 hosts on 127.0.0.1, R=2 where it replicates."""

    def save(self, step: int, state: Any) -> Any:
        """Save ``state`` as ``step``; return once the trainer may go on (the stall); a token for wait_durable."""

    def wait_durable(self, token: Any) -> dict[str, Any]:
        """Block until the save survives the loss of the saving host; what it knows of that (copies, bytes)."""

    def memory(self) -> dict[str, Any]:
        """Its server and agent processes' memory (:func:`process_memory`) and the shared memory it holds."""

    def restore_local(self) -> dict[str, Any]:
        """The newest save restored in a fresh process on the saving host: ``seconds``, ``fingerprint``."""

    def restore_after_loss(self) -> dict[str, Any]:
        """Lose the saving host, then restore in a fresh process as its replacement: ``seconds``, ``fingerprint``."""

    def stop(self) -> None:
        """Stop everything it started and remove its files."""


def process_memory(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon and RssShmem of ``pid`` in bytes (zeros when it is gone)."""
    out = {"rss": 0, "anon": 0, "shmem": 0}
    names = {"VmRSS:": "rss", "RssAnon:": "anon", "RssShmem:": "shmem"}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                key = line.split(":", 1)[0] + ":"
                if key in names:
                    out[names[key]] = int(line.split()[1]) << 10
    except OSError:
        pass
    return out


def trainer_memory(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The trainer's memory from two :func:`process_memory` readings: before its first save and after its saves."""
    return {
        "rss_before": before["rss"], "rss_after": after["rss"], "rss_added": after["rss"] - before["rss"],
        "anon_added": after["anon"] - before["anon"], "shmem": after["shmem"],
    }  # fmt: skip


def tree_bytes(path: str | Path) -> int:
    """Bytes allocated by the files under ``path`` (a shared-memory directory)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


class ChildProcess(RestoreProcess):
    """A fresh process speaking memstore's restore-process JSON lines (ready after importing torch, then commands):
    :mod:`benchmarks.peers.child` (one restore with the system's own code) or a peer's rank. It runs in a session of
    its own, ended whole by :meth:`close`."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**module_env(), **(env or {})},
            start_new_session=True,
        )  # fmt: skip
        self.buf = b""

    def close(self) -> None:
        """End the child and whatever it started (a peer's agent holds its pipes open): its own process group."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.communicate(timeout=30)


def restore_in_child(system: str, spec: dict[str, Any], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Restore with ``system``'s ``restore_here(spec)`` in a fresh process: its report (seconds, fingerprint, rss)."""
    child = ChildProcess([sys.executable, "-m", "benchmarks.peers.child", system], env)
    try:
        ready = child.read(timeout=120.0)
        child.send({"system": system, "spec": spec})
        return {**child.read(timeout=timeout), "import_seconds": ready["import_seconds"]}
    finally:
        child.close()


def keys_as_str(state: Any) -> Any:
    """``state`` with every dict key a str: DCP restores the optimizer's integer state keys as strings."""
    if isinstance(state, dict):
        return {str(k): keys_as_str(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(keys_as_str(v) for v in state)
    return state


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str) + "\n"
