"""memstore: 2 stores on 127.0.0.1 (``memstore bench``'s :func:`~memstore.bench.rig.start_cluster`, R=2); the
trainer saves to its host's store (h0) with ``CheckpointClient.save`` (``capture="copied"``). Stall: until save()
returns; survives a host loss: ``handle.wait()`` (both copies committed). Restores: ``memstore bench``'s own, in a new
process: ``load()`` from h0 after a trainer crash; SIGKILL h0 (its RAM gone), start its empty replacement and
``load()`` from it, served from h1's copy."""

from __future__ import annotations

from typing import Any

from benchmarks.peers.common import HOSTS, REPLICAS, Context, process_memory, tree_bytes

JOB = "peers"
KEEP = 2


class MemstoreSystem:
    name = "memstore"

    def __init__(self) -> None:
        self.cluster: Any = None
        self.client: Any = None
        self.ctx: Context | None = None

    def version(self) -> str:
        from importlib.metadata import version

        return f"memstore {version('memstore')}"

    def unavailable(self) -> str | None:
        return None

    def start(self, ctx: Context) -> None:
        from memstore.bench.rig import start_cluster, wait_idle
        from trainer_client import CheckpointClient, Connection

        self.ctx = ctx
        self.cluster = start_cluster(HOSTS, REPLICAS, KEEP, ctx.nbytes, None, {})
        wait_idle(self.cluster)
        self.client = CheckpointClient(JOB, 0, 1, connection=Connection(self.cluster.address("h0")))

    def save(self, step: int, state: Any) -> Any:
        return self.client.save(step, state)

    def wait_durable(self, token: Any) -> dict[str, Any]:
        from memstore.bench.measure import commit_timeout
        from memstore.bench.rig import wait_settled

        assert self.ctx is not None
        result = token.wait(timeout=commit_timeout(self.ctx.nbytes))
        wait_settled(self.cluster, JOB, KEEP)  # retention settles before the next save, as a training step later
        return {"copies": int(result.copies), "nbytes": int(result.nbytes)}

    def memory(self) -> dict[str, Any]:
        procs = {h: process_memory(sp.proc.pid) for h, sp in self.cluster.stores.items() if sp.proc is not None}
        return {"servers": procs, "shm_bytes": tree_bytes(self.cluster.shm_dir)}

    def restore_local(self) -> dict[str, Any]:
        from memstore.bench.measure import restore_local

        assert self.ctx is not None
        return one_run(restore_local(self.cluster, JOB, self.ctx.fingerprint, 1, self.ctx.timeout))

    def restore_after_loss(self) -> dict[str, Any]:
        from memstore.bench.measure import restore_after_host_loss

        assert self.ctx is not None
        return one_run(restore_after_host_loss(self.cluster, JOB, self.ctx.fingerprint, 1, KEEP, self.ctx.timeout))

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.cluster is not None:
            self.cluster.stop()


def one_run(summary: dict[str, Any]) -> dict[str, Any]:
    """memstore bench's summary of one restore, as the runner reports every system's."""
    (run,) = summary["runs"]
    return {**run, "verified_equal": summary["verified_equal"]}
