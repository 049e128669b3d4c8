"""Ranks as threads of one process, each with its member of one real gloo process group.

The collectives are the real ones (gloo over loopback, a HashStore rendezvous), without starting a torch
process per rank: how tests and ``tools.scale`` run dozens of ranks on a small machine.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import Any


def on_every_rank(count: int, fn: Callable[[int, Any], Any], timeout: float = 300) -> tuple[list[Any], float]:
    """Run ``fn(rank, group)`` for ``count`` ranks at once, each on its own thread with its member of one fresh gloo group.

    Returns each rank's result (the exception it raised, where it raised) and the seconds from the moment every
    group member existed to the last rank's finish. Raises TimeoutError if a rank is still running at the deadline.
    """
    import torch.distributed as dist

    rendezvous = dist.HashStore()
    results: list[Any] = [TimeoutError(f"rank did not finish within {timeout}s")] * count
    ready = threading.Barrier(count + 1)

    def run(rank: int) -> None:
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore("ranks", rendezvous), rank, count, datetime.timedelta(seconds=timeout))
            ready.wait()
            results[rank] = fn(rank, group)
        except BaseException as exc:
            results[rank] = exc
            ready.abort()

    threads = [threading.Thread(target=run, args=(r,), daemon=True, name=f"rank-{r}") for r in range(count)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    try:
        ready.wait(timeout)  # every group member exists: time from here
    except threading.BrokenBarrierError:
        pass  # a rank failed to join; its error is in results
    started = time.perf_counter()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    seconds = time.perf_counter() - started
    hung = [t.name for t in threads if t.is_alive()]
    if hung:
        raise TimeoutError(f"{', '.join(hung)} still running after {timeout}s")
    return results, seconds
