"""The bench's helper processes, which speak JSON lines (commands on stdin, reports on stdout):

    python -m memstore.bench.workers restore   # a restarted trainer: connects and load()s, timed
    python -m memstore.bench.workers leak      # the leak check's trainer: many saves, memory after each

The bench starts and talks to them with :class:`memstore.bench.child.Child`. Only the standard library is
imported at module level, so a restore process's import time is that of torch and trainer_client.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memstore.bench.jsonable import to_json
from memstore.bench.scenario_results import LeakSample, RestoreReport
from memstore.bench.sysinfo import proc_memory
from memstore.bench.units import MiB

MODULE = "memstore.bench.workers"


@dataclass
class RestoreCommand:
    """What the bench tells a ready restore process: load the newest step of ``job`` from ``address``."""

    address: str
    job: str
    zero_copy: bool
    wait_seconds: float = 120.0


@dataclass
class LeakConfig:
    """What the bench tells the leak check's process."""

    addresses: list[str]
    pids: dict[str, int | None]
    job: str
    size: int
    seed: int
    saves: int
    keep: int


def _emitter() -> Callable[[dict[str, Any]], None]:
    """stdout is the JSON-lines channel to the bench; anything else printing to stdout goes to stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def emit(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    return emit


def _wait_accepting(address: str, timeout: float) -> None:
    """Poll until ``address`` accepts TCP connections (a replacement store may still be starting)."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.005)


def restore_worker() -> None:
    """A restarted trainer process: imports, reports ready, waits for one command on stdin, then (timed) connects
    to the store and ``load()``s the latest step, and reports timings, its memory and the state's fingerprint."""
    emit = _emitter()
    t0 = time.perf_counter()
    import torch  # noqa: F401 - a trainer has torch loaded before it restores

    from trainer_client import CheckpointClient

    emit({"ready": True, "pid": os.getpid(), "import_seconds": time.perf_counter() - t0})
    from memstore.bench.state import state_fingerprint

    cmd = RestoreCommand(**json.loads(sys.stdin.readline()))
    _wait_accepting(cmd.address, float(cmd.wait_seconds))
    w_accept = time.time()
    t_accept = time.perf_counter()
    client = CheckpointClient(cmd.job, 0, 1, store=cmd.address, timeout=60.0)
    t_connected = time.perf_counter()
    state = client.load(zero_copy=bool(cmd.zero_copy))
    t_loaded = time.perf_counter()
    w_loaded = time.time()
    source = client.last_load_source or ""
    shared = client.shared_memory
    client.close()
    report = RestoreReport(
        accept_unix=w_accept,
        loaded_unix=w_loaded,
        connect_seconds=t_connected - t_accept,
        load_seconds=t_loaded - t_connected,
        connect_load_seconds=t_loaded - t_accept,
        source_host=source,
        shared_memory=shared,
        zero_copy=bool(cmd.zero_copy),
        memory_after_load=proc_memory(os.getpid()),
    )
    emit({**to_json(report), "fingerprint": state_fingerprint(state)})


def leak_worker() -> None:
    """The leak check's trainer: ``saves`` consecutive saves of one state; after each (committed, retention settled)
    it samples its own memory and that of the stores (pids given), one JSON line per save."""
    emit = _emitter()
    cfg = LeakConfig(**json.loads(sys.stdin.readline()))
    from memstore.bench.cluster import wait
    from memstore.bench.rpc import settled
    from memstore.bench.state import make_state
    from trainer_client import CheckpointClient
    from trainer_client.errors import ReplicationError

    state = make_state(cfg.size, cfg.seed)
    pids = {h: p for h, p in cfg.pids.items() if p}
    commit_timeout = 60.0 + cfg.size / (10 * MiB)
    emit({"ready": True, "pid": os.getpid()})
    client = CheckpointClient(cfg.job, 0, 1, store=cfg.addresses[0], timeout=60.0)
    try:
        for i in range(cfg.saves):
            t0 = time.perf_counter()
            handle = client.save(i + 1, state)
            t1 = time.perf_counter()
            error = ""
            try:
                copies = int(handle.wait(timeout=commit_timeout).copies)
            except ReplicationError as exc:
                error, copies = str(exc), 0
            wait(lambda: settled(cfg.addresses, cfg.job, cfg.keep), 60.0, 0.01, "retention to drop old steps")
            sample = LeakSample(
                save=i + 1,
                stall_seconds=t1 - t0,
                copies=copies,
                error=error,
                client=proc_memory(os.getpid()),
                stores={h: proc_memory(int(p)) for h, p in pids.items()},
            )
            emit(to_json(sample))
    finally:
        client.close()
    emit({"done": True})


WORKERS: dict[str, Callable[[], None]] = {"restore": restore_worker, "leak": leak_worker}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in WORKERS:
        print(f"usage: python -m {MODULE} {{{','.join(WORKERS)}}}", file=sys.stderr)
        return 2
    WORKERS[args[0]]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
