"""``--health-listen``: the standard gRPC health service (``grpc.health.v1``) on a plaintext port of its own.

Kubernetes' gRPC probes send no token and speak no TLS, and the store's own port wants both once security is
on. This server answers ``grpc.health.v1.Health/Check`` only, with no authentication: what it tells
(SERVING or NOT_SERVING) is all a caller learns.

- service ``""`` (liveness): SERVING while the engine's lock can be taken within ``LIVENESS_LOCK_SECONDS``;
  a deadlocked store says NOT_SERVING and the kubelet restarts it. Draining stores stay live.
- service ``memstore.v1.Store`` (readiness): SERVING when :meth:`Store.readiness` has no objection: serving,
  not draining, holding a slot, at least R holders in the slot table, and a repair pass under the current
  slot layout left nothing missing. A rolling replacement moves to the next store only once the new one
  says SERVING here.
- any other service: NOT_FOUND, as the health protocol asks.

``Watch`` is not offered (UNIMPLEMENTED): probes only ``Check``.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from memstore.errors import ConfigError
from memstore.server.store import Store

log = logging.getLogger(__name__)

LIVENESS_SERVICE = ""
READINESS_SERVICE = "memstore.v1.Store"
LIVENESS_LOCK_SECONDS = 5.0
HEALTH_THREADS = 4


class HealthServicer(health_pb2_grpc.HealthServicer):
    def __init__(self, store: Store) -> None:
        self.store = store

    def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext) -> health_pb2.HealthCheckResponse:
        if request.service == LIVENESS_SERVICE:
            ok = self.store.alive(LIVENESS_LOCK_SECONDS)
        elif request.service == READINESS_SERVICE:
            ok = not self.store.readiness()
        else:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"unknown service {request.service!r}: '' is liveness, {READINESS_SERVICE!r} readiness",
            )
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)


class HealthServer:
    """The health service on ``address`` (HOST:PORT, port 0 picks one); ``address`` is the bound one afterwards."""

    def __init__(self, address: str, store: Store) -> None:
        self._server = grpc.server(ThreadPoolExecutor(max_workers=HEALTH_THREADS, thread_name_prefix="health"))
        health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(store), self._server)
        host, _, _ = address.rpartition(":")
        bound = self._server.add_insecure_port(address)
        if bound == 0:
            raise ConfigError(f"--health-listen {address}: cannot bind (address in use or not local)")
        self.address = f"{host}:{bound}"

    def start(self) -> None:
        self._server.start()
        log.info("health service (grpc.health.v1) on %s", self.address)

    def stop(self, grace: float = 1.0) -> None:
        self._server.stop(grace).wait(grace + 1)
