"""Child processes that die with the process that started them (stores of a LocalCluster, demo workers).

Trainer processes that import torch can fork from a forkserver that imported it once (:func:`forkserver`,
:func:`start_forked`): each is still a process of its own, which a demo or a fault SIGKILLs, without paying
torch's import (3-4 s of a core) again.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
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


def forkserver(preload: list[str]) -> ForkServerContext:
    """The context of children forked from one server process that imported ``preload`` (module names) once. The
    server starts with the first child and exits with this process (its children then die with it: :func:`start_forked`).
    A server this process started before serves as it is, and its children import what it lacks."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(preload)
    return ctx


def start_forked(ctx: ForkServerContext, main: Callable[[list[str]], int | None], argv: list[str], log: Path,
                 env: dict[str, str], name: str) -> BaseProcess:  # fmt: skip
    """Start ``main(argv)`` (a module-level function that calls :func:`die_with_parent` first) in a child forked from
    ``ctx``'s server, its output appended to ``log`` and ``env`` added to its environment. The child exits with
    ``main``'s code (1 on an exception, its traceback in ``log``), without the interpreter's teardown."""
    proc = ctx.Process(target=_run_forked, args=(main, argv, str(log), env), name=name)
    proc.start()
    return proc


def _run_forked(main: Callable[[list[str]], int | None], argv: list[str], log: str, env: dict[str, str]) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    os.environ.update(env)
    os.environ[PARENT_PID_ENV] = str(os.getppid())  # the server: it exits with the process that started it
    code = 1
    try:
        code = main(argv) or 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no teardown: a DDP reducer's destructor can deadlock there (memstore.demo.worker)
