"""Authentication, job isolation and TLS against real store processes on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from memstore.testing import LocalCluster
from memstore.v1 import store_pb2 as pb
from memstore.v1.channel import store_stub
from memstore.v1.security import Credentials
from tests.states import assert_same, rank_state
from tools.certs import make_tls
from trainer_client import CheckpointClient
from trainer_client.errors import AccessDeniedError, AuthenticationError, StoreUnavailableError
from trainer_client.transport.local_control_client import LocalStub

MiB = 1 << 20
pytestmark = pytest.mark.integration

CLUSTER, ADMIN = "cluster-token-0123456789abcdef", "admin-token-0123456789abcdef"
JOB_A, JOB_B = "job-a", "job-b"
TOKENS = {JOB_A: "job-a-token-0123456789abcdef", JOB_B: "job-b-token-0123456789abcdef"}


@pytest.fixture
def secured(make_cluster, tmp_path: Path) -> LocalCluster:
    (tmp_path / "cluster.token").write_text(CLUSTER + "\n")
    (tmp_path / "admin.token").write_text(ADMIN)
    (tmp_path / "jobs.json").write_text(json.dumps(TOKENS))
    args = ["--auth-token-file", str(tmp_path / "cluster.token"), "--admin-token-file", str(tmp_path / "admin.token"),
            "--job-tokens-file", str(tmp_path / "jobs.json")]  # fmt: skip
    cluster = make_cluster(hosts=2, replicas=2, capacity="128MiB", extra_args=args, credentials=Credentials(token=CLUSTER))
    # Job A saves two steps (rank 0 on h0, rank 1 on h1) with its own token: replication between stores works.
    for rank in (0, 1):
        with CheckpointClient(JOB_A, rank, 2, store=cluster.address(f"h{rank}"), auth_token=TOKENS[JOB_A], run_id="r", timeout=20) as c:
            for step in (1, 2):
                assert c.save(step, rank_state(rank, step)).wait(timeout=30).copies == 2
    return cluster


def call(cluster: LocalCluster, token: str | None, fn: Callable[[Any], Any]) -> grpc.StatusCode:
    channel, stub = store_stub(cluster.address("h0"), Credentials(token=token or ""))
    with channel:
        try:
            result = fn(stub)
            if hasattr(result, "__iter__") and not isinstance(result, (bytes, str)) and not hasattr(result, "ByteSize"):
                list(result)  # drain a server stream
            return grpc.StatusCode.OK
        except grpc.RpcError as err:
            detail = err.details() or ""
            for secret in (CLUSTER, ADMIN, *TOKENS.values()):
                assert secret not in detail  # never echoed
            return err.code()


def key(job: str = JOB_A, step: int = 2, rank: int = 0) -> pb.ShardKey:
    return pb.ShardKey(job_id=job, step=step, rank=rank, timeline="r.0")


def operations(job: str) -> dict[str, Callable[[Any], Any]]:
    """One request per operation a client can make on ``job`` (valid for job A's saved data)."""
    manifest = pb.Manifest(key=key(job, 9), world_size=2, nbytes=8, chunk_size=8, chunk_checksums=[0], checksum_algo="xxh3-64")
    header = pb.PutHeader(manifest=manifest, origin=pb.PUT_ORIGIN_CLIENT)
    return {
        "save (Allocate)": lambda s: s.Allocate(pb.AllocateRequest(key=key(job, 9), world_size=2, nbytes=8), timeout=5),
        "save (Put)": lambda s: s.Put(iter([pb.PutRequest(header=header), pb.PutRequest(chunk=b"12345678")]), timeout=5),
        "save (PrepareReceive)": lambda s: s.PrepareReceive(header, timeout=5),
        "load (Open)": lambda s: s.Open(pb.OpenRequest(key=key(job)), timeout=5),
        "load (Get)": lambda s: s.Get(pb.GetRequest(key=key(job)), timeout=5),
        "load (Fetch)": lambda s: s.Fetch(pb.FetchRequest(key=key(job)), timeout=5),
        "load (PrepareSend)": lambda s: s.PrepareSend(pb.GetRequest(key=key(job)), timeout=5),
        "latest": lambda s: s.LatestStep(pb.LatestStepRequest(job_id=job), timeout=5),
        "wait": lambda s: s.WaitCommitted(pb.WaitCommittedRequest(key=key(job), timeout_seconds=1), timeout=5),
        "list": lambda s: s.List(pb.ListRequest(job_id=job), timeout=5),
        "delete": lambda s: s.Delete(pb.DeleteRequest(job_id=job, step=9, rank=-1), timeout=5),
    }


def test_unauthenticated_and_wrong_tokens_are_refused_everywhere(secured: LocalCluster) -> None:
    ops = {**operations(JOB_A), "list every job": lambda s: s.List(pb.ListRequest(job_id=""), timeout=5),
           "drain": lambda s: s.Drain(pb.DrainRequest(), timeout=5), "hello": lambda s: s.Hello(pb.HelloRequest(), timeout=5),
           "expect": lambda s: s.Expect(pb.ExpectRequest(job_id=JOB_A, rank=0, nbytes=MiB), timeout=5),
           "health": lambda s: s.Health(pb.HealthRequest(), timeout=5)}  # fmt: skip
    for token in (None, "not-a-token-0123456789", CLUSTER[:-1] + "X"):
        refused = {name: call(secured, token, fn) for name, fn in ops.items()}
        assert set(refused.values()) == {grpc.StatusCode.UNAUTHENTICATED}, refused


def test_a_job_token_reaches_its_job_only(secured: LocalCluster) -> None:
    denied = {name: call(secured, TOKENS[JOB_B], fn) for name, fn in operations(JOB_A).items()}
    assert set(denied.values()) == {grpc.StatusCode.PERMISSION_DENIED}, denied
    for name, fn in {"list every job": lambda s: s.List(pb.ListRequest(job_id=""), timeout=5),
                     "drain": lambda s: s.Drain(pb.DrainRequest(), timeout=5),
                     "expect": lambda s: s.Expect(pb.ExpectRequest(job_id=JOB_A, rank=0, nbytes=MiB), timeout=5)}.items():  # fmt: skip
        assert call(secured, TOKENS[JOB_A], fn) == grpc.StatusCode.PERMISSION_DENIED, name
    # Its own job: every read works with its token.
    own = operations(JOB_A)
    for name in ("load (Open)", "load (Get)", "load (Fetch)", "latest", "list", "wait"):
        assert call(secured, TOKENS[JOB_A], own[name]) == grpc.StatusCode.OK, name
    # Through the client library: job B's token cannot read job A; A's can, bit-exactly.
    other = CheckpointClient(JOB_A, 0, 2, store=secured.address("h0"), auth_token=TOKENS[JOB_B], timeout=10)
    with other as c, pytest.raises(AccessDeniedError):
        c.load(2)
    with CheckpointClient(JOB_A, 1, 2, store=secured.address("h0"), auth_token=TOKENS[JOB_A], timeout=10) as c:
        assert_same(c.load(2), rank_state(1, 2))
    with pytest.raises(AuthenticationError):
        CheckpointClient(JOB_A, 0, 2, store=secured.address("h0"), auth_token="", timeout=10)


def test_roles_cluster_and_admin(secured: LocalCluster) -> None:
    every_job = {"list every job": lambda s: s.List(pb.ListRequest(job_id=""), timeout=5)}
    assert call(secured, CLUSTER, every_job["list every job"]) == grpc.StatusCode.OK
    assert call(secured, CLUSTER, operations(JOB_A)["delete"]) == grpc.StatusCode.PERMISSION_DENIED  # not the cluster token's job
    assert call(secured, CLUSTER, lambda s: s.Drain(pb.DrainRequest(), timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
    assert call(secured, ADMIN, operations(JOB_A)["delete"]) == grpc.StatusCode.OK  # step 9 does not exist: deletes nothing
    assert call(secured, TOKENS[JOB_A], operations(JOB_A)["delete"]) == grpc.StatusCode.OK


def test_data_channel_tickets_are_one_time(secured: LocalCluster) -> None:
    channel, stub = store_stub(secured.address("h0"), Credentials(token=TOKENS[JOB_A]))
    with channel:
        prepared = stub.PrepareSend(pb.GetRequest(key=key()), timeout=5)

    def fetch(ticket: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", prepared.data_port), timeout=5) as s:
            s.sendall(ticket)
            got = bytearray()
            deadline = time.monotonic() + 10
            while len(got) < prepared.manifest.nbytes and time.monotonic() < deadline:
                piece = s.recv(1 << 20)
                if not piece:
                    break
                got += piece
            return bytes(got)

    assert len(fetch(prepared.ticket)) == prepared.manifest.nbytes  # the issued ticket works once ...
    assert fetch(prepared.ticket) == b""  # ... and is useless replayed
    assert fetch(bytes(16)) == b""  # a made-up ticket gets nothing
    for h in ("h0", "h1"):  # no token ever reaches a log
        log = secured.stores[h].log_path.read_text()
        assert not any(t in log for t in (CLUSTER, ADMIN, *TOKENS.values()))


def test_mutual_tls_with_tokens(make_inprocess_cluster, tmp_path: Path) -> None:
    tls = make_tls(tmp_path / "tls")
    other = make_tls(tmp_path / "other", name="stranger")  # a CA the stores do not trust
    (tmp_path / "cluster.token").write_text(CLUSTER)
    server = tls["server"]
    args = ["--auth-token-file", str(tmp_path / "cluster.token"), "--tls-ca", server.ca, "--tls-cert", server.cert, "--tls-key", server.key]
    client = tls["client"]
    creds = Credentials(token=CLUSTER, ca=client.ca, cert=client.cert, key=client.key)
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="128MiB", extra_args=args, credentials=creds)
    tls_kwargs = {"tls_ca": client.ca, "tls_cert": client.cert, "tls_key": client.key}
    with CheckpointClient("tls-job", 0, 1, store=cluster.address("h0"), auth_token=CLUSTER, run_id="r", timeout=20, **tls_kwargs) as c:
        assert c.save(1, rank_state(0, 1)).wait(timeout=30).copies == 2  # the copy went to h1 over the TLS data channel
    with CheckpointClient("tls-job", 0, 1, store=cluster.address("h1"), auth_token=CLUSTER, timeout=20, **tls_kwargs) as c:
        assert_same(c.load(1), rank_state(0, 1))
    # A client that trusts another CA, or that shows no certificate, or speaks plaintext, gets nowhere.
    refused: list[dict[str, str]] = [
        {"tls_ca": other["client"].ca, "tls_cert": client.cert, "tls_key": client.key},
        {"tls_ca": client.ca, "tls_cert": other["client"].cert, "tls_key": other["client"].key},
        {"tls_ca": client.ca, "tls_cert": "", "tls_key": ""},
        {"tls_ca": "", "tls_cert": "", "tls_key": ""},
    ]
    for kwargs in refused:
        with pytest.raises((StoreUnavailableError, AuthenticationError)):
            CheckpointClient("tls-job", 0, 1, store=cluster.address("h0"), auth_token=CLUSTER, timeout=3, **kwargs)
    # The data channel refuses a plaintext connection (no TLS handshake, no client certificate).
    with socket.create_connection(("127.0.0.1", hello_data_port(cluster, creds)), timeout=5) as s:
        s.settimeout(5)
        try:
            s.sendall(bytes(16))
            answer = s.recv(1024)
        except ConnectionResetError:
            answer = b""
        assert answer == b""


def test_tls_checks_a_fixed_server_name_not_the_address(make_inprocess_cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kubernetes dials stores by pod IPs that change: one certificate names the Service, --tls-server-name checks that."""
    name = "memstore-peers.memstore.svc"
    tls = make_tls(tmp_path / "tls", hosts=(name,))  # no IP in the certificate
    (tmp_path / "cluster.token").write_text(CLUSTER)
    server, client = tls["server"], tls["client"]
    args = ["--auth-token-file", str(tmp_path / "cluster.token"), "--tls-ca", server.ca, "--tls-cert", server.cert,
            "--tls-key", server.key, "--tls-server-name", name]  # fmt: skip
    creds = Credentials(token=CLUSTER, ca=client.ca, cert=client.cert, key=client.key, server_name=name)
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="128MiB", extra_args=args, credentials=creds)
    tls_kwargs = {"tls_ca": client.ca, "tls_cert": client.cert, "tls_key": client.key}
    with pytest.raises(StoreUnavailableError):  # checked for 127.0.0.1, which the certificate does not name
        CheckpointClient("tls-job", 0, 1, store=cluster.address("h0"), auth_token=CLUSTER, timeout=3, **tls_kwargs)
    monkeypatch.setenv("MEMSTORE_TLS_SERVER_NAME", "another-name.memstore.svc")
    with pytest.raises(StoreUnavailableError):
        CheckpointClient("tls-job", 0, 1, store=cluster.address("h0"), auth_token=CLUSTER, timeout=3, **tls_kwargs)
    monkeypatch.setenv("MEMSTORE_TLS_SERVER_NAME", name)
    with CheckpointClient("tls-job", 0, 1, store=cluster.address("h0"), auth_token=CLUSTER, run_id="r", timeout=20, **tls_kwargs) as c:
        assert c.save(1, rank_state(0, 1)).wait(timeout=30).copies == 2  # h0 -> h1 over gRPC and the data channel, by name
    with CheckpointClient("tls-job", 0, 1, store=cluster.address("h1"), auth_token=CLUSTER, timeout=20, **tls_kwargs) as c:
        assert_same(c.load(1), rank_state(0, 1))


def hello_data_port(cluster: LocalCluster, creds: Credentials) -> int:
    channel, stub = store_stub(cluster.address("h0"), creds)
    with channel:
        return int(stub.Hello(pb.HelloRequest(), timeout=5).data_port)


def test_local_cluster_and_cli_with_a_token(tmp_path: Path) -> None:
    """`memstore local-cluster --auth-token-file` starts authenticated stores; CLI commands need the token too."""
    import os
    import subprocess
    import sys

    from memstore.children import child_env
    from memstore.testing import wait_for

    token = tmp_path / "cluster.token"
    token.write_text(CLUSTER)
    endpoints = tmp_path / "endpoints.json"
    env = {k: v for k, v in {**os.environ, **child_env()}.items() if not k.startswith(("MEMSTORE_AUTH", "MEMSTORE_TLS"))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "memstore", "local-cluster", "--hosts", "2", "--capacity", "64MiB", "--auth-token-file", str(token),
         "--endpoints-file", str(endpoints)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    try:
        wait_for(endpoints.exists, timeout=60, what="the local cluster's endpoints file")
        store = next(iter(json.loads(endpoints.read_text())["hosts"].values()))
        status = [sys.executable, "-m", "memstore", "status", "--store", store]
        denied = subprocess.run(status, capture_output=True, text=True, timeout=60, env=env)
        assert denied.returncode != 0 and "UNAUTHENTICATED" in denied.stderr, denied.stdout + denied.stderr
        assert "--auth-token-file (or MEMSTORE_AUTH_TOKEN_FILE)" in denied.stderr  # says what to do
        allowed = subprocess.run([*status, "--auth-token-file", str(token)], capture_output=True, text=True, timeout=60, env=env)
        assert allowed.returncode == 0 and "2 hosts" in allowed.stdout, allowed.stdout + allowed.stderr
        assert CLUSTER not in denied.stderr + allowed.stdout + allowed.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_data_channel_connections_per_address_are_bounded(make_inprocess_cluster) -> None:
    """Idle connections holding the data port cannot pile up: beyond the limit a new one is closed at once."""
    from memstore.server.dataserver import MAX_CONNECTIONS_PER_ADDRESS

    cluster = make_inprocess_cluster(hosts=1, replicas=1, capacity="32MiB")
    port = hello_data_port(cluster, Credentials())
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(MAX_CONNECTIONS_PER_ADDRESS)]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as extra:  # accepted after the others (one accept loop, FIFO)
            extra.settimeout(2.0)
            t0 = time.monotonic()
            assert extra.recv(16) == b""  # closed by the store, well before its 5 s ticket deadline
            assert time.monotonic() - t0 < 1.5
    finally:
        for s in idle:
            s.close()
    assert cluster.health("h0") is not None  # and the store serves on


def test_the_same_host_control_socket_checks_tokens_like_grpc(secured: LocalCluster) -> None:
    """The save path over the store's Unix socket: same authentication and job isolation as over gRPC."""
    socket_path = hello(secured, "h0").control_socket
    assert socket_path and Path(socket_path).exists()
    a_ops = {
        "Allocate": pb.AllocateRequest(key=key(JOB_A, 9), world_size=2, nbytes=8),
        "Open": pb.OpenRequest(key=key(JOB_A)),
        "WaitCommitted": pb.WaitCommittedRequest(key=key(JOB_A), timeout_seconds=0),
    }

    def codes(token: str) -> dict[str, grpc.StatusCode]:
        stub = LocalStub(socket_path, token)
        out = {}
        for name, request in a_ops.items():
            try:
                response = stub.call(name, request, timeout=5)
                if name == "Allocate" or name == "Open":  # give the segment back
                    stub.call("Release", pb.ReleaseRequest(lease_id=response.lease_id), timeout=5)
                out[name] = grpc.StatusCode.OK
            except grpc.RpcError as err:
                for secret in (CLUSTER, ADMIN, *TOKENS.values()):
                    assert secret not in (err.details() or "")
                out[name] = err.code()
        stub.close()
        return out

    for token in ("", "not-a-token-0123456789", CLUSTER[:-1] + "X"):
        assert set(codes(token).values()) == {grpc.StatusCode.UNAUTHENTICATED}
    assert set(codes(TOKENS[JOB_B]).values()) == {grpc.StatusCode.PERMISSION_DENIED}
    assert set(codes(TOKENS[JOB_A]).values()) == {grpc.StatusCode.OK}
    # The client library takes that path by itself, and with the wrong job's token a save is refused there too.
    with CheckpointClient(JOB_A, 0, 2, store=secured.address("h0"), auth_token=TOKENS[JOB_B], run_id="r2", timeout=10) as c:
        assert c._link.local is not None
        with pytest.raises(AccessDeniedError):
            c.save(5, rank_state(0, 5))


def hello(cluster: LocalCluster, host: str) -> pb.HelloResponse:
    channel, stub = store_stub(cluster.address(host), Credentials(token=CLUSTER))
    with channel:
        return stub.Hello(pb.HelloRequest(), timeout=10)
