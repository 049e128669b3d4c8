"""The same-host control channel against real stores: used by default, robust to garbage, gone with the store."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import grpc
import pytest
import torch

from memstore.testing import LocalCluster, wait_for
from memstore.v1 import store_pb2 as pb
from memstore.v1.channel import store_stub
from memstore.v1.local_control import recv_response, send_request
from trainer_client import CheckpointClient
from trainer_client.errors import CapacityExceededError
from trainer_client.transport.local_control_client import LocalStub

pytestmark = pytest.mark.integration


def hello(cluster: LocalCluster, host: str) -> pb.HelloResponse:
    channel, stub = store_stub(cluster.address(host))
    with channel:
        return stub.Hello(pb.HelloRequest(), timeout=10)


def test_a_client_on_the_machine_saves_and_loads_over_the_socket(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="64MiB")
    path = hello(cluster, "h0").control_socket
    assert path.endswith(".sock") and Path(path).is_socket()
    with CheckpointClient("lc", 0, 1, store=cluster.address("h0")) as c:
        assert c._link.local is not None
        calls: list[str] = []
        real = c._link.local.call

        def counted(name, request, timeout=None):  # type: ignore[no-untyped-def]
            calls.append(name)
            return real(name, request, timeout)

        c._link.local.call = counted  # type: ignore[method-assign]
        state = {"w": torch.arange(1000, dtype=torch.float32)}
        assert c.save(3, state).wait(timeout=30).copies == 2
        assert torch.equal(c.load(3)["w"], state["w"])
        assert {"Allocate", "Commit", "WaitCommitted", "Open", "Release"} <= set(calls)
        # A save that does not fit gets the same typed error, with the numbers, as over gRPC.
        with pytest.raises(CapacityExceededError) as err:
            c.save(4, {"big": torch.zeros(20 << 20)})  # 80 MiB > 64 MiB
        assert err.value.needed and err.value.capacity == 64 << 20
    cluster.stop()
    assert not Path(path).exists()  # the store removes its socket when it exits


def test_garbage_on_the_socket_is_dropped_and_the_store_keeps_serving(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=1, replicas=1, capacity="64MiB")
    path = hello(cluster, "h0").control_socket
    for junk in (b"\xff\xff\xff\xff" + b"x" * 16, struct.pack("<I", 3) + b"\x01\xff\xff", b"\x05\x00"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(path)
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            try:
                assert s.recv(64) == b""  # the store hung up on it
            except ConnectionResetError:
                pass  # ... before reading all of it
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # a method it does not know: a status, not a crash
        s.settimeout(5)
        s.connect(path)
        send_request(s, 99, "", b"")
        status, _ = recv_response(s)
        assert status == grpc.StatusCode.UNIMPLEMENTED.value[0]
        send_request(s, 1, "", b"\xff\xff\xff")  # not an AllocateRequest
        status, _ = recv_response(s)
        assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    stub = LocalStub(path)
    with pytest.raises(grpc.RpcError) as err:
        stub.call("Allocate", pb.AllocateRequest(key=pb.ShardKey(job_id="../x", step=1, rank=0), world_size=1, nbytes=8), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "job_id" in (err.value.details() or "")
    stub.close()
    with CheckpointClient("after", 0, 1, store=cluster.address("h0")) as c:
        c.save(1, {"x": torch.ones(3)}).wait(timeout=30)


def test_without_the_socket_the_save_path_uses_grpc(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=1, replicas=1, capacity="64MiB", extra_args=["--no-local-control"])
    assert hello(cluster, "h0").control_socket == ""
    with CheckpointClient("grpc", 0, 1, store=cluster.address("h0")) as c:
        assert c._link.local is None and c.stats().shared_memory
        c.save(1, {"x": torch.ones(3)}).wait(timeout=30)
        assert torch.equal(c.load(1)["x"], torch.ones(3))


def test_a_client_falls_back_to_grpc_when_the_socket_goes_away(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=1, replicas=1, capacity="64MiB")
    with CheckpointClient("gone", 0, 1, store=cluster.address("h0")) as c:
        local = c._link.local
        assert local is not None
        local.close()
        local.path = "/nonexistent/memstore.sock"  # the next connect fails before anything is sent
        c.save(1, {"x": torch.ones(3)}).wait(timeout=30)
        assert c._link.local is None
        wait_for(lambda: c.latest_step() == 1, timeout=10, what="step 1 restorable")
