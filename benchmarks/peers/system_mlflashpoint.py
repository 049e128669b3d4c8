"""ml-flashpoint (its PyPI sdist, C++ core built here): a 2-rank gloo job, one rank per host, as its PyTorch DCP guide
sets it up (``MemoryStorageWriter`` over ``DefaultMLFlashpointCheckpointSaver``, ``ReplicationManager``,
``DefaultMLFlashpointCheckpointLoader``), with pairwise replication: rank 0 (the trainer, on h0) saves the state,
rank 1 (on h1) saves an empty one and holds rank 0's replica.

Two hosts on one machine need two filesystems: ml-flashpoint keeps a checkpoint as buffer files under a base path and
its transfer service writes a replica at the *same path* on the peer, so with one shared ``/dev/shm`` the replica
would land on the original. Each host is therefore a private mount namespace (``unshare -m``) holding its own tmpfs
at the base path, kept by a holder process; ranks enter it with ``nsenter``. Losing a host kills its holder and
ranks: its tmpfs, and every checkpoint in it, is gone.

Its trainer is rank 0, another process: it builds the same state from the same spec (the fingerprints are compared)
and times its own ``dcp.save`` (the stall; ml-flashpoint's sync save: the async one runs the save in a separate
process); survives a host loss: until h1 holds every file of the checkpoint (rank 1 polls them; the adapter does not
hand back its replication futures). Restores restart the whole job (both ranks in fresh processes, as torchrun does),
timed on rank 0 from ``get_latest_complete_checkpoint`` (which retrieves what the host lacks from its peer) to the
state loaded (``_load_state_dict_from_keys`` over its ``MemoryStorageReader``); joining the job is reported apart.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from typing import Any

from benchmarks.peers.common import ChildProcess, Context, process_memory, trainer_memory

TMPFS = "size=50%"


class Host:
    """A private mount namespace with a tmpfs at ``base``, held by a ``sleep`` (its pid enters it)."""

    def __init__(self, base: str) -> None:
        script = f"mount -t tmpfs -o {TMPFS} peers-mlf {base} && echo mounted && exec sleep infinity"
        self.base = base
        self.proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", script], stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if b"mounted" not in line:
            self.proc.kill()
            raise RuntimeError(f"could not mount a private tmpfs at {base} (unshare -m): {self.proc.communicate()}")

    def used(self) -> int:
        st = os.statvfs(f"/proc/{self.proc.pid}/root{self.base}")
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def rank(self, rank: int, port: int) -> ChildProcess:
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2", "NNODES": "2", "LOCAL_RANK": "0"}
        argv = ["nsenter", "-t", str(self.proc.pid), "-m", sys.executable, "-m", "benchmarks.peers.mlf_rank"]
        return ChildProcess(argv, {**env, "PEERS_MLF_BASE": self.base})

    def lose(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


def ask(procs: list[ChildProcess], cmds: list[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
    """Send each rank its command (a collective: all are sent first), then read every answer."""
    for p, c in zip(procs, cmds, strict=True):
        p.send(c)
    answers = [p.read(timeout=timeout) for p in procs]
    errors = [a["error"] for a in answers if "error" in a]
    if errors:
        raise RuntimeError(f"ml-flashpoint rank failed: {errors[0]}")
    return answers


class MlFlashpointSystem:
    name = "ml-flashpoint"

    def __init__(self) -> None:
        self.ctx: Context | None = None
        self.base = f"/tmp/peers-mlf-{os.getpid()}"
        self.hosts: list[Host] = []
        self.ranks: list[ChildProcess] = []
        self.built: dict[str, Any] = {}

    def version(self) -> str:
        from importlib.metadata import version

        return f"ml-flashpoint {version('ml-flashpoint')}"

    def unavailable(self) -> str | None:
        try:
            import ml_flashpoint.adapter.pytorch.memory_storage_writer
            import ml_flashpoint.replication.transfer_service  # noqa: F401
        except ImportError as exc:
            return f"ImportError: {exc}"
        if not shutil.which("unshare") or not shutil.which("nsenter"):
            return "needs unshare and nsenter (util-linux) to give each host its own tmpfs"
        return None

    def join(self) -> list[dict[str, Any]]:
        """Both ranks, fresh processes on their hosts, in a new job: their answers to init."""
        from memstore.testing import free_ports

        assert self.ctx is not None
        self.end_ranks()
        (port,) = free_ports(1)
        self.ranks = [h.rank(i, port) for i, h in enumerate(self.hosts)]
        ready = [r.read(timeout=120.0) for r in self.ranks]
        answers = ask(self.ranks, [{"op": "init", "nbytes": self.ctx.nbytes}] * 2, self.ctx.timeout)
        return [{**a, "import_seconds": r["import_seconds"]} for a, r in zip(answers, ready, strict=True)]

    def start(self, ctx: Context) -> None:
        self.ctx = ctx
        os.makedirs(self.base, exist_ok=True)
        self.hosts = [Host(self.base), Host(self.base)]
        self.join()
        (self.built,) = ask(self.ranks[:1], [{"op": "build", "spec": ctx.spec}], ctx.timeout)
        if self.built["fingerprint"] != ctx.fingerprint:
            raise RuntimeError("rank 0 built a state other than the runner's (fingerprints differ)")

    def save(self, step: int, state: Any) -> Any:
        assert self.ctx is not None
        return ask(self.ranks, [{"op": "save", "step": step}] * 2, self.ctx.timeout)[0]

    def wait_durable(self, token: Any) -> dict[str, Any]:
        assert self.ctx is not None
        (held,) = ask(self.ranks[1:], [{"op": "wait", "files": token["files"], "timeout": self.ctx.timeout}], self.ctx.timeout)
        self.last_memory = token["memory"]
        return {
            "stall_seconds": token["returned"] - token["started"], "durable_seconds": held["held"] - token["started"],
            "files": len(token["files"]), "nbytes": sum(token["files"].values()), "timed_in": "rank 0 (the trainer)",
        }  # fmt: skip

    def memory(self) -> dict[str, Any]:
        trainer = trainer_memory(self.built["memory"], process_memory(self.ranks[0].proc.pid))
        peer = process_memory(self.ranks[1].proc.pid)
        return {"trainer": trainer, "servers": {"rank 1 (h1)": peer}, "shm_bytes": sum(h.used() for h in self.hosts)}

    def restore(self) -> dict[str, Any]:
        assert self.ctx is not None
        joined = self.join()
        answer = ask(self.ranks, [{"op": "restore"}] * 2, self.ctx.timeout)[0]
        fingerprints = {k: answer[k] for k in ("fingerprint", "fingerprint_keys_as_str")}
        return {
            "seconds": answer["done"] - answer["started"], "join_seconds": joined[0]["init_seconds"], "checkpoint": answer["checkpoint"],
            "rss": answer["memory"]["rss"], "import_seconds": joined[0]["import_seconds"], **fingerprints,
        }  # fmt: skip

    def restore_local(self) -> dict[str, Any]:
        return self.restore()

    def restore_after_loss(self) -> dict[str, Any]:
        self.end_ranks()
        self.hosts[0].lose()
        self.hosts[0] = Host(self.base)
        return self.restore()

    def end_ranks(self) -> None:
        for r in self.ranks:
            r.close()
        self.ranks = []

    def stop(self) -> None:
        self.end_ranks()
        for h in self.hosts:
            h.lose()
        self.hosts = []
        try:
            os.rmdir(self.base)
        except OSError:
            pass


def imports() -> None:
    import ml_flashpoint.adapter.pytorch.memory_storage_writer  # noqa: F401
