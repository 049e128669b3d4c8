"""Child processes that die with the process that started them (stores of a LocalCluster, demo workers)."""

from __future__ import annotations

import os
import signal

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
