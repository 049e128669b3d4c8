"""``StoreLink``: a client's live connection to its store, and :func:`connect`, the one step that makes it.

A ``CheckpointClient`` does no I/O in its constructor but this step (NVRx's ``LocalCheckpointManager`` is the model:
options first, then what talks to the world). :func:`connect`, in order:

1. resolves the connection (the address and credentials it leaves out come from ``trainer_client.knobs``);
2. dials the store's gRPC port and waits for the channel, within the connection's timeout (``StoreUnavailableError``
   naming the address and where it came from);
3. calls ``Hello``: the store's host id, its shared-memory directory, control socket, data port and chunk size;
4. decides the save path: shared memory when the store shares this machine's memory (same boot id, its directory
   visible here), unless the connection forces it on (refused when it cannot be) or off;
5. with shared memory, opens the store's Unix control socket (the save path's unary calls, ``LocalStub``); one that
   does not answer is logged and the calls go over gRPC.

``StoreLink.call`` runs one gRPC call with the client's deadline, retries (UNAVAILABLE only) and typed errors;
``StoreLink.control`` one save-path call (``Allocate``, ``Commit``, ``Release``, ``WaitCommitted``, ``Open``) over the
socket while it works, then over gRPC. ``StoreLink.data`` moves whole shards over the store's data channel (the path
without shared memory).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from memstore.v1 import store_pb2 as pb
from memstore.v1.channel import boot_id, store_stub
from trainer_client.connection import Connection
from trainer_client.errors import InvalidArgumentError, StoreUnavailableError, raise_for_rpc
from trainer_client.transport.local_control_client import LocalStub, RpcFailure
from trainer_client.transport.remote import RemoteTransfer

log = logging.getLogger(__name__)
T = TypeVar("T")


class StoreLink:
    """One client's connection to its store, made by :func:`connect`.

    Attributes:
        connection: the connection as resolved (address and credentials filled in).
        stub: the store's gRPC stub.
        hello: what the store said it is (``HelloResponse``): host id, data port, chunk size, replicas.
        shared_memory: whether this process maps the store's segments (the shared-memory save path).
        local: the Unix control socket's stub, None without one (or once it is gone).
        data: whole shards over the data channel (the path without shared memory, and its restores).
    """

    def __init__(
        self, connection: Connection, channel: grpc.Channel, stub: Any, hello: pb.HelloResponse, shared_memory: bool,
        local: LocalStub | None,
    ) -> None:  # fmt: skip
        assert connection.address is not None and connection.credentials is not None
        self.connection = connection
        self._channel = channel
        self.stub = stub
        self.hello = hello
        self.shared_memory = shared_memory
        self.local = local
        self.data = RemoteTransfer(stub, connection.address, connection.credentials, connection.timeout, hello.data_port)

    @property
    def timeout(self) -> float:
        return self.connection.timeout

    def call(self, fn: Callable[[float], T], what: str, retries: int = 0) -> T:
        """``fn(deadline)``, a gRPC call; UNAVAILABLE retried ``retries`` times with backoff; a failure raised typed."""
        attempt = 0
        while True:
            try:
                return fn(self.timeout)
            except grpc.RpcError as err:
                if attempt < retries and err.code() == grpc.StatusCode.UNAVAILABLE:
                    attempt += 1
                    time.sleep(min(1.0, 0.1 * 2**attempt))
                    continue
                raise_for_rpc(err, what)

    def unary(self, name: str, request: Any, what: str, retries: int = 0) -> Any:
        """The gRPC call ``name`` with ``request`` (``call``'s deadline, retries and errors)."""
        method = getattr(self.stub, name)
        return self.call(lambda t: method(request, timeout=t), what, retries)

    def control(self, name: str, request: Any, what: str, retries: int = 0, wait: float = 0.0) -> Any:
        """A save-path call (``Allocate``, ``Commit``, ``Release``, ``WaitCommitted``, ``Open``): over the store's
        Unix socket when there is one, else (or once it is gone) over gRPC; ``wait``: seconds the call may block
        in the store beyond the usual deadline."""
        local = self.local
        if local is not None:
            try:
                return local.call(name, request, timeout=self.timeout + wait)
            except RpcFailure as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE or err.sent:
                    raise_for_rpc(err, what)
                log.warning("store control socket gone (%s); the save path uses gRPC from now on", err.details())
                self.local = None
                local.close()
        method = getattr(self.stub, name)
        return self.call(lambda t: method(request, timeout=t + wait), what, retries)

    def close(self) -> None:
        if self.local is not None:
            self.local.close()
            self.local = None
        self._channel.close()


def connect(requested: Connection) -> StoreLink:
    """Dial the store ``requested`` names, ask its ``Hello`` and open its control socket (the steps in the module doc)."""
    connection = requested.resolved()
    assert connection.address is not None and connection.credentials is not None
    address, credentials, timeout = connection.address, connection.credentials, connection.timeout
    channel, stub = store_stub(address, credentials)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
    except grpc.FutureTimeoutError:
        channel.close()
        tls = (
            " (TLS: check that the credentials' CA signed the store's certificate and the store accepts this client's certificate)"
            if credentials.tls
            else ""
        )
        where = f"{address}{requested.address_source}"
        raise StoreUnavailableError(f"store at {where} not reachable within {timeout}s; is `memstore serve` running there?{tls}") from None
    try:
        try:
            hello = stub.Hello(pb.HelloRequest(), timeout=timeout)
        except grpc.RpcError as err:
            raise_for_rpc(err, "connect to store")
        same_machine = bool(hello.shm_dir) and hello.boot_id == boot_id() and os.path.isdir(hello.shm_dir)
        if connection.shared_memory and not same_machine:
            raise InvalidArgumentError(f"store at {address} shares no memory with this process (different machine or no --shm-dir)")
    except BaseException:
        channel.close()
        raise
    shared_memory = same_machine if connection.shared_memory is None else connection.shared_memory
    local = _control_socket(hello.control_socket, credentials.token, timeout) if shared_memory else None
    return StoreLink(connection, channel, stub, hello, shared_memory, local)


def _control_socket(path: str, token: str, timeout: float) -> LocalStub | None:
    """The store's Unix control socket, connected; None when it has none or it does not answer (gRPC then)."""
    if not path or not os.path.exists(path):
        return None
    local = LocalStub(path, token)
    try:
        local.connect(timeout)
    except OSError as exc:
        log.info("store control socket %s not usable (%s); the save path uses gRPC", path, exc)
        return None
    return local
