"""Saves 1..N of one job, each timed from the ``save()`` call: the stall (call -> return) and call -> committed
(call -> ``SaveHandle.wait()`` returned), each paired with a memcpy of the same bytes right before it.

Save 1 is the first save of a fresh job on freshly started stores (nothing warms anything up before it), saves
2..keep+2 are the ones before the store's segment pool can recycle a segment, the rest the steady state."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memstore.bench import rpc
from memstore.bench.cluster import Stores, wait
from memstore.bench.scenario_results import SaveSample
from memstore.bench.state import copy_all
from memstore.bench.units import MiB

if TYPE_CHECKING:
    import torch

    from trainer_client import CheckpointClient

FIRST, EARLY, STEADY = "first", "early", "steady"


def phase_of(index: int, keep: int) -> str:
    """Save ``index + 1``'s phase: save 1, saves 2..keep+2, or the steady state after them."""
    return FIRST if index == 0 else EARLY if index <= keep + 1 else STEADY


def commit_timeout(shard_bytes: int) -> float:
    return 60.0 + shard_bytes / (10 * MiB)


@dataclass
class SeriesSpec:
    """What a series saves and how: ``count`` saves of ``state`` (``state_bytes`` of tensors, ``shard_bytes`` on the wire)."""

    state: Any
    tensors: list[torch.Tensor]
    state_bytes: int
    shard_bytes: int
    count: int
    keep: int
    first_step: int = 1
    paired: torch.Tensor | None = None  # a pre-faulted buffer for the paired memcpy (None: no memcpy, e.g. 10,000 tensors)


def one_save(client: CheckpointClient, spec: SeriesSpec, index: int, errors: list[str]) -> SaveSample:
    """A paired memcpy (when asked), then one save timed from the call: stall, and call -> committed."""
    from trainer_client.errors import ReplicationError

    paired = None
    if spec.paired is not None:
        t = time.perf_counter()
        copy_all(spec.paired, spec.tensors)
        paired = time.perf_counter() - t
    step = spec.first_step + index
    t0 = time.perf_counter()
    handle = client.save(step, spec.state)
    t1 = time.perf_counter()
    error = ""
    try:
        copies = int(handle.wait(timeout=commit_timeout(spec.shard_bytes)).copies)
    except (ReplicationError, TimeoutError) as exc:
        # A real outcome (e.g. a peer's PrepareReceive timing out): recorded, and the run goes on.
        error = str(exc)
        info = getattr(handle, "_info", None)  # the last status wait() saw
        copies = int(info.copies) if info is not None else 0
        errors.append(f"save of step {step}: {error}")
    t2 = time.perf_counter()
    rep = t2 - t1
    return SaveSample(
        step=step,
        phase=phase_of(index, spec.keep),
        save_wall_seconds=t1 - t0,
        stall_seconds=handle.stall_seconds,
        committed_seconds=t2 - t0,
        copies=copies,
        replication_seconds=rep,
        replication_bytes_per_second=spec.shard_bytes / rep if rep > 0 else float("nan"),
        paired_memcpy_seconds=paired,
        error=error,
        stall_over_memcpy=(t1 - t0) / paired if paired else None,
        committed_bytes_per_second=spec.state_bytes / (t2 - t0),
    )


def save_series(
    client: CheckpointClient, spec: SeriesSpec, stores: Stores, errors: list[str], each: Callable[[int], None] | None = None
) -> list[SaveSample]:
    """``spec.count`` saves; after each, retention settles (the oldest of keep steps is dropped everywhere) so the next
    save can reuse its segment, as a trainer's next save comes a training step later."""
    addresses = stores.addresses()
    samples: list[SaveSample] = []
    for i in range(spec.count):
        samples.append(one_save(client, spec, i, errors))
        wait(lambda: rpc.settled(addresses, client.job_id, spec.keep), 60.0, 0.01, "retention to drop old steps")
        if each is not None:
            each(i)
    return samples
