"""Child processes that die with the process that started them (stores of a LocalCluster, demo workers)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

PARENT_PID_ENV = "MEMSTORE_PARENT_PID"


def child_env() -> dict[str, str]:
    """Environment for a child that must die with this process: it arms that itself (``die_with_parent``).

    Not a ``preexec_fn``: that forces a plain fork() of a process running gRPC threads, and gRPC's fork
    handlers then sometimes abort the child before it execs ("epoll_wait: Bad file descriptor").
    """
    return {PARENT_PID_ENV: str(os.getpid())}


def die_with_parent() -> None:
    """Called first thing by a child started with ``child_env()`` (``memstore ...``, the demo worker): SIGKILL
    when the process that started it dies (Linux), so a killed test run or demo never leaves stores behind."""
    parent = os.environ.pop(PARENT_PID_ENV, "")
    if not parent.isdigit():
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the parent died before the signal was armed
        os._exit(1)


def thread_dump(proc: subprocess.Popen[bytes] | None, log_path: Path, timeout: float = 5.0) -> str:
    """Every thread's stack of a live ``memstore serve`` child whose output goes to ``log_path``: it writes them on
    SIGUSR1 (``faulthandler``). For the message of a test that timed out waiting on it; says why when there is none."""
    if proc is None or proc.poll() is not None:
        return f"(no thread dump: the process has exited, code {None if proc is None else proc.returncode})"
    start = log_path.stat().st_size if log_path.exists() else 0
    os.kill(proc.pid, signal.SIGUSR1)
    deadline = time.monotonic() + timeout
    text, seen = "", False
    while time.monotonic() < deadline:
        with open(log_path, "rb") as fh:
            fh.seek(start)
            text = fh.read().decode(errors="replace")
        if seen:
            break  # faulthandler writes the whole dump at once: one more read after it shows takes all of it
        seen = "(most recent call first)" in text
        time.sleep(0.2)
    return text or f"(no thread dump from pid {proc.pid} within {timeout}s)"
