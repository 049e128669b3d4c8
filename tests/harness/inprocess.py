"""N store servers inside the test process: real gRPC on 127.0.0.1, no child processes.

``InProcessCluster`` is a :class:`~memstore.testing.LocalCluster` whose stores are
:class:`memstore.server.app.StoreServer` objects started on threads of this process, built from the very
``memstore serve`` flags the subprocess cluster passes its children. Replication, repair, agreement and
discovery tests run on it without paying a Python start-up per store.

What a process boundary gives, it cannot: ``kill()`` stops a store abruptly (no drain, its segments removed),
which its peers see as a lost host, but a SIGKILL at a protocol point, a crash that leaves shared memory
behind, per-store environments (``MEMSTORE_FAULTS``) and per-store logs need the subprocess
``LocalCluster``. Those tests stay on it.
"""

from __future__ import annotations

import argparse
import shutil
import threading
from dataclasses import dataclass, field, fields

from memstore.cli import serve as serve_cli
from memstore.config import StoreConfig
from memstore.errors import ConfigError
from memstore.interop.dcp_export import DcpExport
from memstore.server.app import StoreServer
from memstore.testing import LocalCluster, wait_for


def store_config(args: list[str], env: dict[str, str]) -> StoreConfig:
    """The StoreConfig ``memstore serve ARGS`` builds (``args`` without the ``python -m memstore serve`` prefix),
    with ``env`` as its only environment."""
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    ns = parser.parse_args(args)
    return StoreConfig.load({f.name: getattr(ns, f.name) for f in fields(StoreConfig)}, env=env, config_file=ns.config)


@dataclass
class _Running:
    """One store of the cluster: its server once built, and what its start thread raised."""

    thread: threading.Thread
    server: StoreServer | None = None
    error: BaseException | None = None
    stopped: threading.Event = field(default_factory=threading.Event)


class InProcessCluster(LocalCluster):
    """A LocalCluster whose stores run in this process. ``servers[host_id]`` is a running store's StoreServer."""

    PORT_CLASH_RETRIES = 0  # a store thread that failed to bind is not killed like a process: no second start

    def __post_init__(self) -> None:
        super().__post_init__()
        self._running: dict[str, _Running] = {}
        self._lock = threading.Lock()

    @property
    def servers(self) -> dict[str, StoreServer]:
        return {h: r.server for h, r in self._running.items() if r.server is not None and not r.stopped.is_set()}

    def _spawn(self, host_id: str) -> None:
        sp = self.stores[host_id]
        extra = {k: v for k, v in {**(self.env or {}), **sp.env}.items() if not k.startswith("MEMSTORE_") or k == "MEMSTORE_FAULTS"}
        if extra:
            raise ValueError(f"in-process stores share the test's environment; use LocalCluster for {sorted(extra)}")
        config = store_config(sp.args[4:], env={**(self.env or {}), **sp.env})  # after `python -m memstore serve`
        running = _Running(threading.Thread(target=lambda: self._serve(host_id, config), name=f"start-{host_id}", daemon=True))
        self._running[host_id] = running
        running.thread.start()

    def _serve(self, host_id: str, config: StoreConfig) -> None:
        """Build, join and start one store, as ``memstore serve`` does; then, on a Drain RPC, leave and stop."""
        running = self._running[host_id]
        try:
            server = StoreServer(config, spill_listeners=[DcpExport()])
            try:
                server.join()
            except ConfigError:
                server.stop(grace=0, keep_files=True)  # never served: what it adopted stays for a corrected restart
                raise
            server.start()
        except BaseException as exc:
            running.error = exc
            running.stopped.set()
            return
        with self._lock:
            killed_while_starting = running.stopped.is_set()
            running.server = server
        if killed_while_starting:
            server.stop(grace=0)
            return
        while not running.stopped.is_set():
            if server.drain_requested.wait(0.1):
                server.leave()
                self._stop_one(host_id, keep_files=config.shm_keep_on_exit)
                return

    def _stop_one(self, host_id: str, grace: float = 0.0, keep_files: bool = False) -> None:
        running = self._running.get(host_id)
        if running is None:
            return
        with self._lock:
            if running.stopped.is_set():
                return
            running.stopped.set()
            server = running.server
        if server is not None:
            server.stop(grace=grace, keep_files=keep_files)

    def alive(self, host_id: str) -> bool:
        """Whether ``host_id``'s store is starting or serving (not stopped, killed or drained away)."""
        running = self._running.get(host_id)
        return running is not None and not running.stopped.is_set()

    def wait_healthy(self, host_id: str, timeout: float = 30.0) -> None:
        def ready() -> bool:
            running = self._running[host_id]
            if running.error is not None:
                raise RuntimeError(f"store {host_id} failed to start: {running.error!r}") from running.error
            if running.stopped.is_set():
                raise RuntimeError(f"store {host_id} stopped")
            h = self.health(host_id)
            # Serving starts inside server.start(), before _serve records the server: until then ``servers`` lacks it.
            return h is not None and h.serving and running.server is not None

        wait_for(ready, timeout, what=f"store {host_id} to serve")

    def kill(self, host_id: str, keep_memory: bool = False) -> None:
        """Stop the store at once, without a drain: its peers see a lost host. Its segments go with it
        (``keep_memory=True``, a crash that leaves shared memory behind, needs a real process: LocalCluster)."""
        if keep_memory:
            raise ValueError("kill(keep_memory=True) needs a store process: use LocalCluster")
        running = self._running.get(host_id)
        self._stop_one(host_id)
        if running is not None:
            running.thread.join(timeout=10)
        shutil.rmtree(self.segment_dir(host_id), ignore_errors=True)

    def stop(self, timeout: float = 10.0) -> None:
        for host_id in list(self._running):
            self._stop_one(host_id)
        for running in self._running.values():
            running.thread.join(timeout=timeout)
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        if self._own_workdir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def log_tail(self, host_id: str, lines: int = 40) -> str:
        return ""  # in-process stores log to the test's own log (pytest shows it on a failure)
