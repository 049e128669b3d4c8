"""DLRover Flash Checkpoint without its launcher: ``DdpCheckpointer`` in the trainer, whose engine forks its own saver
process (``engine.start_saver_process``: what it does when not started by ``dlrover-run``). A save copies the state
into the engine's shared memory (the stall) and the saver writes it to the checkpoint directory; the tracker file
``dlrover_latest.txt`` naming the step is the commit. DLRover replicates to other nodes' memory only with
``replica_count`` inside a multi-node ``torch.distributed`` job; one trainer process has no peer node, so the save
survives the loss of its host once the saver's write is committed, and only where the directory outlives the host.

Restores, in a fresh process: locally, as a trainer restarted by ``dlrover-run`` finds the agent alive
(``ROLE_NAME=dlrover-trainer``, the same ``TORCHELASTIC_RUN_ID``), ``load_checkpoint()`` reads the saver's shared
memory; after the host is lost (the saver killed, its shared memory and sockets gone, the files' pages evicted), a
new trainer with its own saver reads the committed file.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from benchmarks.peers.common import Context, process_memory, restore_in_child

SOCKETS = "/tmp/ckpt_sock"  # dlrover.python.common.multi_process.SOCKET_TMP_DIR
TRACKER = "dlrover_latest.txt"  # CheckpointConstant.TRACER_FILE_NAME
FACTORY = "sharedqueue_factory.sock"  # the saver process's factory queue: the engine's first message goes there
KEPT: list[Any] = []


class DlroverSystem:
    name = "dlrover"

    def __init__(self) -> None:
        self.ctx: Context | None = None
        self.checkpointer: Any = None
        self.job = f"peers{os.getpid()}-{time.monotonic_ns()}"
        self.directory: Path | None = None
        self.saved_env: str | None = None

    def version(self) -> str:
        from importlib.metadata import version

        return f"dlrover {version('dlrover')}"

    def unavailable(self) -> str | None:
        try:
            imports()
        except ImportError as exc:
            return f"ImportError: {exc}"
        return None

    def start(self, ctx: Context) -> None:
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer

        self.ctx = ctx
        self.directory = ctx.workdir / "ckpt"
        self.saved_env = os.environ.get("TORCHELASTIC_RUN_ID")
        for attempt in (1, 2):
            os.environ["TORCHELASTIC_RUN_ID"] = self.job  # its shared memory and sockets are this run's
            self.start_saver()
            try:
                self.checkpointer = DdpCheckpointer(str(self.directory))
                break
            except TimeoutError as exc:  # the engine's 60 s wait for its saver (see start_saver): once more, afresh
                ctx.notes.append(f"engine start {attempt} failed after 60 s: TimeoutError: {exc}")
                if attempt == 2:
                    raise
                self.end_saver()
                self.job += "-retry"
        ctx.notes.append(
            "no launcher: the saver process is the engine's own start_async_save, spawned (forked by the engine, it "
            "now and then never answered: 'TimeoutError: Timed out waiting for socket server: ckpt_lock_rank_0'); "
            "no replica (replica_count needs a multi-node torch.distributed job): survives a host loss = the saver's "
            "disk write committed (dlrover_latest.txt), not fsynced by DLRover"
        )

    def start_saver(self) -> None:
        """The engine's saver process (``engine.start_async_save``, what ``engine.start_saver_process()`` runs),
        spawned rather than forked, and waited for. Left to the engine, it is forked from this multi-threaded
        process, and now and then never answers: the engine waits 60 s and raises "TimeoutError: Timed out waiting
        for socket server: ckpt_lock_rank_0" (seen here on dlrover 0.6.1, twice in four starts)."""
        import multiprocessing

        from dlrover.trainer.torch.flash_checkpoint import engine

        proc = multiprocessing.get_context("spawn").Process(target=engine.start_async_save, daemon=True)
        proc.start()
        factory = Path(SOCKETS) / self.job / FACTORY
        deadline = time.monotonic() + 60.0
        while not factory.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"DLRover's saver process did not create {factory} within 60 s")
            time.sleep(0.005)
        engine.CheckpointEngine.saver_proc = proc

    def save(self, step: int, state: Any) -> Any:
        from dlrover.trainer.torch.flash_checkpoint.ddp import StorageType

        assert self.directory is not None
        self.checkpointer.save_checkpoint(step, state, storage_type=StorageType.DISK)  # its default path: <step>/rank_0.pt
        return step

    def wait_durable(self, token: Any) -> dict[str, Any]:
        assert self.ctx is not None and self.directory is not None
        tracker = self.directory / TRACKER
        deadline = time.monotonic() + self.ctx.timeout
        while not (tracker.exists() and tracker.read_text().strip() == str(token)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"DLRover's saver did not commit step {token} within {self.ctx.timeout:.0f} s")
            time.sleep(0.005)
        return {"file_bytes": (self.directory / str(token) / "rank_0.pt").stat().st_size}

    def saver_pid(self) -> int | None:
        from dlrover.trainer.torch.flash_checkpoint import engine

        proc = engine.CheckpointEngine.saver_proc
        return proc.pid if proc is not None else None

    def shm_path(self) -> Path:
        return Path("/dev/shm") / f"{self.job}_{shm_prefix()}0"

    def memory(self) -> dict[str, Any]:
        pid = self.saver_pid()
        shm = self.shm_path()
        return {"servers": {"saver": process_memory(pid)} if pid else {}, "shm_bytes": shm.stat().st_blocks * 512 if shm.exists() else 0}

    def restore_local(self) -> dict[str, Any]:
        assert self.ctx is not None
        env = {"TORCHELASTIC_RUN_ID": self.job, "ROLE_NAME": "dlrover-trainer"}
        return restore_in_child("dlrover", {"directory": str(self.directory)}, self.ctx.timeout, env)

    def lose_host(self) -> None:
        from benchmarks.peers.system_dcp import evict

        pid = self.saver_pid()
        if pid:
            kill(pid)
        self.shm_path().unlink(missing_ok=True)
        shutil.rmtree(os.path.join(SOCKETS, self.job), ignore_errors=True)
        assert self.directory is not None
        for step in self.directory.iterdir():
            if step.is_dir():
                evict(step)

    def restore_after_loss(self) -> dict[str, Any]:
        assert self.ctx is not None
        self.lose_host()
        env = {"TORCHELASTIC_RUN_ID": f"{self.job}-replacement", "ROLE_NAME": ""}
        try:
            return restore_in_child("dlrover", {"directory": str(self.directory)}, self.ctx.timeout, env)
        finally:
            shutil.rmtree(os.path.join(SOCKETS, f"{self.job}-replacement"), ignore_errors=True)
            (Path("/dev/shm") / f"{self.job}-replacement_{shm_prefix()}0").unlink(missing_ok=True)

    def end_saver(self) -> None:
        """Kill the saver and remove its shared memory and sockets."""
        from dlrover.trainer.torch.flash_checkpoint import engine

        pid = self.saver_pid()
        if pid:
            kill(pid)
        engine.CheckpointEngine.saver_proc = None
        self.shm_path().unlink(missing_ok=True)
        shutil.rmtree(os.path.join(SOCKETS, self.job), ignore_errors=True)

    def stop(self) -> None:
        self.end_saver()
        if self.saved_env is None:
            os.environ.pop("TORCHELASTIC_RUN_ID", None)
        else:
            os.environ["TORCHELASTIC_RUN_ID"] = self.saved_env


def kill(pid: int) -> None:
    """SIGKILL the saver process and reap it (it is this process's child)."""
    from dlrover.trainer.torch.flash_checkpoint import engine

    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    proc = engine.CheckpointEngine.saver_proc
    if proc is not None and proc.pid == pid:
        proc.join(timeout=10)


def shm_prefix() -> str:
    from dlrover.python.elastic_agent.torch.ckpt_saver import CheckpointSharedObjPrefix

    return str(CheckpointSharedObjPrefix.SHM_NAME)


def imports() -> None:
    """What a trainer restoring with DLRover has imported before it restores."""
    import dlrover.trainer.torch.flash_checkpoint.ddp  # noqa: F401


def restore_here(spec: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """In the fresh process: a new ``DdpCheckpointer`` on the directory, then ``load_checkpoint()``."""
    from dlrover.python.common.constants import CheckpointConstant
    from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer

    from_memory = (Path("/dev/shm") / f"{os.environ['TORCHELASTIC_RUN_ID']}_{shm_prefix()}0").exists()
    checkpointer = DdpCheckpointer(spec["directory"])
    KEPT.append(checkpointer)  # a state loaded from memory is views of its shared memory, closed with the engine
    state = checkpointer.load_checkpoint()
    if isinstance(state, dict) and set(state) == {CheckpointConstant.MODEL_STATES_NAME}:
        state = state[CheckpointConstant.MODEL_STATES_NAME]
    return state, {"source": "memory" if from_memory else "disk"}
