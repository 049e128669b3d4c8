"""Restore from durable storage: stores of their own started with ``--spill file://DIR --spill-every-steps 1``, one
save of the state, the step spilled; then, before each restore, the step is removed from every store's RAM (Delete)
and a NEW process load()s it: the owner store pulls it from the spill."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from memstore.bench import rpc
from memstore.bench.child import restore_in_new_process
from memstore.bench.cluster import start_stores, wait
from memstore.bench.restores import restore_summary
from memstore.bench.scenario_results import DURABLE_ENDPOINTS_NOTE, DurableRestore, Endpoints, RestoreRun
from memstore.bench.series import SeriesSpec, one_save
from memstore.bench.state import nbytes_of, state_tensors
from memstore.bench.units import MiB

if TYPE_CHECKING:
    from memstore.bench.options import BenchConfig
    from memstore.bench.sysinfo import Monitor

JOB = "bench-durable"
NOTE = (
    "stores started with --spill file://DIR --spill-every-steps 1; one save, spilled; before each restore the step is "
    "deleted from every store's RAM; a new process load()s it (the owner pulls it from the spill), timed from its load call"
)


def measure_durable(
    config: BenchConfig, hosts: int, replicas: int, state: Any, fingerprint: str, shard_bytes: int, endpoints: Endpoints | None,
    command: str, restores: int, step_done: Callable[[str], None], monitor: Monitor,
) -> DurableRestore:  # fmt: skip
    """The restore from durable storage of ``state``; a failure is recorded (error), not raised."""
    if endpoints is not None:
        return DurableRestore(note=DURABLE_ENDPOINTS_NOTE)
    monitor.phase = "restore from durable storage"
    spill_dir = tempfile.mkdtemp(prefix="memstore-bench-spill-", dir=config.disk_dir)
    url = f"file://{spill_dir}"
    timeout = 120.0 + shard_bytes / (20 * MiB)
    stores = None
    try:
        stores = start_stores(config, hosts, replicas, shard_bytes, None, job=JOB, extra_args=["--spill", url, "--spill-every-steps", "1"])
        from trainer_client import CheckpointClient

        owner = stores.address(stores.hosts[0])
        tensors = state_tensors(state)
        errors: list[str] = []
        with CheckpointClient(stores.job, 0, 1, store=owner) as client:
            save = one_save(client, SeriesSpec(state, tensors, nbytes_of(tensors), shard_bytes, 1, config.keep), 0, errors)
        if save.error:
            raise RuntimeError(f"the save to spill did not reach R copies: {save.error}")
        t0 = time.perf_counter()
        wait(lambda: (rpc.spilled_step(owner, stores.job) or -1) >= save.step, timeout, 0.05, f"step {save.step} to be spilled")
        spilled = time.perf_counter() - t0
        step_done("durable: step spilled")
        runs: list[RestoreRun] = []
        deleted: list[int] = []
        for i in range(restores):

            def remove() -> None:
                deleted.append(sum(rpc.delete(a, stores.job, save.step) for a in stores.addresses()))
                # the step is restorable again only from the spill (LatestStep lists durable storage too)
                wait(lambda: rpc.latest_step(owner, stores.job) == save.step, 30.0, 0.05, "the spilled step to be listed")

            runs.append(restore_in_new_process(owner, stores.job, True, timeout, before=remove))
            monitor.sample()
            step_done(f"restore from durable storage {i + 1}/{restores}")
        return DurableRestore(
            available=True, note=NOTE, command=command, store_command=stores.command(), spill_url=url, save=save,
            spilled_seconds=spilled, deleted_copies=deleted, restore=restore_summary(runs, fingerprint),
        )  # fmt: skip
    except Exception as exc:  # a real outcome (the spill tier failing) must not lose the run
        if stores is not None:
            stores.dump_logs()
        return DurableRestore(available=False, note="failed", command=command, spill_url=url, error=repr(exc))
    finally:
        if stores is not None:
            stores.stop()
        shutil.rmtree(spill_dir, ignore_errors=True)
