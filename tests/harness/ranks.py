"""Run trainer ranks as real processes for tests: fast (forked from a preloaded forkserver) and always reaped."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

PROCESS_TIMEOUT = 120.0


def run_ranks(fn: Callable[..., None], nprocs: int, *args: Any, timeout: float = PROCESS_TIMEOUT) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` processes; raise if any fails or the deadline passes; always reap them."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fn.__name__} x{nprocs} did not finish within {timeout}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(10)


@contextlib.contextmanager
def forkserver_preloading(module: str) -> Iterator[None]:
    """Make rank processes fork from one forkserver that imported ``module`` (torch, DCP, ...) once.

    A spawned rank re-imports all of that (~4 s each on 2 cores); a forked one starts in well under a
    second. The server also imports ``torch._dynamo``, which torch imports on a process's first optimizer or DCP
    save (1.5-2.5 s of a core in every rank otherwise). The server is stopped (and reaped) afterwards if this call
    started it.
    """
    import multiprocessing
    import multiprocessing.forkserver as mp_forkserver

    server = getattr(mp_forkserver, "_forkserver", None)
    ours = server is not None and getattr(server, "_forkserver_pid", 0) is None
    if ours:
        multiprocessing.set_forkserver_preload(["torch._dynamo", module])
    try:
        yield
    finally:
        if ours and server is not None and hasattr(server, "_stop"):
            server._stop()
            multiprocessing.set_forkserver_preload([])


def forkserver_fixture(module: str) -> Any:
    """A module-scoped pytest fixture for a test module whose ranks run its own functions (``forkserver =
    forkserver_fixture(__name__)``, then ``@pytest.mark.usefixtures("forkserver")``): they fork from a server that
    imported ``module`` once (:func:`forkserver_preloading`)."""
    import pytest

    @pytest.fixture(scope="module")
    def forkserver() -> Iterator[None]:
        with forkserver_preloading(module):
            yield

    return forkserver
