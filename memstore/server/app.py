"""Run one store server: bind the gRPC port, start background tasks, stop cleanly on a signal."""

from __future__ import annotations

import faulthandler
import logging
import os
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
from memstore.errors import ConfigError
from memstore.membership import DiscoverySource
from memstore.membership.kube_node import node_failure_domain
from memstore.server.auth import Authenticator
from memstore.server.dataserver import DataServer
from memstore.server.discovery import ClusterFollower
from memstore.server.health import HealthServer
from memstore.server.local_control_server import LocalControlServer, control_socket_path
from memstore.server.metrics import MetricsServer, StoreMetrics
from memstore.server.servicer import StoreServicer
from memstore.server.store import Store
from memstore.spill import build_spiller
from memstore.spill.port import SpillListener
from memstore.v1 import store_pb2_grpc as pb_grpc
from memstore.v1.channel import SERVER_OPTIONS
from memstore.v1.security import Credentials, read_token_file

log = logging.getLogger(__name__)

# Enough threads for every rank's blocking WaitCommitted plus concurrent pushes, pulls and reads.
SERVER_THREADS = 64


class StoreServer:
    """A store engine behind a gRPC server. ``address`` is the bound HOST:PORT (port 0 resolved)."""

    def __init__(
        self, config: StoreConfig, spill_listeners: Sequence[SpillListener] = (), discovery: DiscoverySource | None = None
    ) -> None:
        """``discovery``: where the members come from when another runtime feeds them (e.g. ``FedMembers``);
        by default the source the config names (--peers, --peers-file, --discovery)."""
        self._server = grpc.server(ThreadPoolExecutor(max_workers=SERVER_THREADS, thread_name_prefix="rpc"), options=SERVER_OPTIONS)
        host, _, port = config.listen.rpartition(":")
        # Who may call (tokens -> roles) and what this store presents to its peers (the cluster token, its TLS identity).
        auth = Authenticator.from_files(config.auth_token_file, config.admin_token_file, config.job_tokens_file)
        credentials = Credentials(token=read_token_file(config.auth_token_file, "--auth-token-file") if config.auth_token_file else "",
                                  ca=config.tls_ca, cert=config.tls_cert, key=config.tls_key,
                                  server_name=config.tls_server_name)  # fmt: skip
        if config.tls_cert:
            bound = self._server.add_secure_port(config.listen, credentials.server_credentials(config.tls_client_auth))
        else:
            bound = self._server.add_insecure_port(config.listen)
        if bound == 0:
            raise ConfigError(f"--listen {config.listen}: cannot bind (address in use or not local)")
        self.address = f"{host}:{bound}"
        # --metrics-port: bound now, so a port in use stops the store before it builds anything else.
        self.metrics = StoreMetrics() if config.metrics_port else None
        self.metrics_server: MetricsServer | None = None
        if self.metrics is not None:
            try:
                self.metrics_server = self.metrics.serve(host, config.metrics_port)
            except ConfigError:
                self._server.stop(None)
                raise
        try:
            self._build(config, host, port, credentials, auth, spill_listeners, discovery)
        except BaseException:  # e.g. a store that refuses its configuration: nothing stays bound
            if self.metrics_server is not None:
                self.metrics_server.close()
            self._server.stop(None)
            raise

    def _build(
        self,
        config: StoreConfig,
        host: str,
        port: str,
        credentials: Credentials,
        auth: Authenticator,
        spill_listeners: Sequence[SpillListener],
        discovery: DiscoverySource | None,
    ) -> None:
        if port == "0":
            # The cluster knows this host by its real port: rewrite our own entry in the peer list.
            peers = tuple((h, self.address if h == config.host_id else a) for h, a in config.peers)
            config = replace(config, listen=self.address, peers=peers)
        if config.failure_domain_node_labels:  # Kubernetes: this host's label comes from its Node
            labels = config.failure_domain_node_labels
            label = node_failure_domain(labels)
            config = replace(config, failure_domain=label, failure_domain_node_labels="").validated()
            log.info("failure domain %r (labels %s of node %s)", label, labels, os.environ.get("NODE_NAME"))
        self.config = config
        self.store = Store(config, advertised_address=self.address, credentials=credentials, events=self.metrics)
        if self.metrics is not None:
            self.metrics.watch(self.store)
        self.health = HealthServer(config.health_listen, self.store) if config.health_listen else None
        # The two tiers meet at memstore.spill.port; listeners (the DCP export) ride on the spill tier, and the
        # store's events (its metrics) hear of every shard written.
        self.store.durable = build_spiller(
            config.spill_settings(), source=self.store, listeners=spill_listeners, observer=self.store.events
        )
        self.data_server = DataServer(host, self.store, tls=credentials.server_ssl_context(), port=config.data_port)
        self.store.data_port = self.data_server.port
        self.follower = ClusterFollower(self.store, config, discovery)
        self.drain_requested = threading.Event()
        servicer = StoreServicer(self.store, on_drain=self.drain_requested.set, auth=auth)
        pb_grpc.add_StoreServicer_to_server(servicer, self._server)
        self.local_control: LocalControlServer | None = None
        if config.local_control and self.store.pool.directory is not None:
            path = control_socket_path(str(self.store.pool.directory))
            try:
                self.local_control = LocalControlServer(path, servicer)
                self.store.control_socket = path
            except OSError as exc:  # e.g. a path longer than a socket address allows: gRPC serves the save path
                log.warning("no same-host control socket at %s (%s); clients use gRPC for the save path", path, exc)

    def join(self, timeout: float = 2.0) -> None:
        """Learn the members and the slot table, and refuse to start in a cluster that disagrees (``ClusterFollower.join``)."""
        self.follower.join(timeout)

    def start(self) -> None:
        self.store.prepare()  # adoption, and the reserve wanted before serving (--prefault)
        if self.health is not None:
            self.health.start()
        self._server.start()
        if self.local_control is not None:
            self.local_control.start()
        self.data_server.start()
        self.store.start()
        self.follower.start()
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
        self.follower.close()
        if self.health is not None:
            self.health.stop()
        self._server.stop(grace).wait(grace + 1)
        if self.local_control is not None:
            self.local_control.close()
        self.data_server.close()
        self.store.pool.keep_files_on_close = keep_files  # read by SegmentPool.close(), which Store.close() calls
        self.store.close()
        if self.metrics_server is not None:
            self.metrics_server.close()

    def leave(self) -> None:
        """Leave the cluster on purpose (SIGTERM, ``memstore drain``, a node that Ray or Kubernetes drains): refuse
        new saves and copies, flush the newest committed steps to the durable tier first (the cheapest
        insurance), then give every shard only this store holds another copy. Bounded by --flush-grace-seconds
        and --drain-grace-seconds; failures are logged, never raised. The server keeps serving reads."""
        config = self.config
        self.store.draining.set()  # from now on: no new saves or copies, readiness says draining
        if self.store.durable is not None:
            t0 = time.monotonic()
            failures = self.store.flush(config.flush_grace_seconds)
            for failure in failures:
                log.error("flush on shutdown failed: %s", failure)
            log.info("flushed newest committed steps in %.2fs (%d failures)", time.monotonic() - t0, len(failures))
        t0 = time.monotonic()
        try:
            lost = self.store.drain(config.drain_grace_seconds)
        except Exception:
            log.exception("drain failed; leaving without it")
            lost = []
        for failure in lost:
            log.error("drain: %s", failure)
        log.info("drained in %.2fs (%d shard(s) left without another copy)", time.monotonic() - t0, len(lost))

    def wait(self) -> None:
        self._server.wait_for_termination()


def serve(config: StoreConfig, ready_file: str | None = None, spill_listeners: Sequence[SpillListener] = ()) -> int:
    """Run until SIGINT/SIGTERM. Prints ``READY <host_id> <address>`` once serving."""
    # `kill -USR1 <pid>` writes every thread's stack to stderr: what a store that stopped answering is waiting on.
    # First thing: a store answers health checks before READY, and SIGUSR1 unhandled would end the process.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    server = StoreServer(config, spill_listeners)
    try:
        server.join()
    except ConfigError:
        # Never served: leave what it adopted from a previous incarnation for a corrected restart.
        server.stop(grace=0, keep_files=True)
        raise
    server.start()
    done = server.drain_requested  # set by a signal or by the Drain RPC (`memstore drain`)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("store %s: signal %d, draining and shutting down", config.host_id, signum)
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
    server.leave()
    # Clean exit: segment files go with the store unless --shm-keep-on-exit (a SIGKILL leaves them: adopted at restart).
    server.stop(keep_files=config.shm_keep_on_exit)
    return 0
