"""What the kubelet's gRPC probe sees of a store's --health-listen port."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def probe(address: str, service: str) -> str:
    """``grpc.health.v1.Health/Check`` of ``service`` at ``address``: SERVING, NOT_SERVING, or the error code's name."""
    with grpc.insecure_channel(address) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        except grpc.RpcError as err:
            return str(err.code().name)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))
