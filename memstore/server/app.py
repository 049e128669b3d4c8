"""Run one store server: bind the gRPC port, start background tasks, stop cleanly on a signal."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from types import FrameType

import grpc

from memstore.config import StoreConfig
from memstore.errors import ConfigError, StoreError
from memstore.server.dataserver import DataServer
from memstore.server.servicer import StoreServicer
from memstore.server.store import Store
from memstore.spill import build_spiller
from memstore.spill.port import SpillListener
from memstore.v1 import store_pb2_grpc as pb_grpc
from memstore.v1.channel import SERVER_OPTIONS

log = logging.getLogger(__name__)

# Enough threads for every rank's blocking WaitCommitted plus concurrent pushes, pulls and reads.
SERVER_THREADS = 64


class StoreServer:
    """A store engine behind a gRPC server. ``address`` is the bound HOST:PORT (port 0 resolved)."""

    def __init__(self, config: StoreConfig, spill_listeners: Sequence[SpillListener] = ()) -> None:
        self._server = grpc.server(ThreadPoolExecutor(max_workers=SERVER_THREADS, thread_name_prefix="rpc"), options=SERVER_OPTIONS)
        host, _, port = config.listen.rpartition(":")
        bound = self._server.add_insecure_port(config.listen)
        if bound == 0:
            raise ConfigError(f"--listen {config.listen}: cannot bind (address in use or not local)")
        self.address = f"{host}:{bound}"
        if port == "0":
            # The cluster knows this host by its real port: rewrite our own entry in the peer list.
            peers = tuple((h, self.address if h == config.host_id else a) for h, a in config.peers)
            config = replace(config, listen=self.address, peers=peers)
        self.config = config
        self.store = Store(config, advertised_address=self.address)
        # The two tiers meet at memstore.spill.port; listeners (the DCP export) ride on the spill tier.
        self.store.durable = build_spiller(config, source=self.store, listeners=spill_listeners)
        self.data_server = DataServer(host, self.store)
        self.store.data_port = self.data_server.port
        pb_grpc.add_StoreServicer_to_server(StoreServicer(self.store), self._server)

    def check_peers(self, timeout: float = 2.0) -> None:
        """Refuse to start in a cluster whose layout differs from ours: silent misplacement is worse than an error.

        Unreachable peers are skipped (they check us when they start). Addresses are compared only for
        this host's own address, so peers reached through proxies or other names are fine.
        """
        ours = list(self.config.host_ids)
        for peer_id in self.store.peers.ids():
            peer = self.store.peers[peer_id]
            try:
                hello = peer.hello(timeout)
            except StoreError:
                continue
            if hello.host_id != peer_id:
                raise ConfigError(f"the store at {peer.address} is host {hello.host_id!r}, but --peers names it {peer_id!r}")
            if list(hello.peer_ids) != ours or hello.replicas != self.config.replicas or hello.placement != self.config.placement:
                raise ConfigError(
                    f"peer {peer_id} runs with a different cluster layout (hosts {list(hello.peer_ids)}, R={hello.replicas}, "
                    f"{hello.placement}); this store has hosts {ours}, R={self.config.replicas}, {self.config.placement}. "
                    "Every store must get the same --peers (same order), --replicas and --placement"
                )
            for other_id, address in zip(hello.peer_ids, hello.peer_addresses, strict=False):
                if address == self.address and other_id != self.config.host_id:
                    me = self.config.host_id
                    raise ConfigError(f"peer {peer_id} expects host {other_id!r} at {address}, not {me!r}: wrong --host-id?")

    def start(self) -> None:
        self._server.start()
        self.data_server.start()
        self.store.start()
        log.info(
            "store %s serving on %s (R=%d, capacity=%d, placement=%s)",
            self.config.host_id,
            self.address,
            self.config.replicas,
            self.config.capacity,
            self.config.placement,
        )

    def stop(self, grace: float = 2.0, keep_files: bool = False) -> None:
        """Stop serving and close the engine. ``keep_files``: leave the segments in use (and their sidecars)
        on the tmpfs for the next store of this host to adopt; otherwise every segment file is removed."""
        self._server.stop(grace).wait(grace + 1)
        self.data_server.close()
        self.store.pool.keep_files_on_close = keep_files  # read by SegmentPool.close(), which Store.close() calls
        self.store.close()

    def wait(self) -> None:
        self._server.wait_for_termination()


def serve(config: StoreConfig, ready_file: str | None = None, spill_listeners: Sequence[SpillListener] = ()) -> int:
    """Run until SIGINT/SIGTERM. Prints ``READY <host_id> <address>`` once serving."""
    server = StoreServer(config, spill_listeners)
    try:
        server.check_peers()
    except ConfigError:
        # Never served: leave what it adopted from a previous incarnation for a corrected restart.
        server.stop(grace=0, keep_files=True)
        raise
    server.start()
    done = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("store %s: signal %d, shutting down", config.host_id, signum)
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"READY {config.host_id} {server.address}", flush=True)
    if ready_file:
        with open(ready_file, "w") as fh:
            fh.write(server.address)
    sys.stdout.flush()
    while not done.wait(0.5):
        pass
    if server.store.durable is not None:
        # Preemption or pod deletion: persist the newest committed step before going away.
        t0 = time.monotonic()
        failures = server.store.flush(config.flush_grace_seconds)
        for failure in failures:
            log.error("flush on shutdown failed: %s", failure)
        log.info("flushed newest committed steps in %.2fs (%d failures)", time.monotonic() - t0, len(failures))
    # Clean exit: segment files go with the store unless --shm-keep-on-exit (a SIGKILL leaves them: adopted at restart).
    server.stop(keep_files=config.shm_keep_on_exit)
    return 0
