"""Shard bytes over the store's bulk data channel: what the path without shared memory moves, both ways.

A trainer in another pod or on another machine (or a store run with ``--shm-dir ''``) cannot copy into
the store's memory. It stages the shard in its own memory, checksums it, and sends it over the same raw
TCP data channel the stores use between themselves (a one-time ticket from ``PrepareReceive``, the
bytes, one status byte back), at wire speed instead of gRPC-Python's ~0.3x. Loads come back the same
way (``PrepareSend``), verified chunk by chunk as they land. A store without a data channel (or one that
refuses it) gets the gRPC streams instead. Authentication and TLS are the control plane's: the ticket
is issued only to an authorized call, and the data connection uses the client's TLS settings.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from memstore.core.model import Manifest
from memstore.errors import DataChannelError, StreamError
from memstore.v1 import datachannel
from memstore.v1 import store_pb2 as pb
from memstore.v1.integrity import compute_checksums
from memstore.v1.manifests import manifest_from_pb, set_floor
from memstore.v1.security import Credentials
from memstore.v1.streams import manifest_problem, put_requests, receive_chunks
from trainer_client.errors import CorruptShardError, StoreUnavailableError, raise_for_rpc
from trainer_client.serialization import ChunkSums
from trainer_client.transport.local_control_client import RpcFailure

VERIFY_THREADS = max(1, min(4, os.cpu_count() or 1))  # threads hashing a shard this process holds (a staged save, a mapped restore)
HUGE_MIN = 2 << 20  # buffers from this size on are huge-page backed anonymous mappings
MIN_RATE = 50 << 20
_REACH = (
    "a trainer without the store's shared memory needs to reach the store's data port as well as its gRPC port "
    "(Kubernetes: the data hostPort and the NetworkPolicy in k8s/)"
)  # bytes/s: a transfer's deadline is the call timeout plus its size at this rate


def empty_buffer(nbytes: int) -> torch.Tensor:
    """Fresh bytes for a shard: anonymous memory that asks for transparent huge pages, faulted in as data
    lands (no zero-fill pass). With huge pages a GiB faults in ~4x faster than in 4 KiB pages; where the
    kernel gives none (THP ``never``) it is ordinary memory."""
    if nbytes < HUGE_MIN:
        return torch.empty(max(1, nbytes), dtype=torch.uint8)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError, ValueError, AttributeError):
        mm.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mm, dtype=torch.uint8)  # the tensor keeps the mapping alive


def byte_view(buf: torch.Tensor, nbytes: int) -> memoryview:
    array: Any = buf.numpy()
    return memoryview(array).cast("B")[:nbytes]


@dataclass(frozen=True)
class StagedShard:
    """A shard staged in this process, for :meth:`RemoteTransfer.send` (made by
    :class:`~trainer_client.transport.remote_path.RemotePath` before the copy).

    Attributes:
        manifest: the shard's manifest but for its checksums (key, size, chunk size, format, metrics, codec, stripe).
        memory: the shard's bytes (``manifest.nbytes``), once the copy wrote them.
        sums: the checksums the copy made (None, or no values: they are computed when it is sent).
        floor: reads the job's restorable floor when it is sent: (step, its timeline; "" = the shard's); None when there is no agreement.
        release: gives the staging buffer back, once sent or not.
    """

    manifest: pb.Manifest
    memory: memoryview
    sums: ChunkSums | None
    floor: Callable[[], tuple[int, str] | None] | None
    release: Callable[[], None]


class RemoteTransfer:
    """Put and get whole shards to/from the store at ``address`` without shared memory (the save side is
    :class:`~trainer_client.transport.remote_path.RemotePath`'s, through :meth:`send`; restores read through :meth:`get`).

    ``last_route`` says how the last shard sent travelled (``"data channel"`` or ``"grpc"``; "" before the first)."""

    def __init__(self, stub: Any, address: str, credentials: Credentials, timeout: float, data_port: int) -> None:
        self._stub = stub
        self._host = address.rpartition(":")[0].strip("[]")
        self._credentials = credentials
        self._ssl = credentials.client_ssl_context()
        self._timeout = timeout
        self.data_port = data_port  # 0: the store has no data channel (gRPC streams only)
        self.last_route = ""

    def send(self, staged: StagedShard) -> None:
        """Send a staged shard: hash it (unless the copy did), send it with its header (``PutHeader``: its manifest, who
        sends it, the job's restorable floor read now), then give its staging buffer back, sent or not."""
        try:
            m = staged.manifest
            done = staged.sums.values if staged.sums is not None else None
            checksums = done if done is not None else compute_checksums(staged.memory, m.nbytes, m.chunk_size, workers=VERIFY_THREADS)
            manifest = pb.Manifest()
            manifest.CopyFrom(m)
            manifest.chunk_checksums.extend(checksums)
            header = pb.PutHeader(manifest=manifest, origin=pb.PUT_ORIGIN_CLIENT, sender_host=f"client-rank-{m.key.rank}")
            floor = staged.floor() if staged.floor is not None else None
            if floor is not None:
                set_floor(header, *floor)
            self.last_route = self.put(header, staged.memory, f"put step {m.key.step}")
        finally:
            staged.release()

    def _deadline(self, nbytes: int) -> float:
        return self._timeout + nbytes / MIN_RATE

    def put(self, header: pb.PutHeader, view: memoryview, what: str) -> str:
        """Send a whole shard; returns how it went ("data channel" or "grpc")."""
        if self.data_port:
            try:
                self._put_data(header, view, what)
                return "data channel"
            except RpcFailure as err:
                if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise_for_rpc(err, what)
                self.data_port = 0  # an older store: streams from now on
        try:
            self._stub.Put(put_requests(header, view), timeout=self._deadline(len(view)))
        except grpc.RpcError as err:
            raise_for_rpc(err, what)
        return "grpc"

    def _put_data(self, header: pb.PutHeader, view: memoryview, what: str) -> None:
        span = self._deadline(len(view))
        try:
            # The store reserves (and faults in) the shard's memory before answering: the transfer's deadline.
            ticket = self._stub.PrepareReceive(header, timeout=span)
        except grpc.RpcError as err:
            raise RpcFailure(err.code(), err.details() or "", tuple(err.trailing_metadata() or ())) from None
        deadline = time.monotonic() + span
        try:
            with datachannel.connect(self._host, ticket.data_port, self._timeout, self._ssl, self._credentials.server_name) as sock:
                sock.sendall(ticket.ticket)
                datachannel.send_all(sock, view, deadline)
                error = datachannel.read_status(sock, deadline)
        except (DataChannelError, OSError) as exc:
            raise StoreUnavailableError(f"{what}: {exc}; {_REACH}") from None
        if error is not None:
            status, _, detail = error.partition(": ")
            code = getattr(grpc.StatusCode, status, grpc.StatusCode.UNKNOWN)
            raise RpcFailure(code, detail or status)

    def get(self, key: pb.ShardKey, what: str) -> tuple[Manifest, torch.Tensor]:
        """A whole shard's manifest and bytes (a uint8 tensor of at least ``manifest.nbytes``), every chunk verified."""
        if self.data_port:
            try:
                return self._get_data(key, what)
            except RpcFailure as err:
                if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise_for_rpc(err, what)
                self.data_port = 0
        return self._get_streamed(key, what)

    def _get_data(self, key: pb.ShardKey, what: str) -> tuple[Manifest, torch.Tensor]:
        try:
            prepared = self._stub.PrepareSend(pb.GetRequest(key=key), timeout=self._timeout)
        except grpc.RpcError as err:
            raise RpcFailure(err.code(), err.details() or "", tuple(err.trailing_metadata() or ())) from None
        m = _checked(prepared.manifest, key)
        buf = empty_buffer(m.nbytes)
        deadline = time.monotonic() + self._deadline(m.nbytes)
        try:
            with datachannel.connect(self._host, prepared.data_port, self._timeout, self._ssl, self._credentials.server_name) as sock:
                sock.sendall(prepared.ticket)
                datachannel.receive_verified(sock, m, byte_view(buf, m.nbytes), deadline, fault_ahead=True)
        except StreamError as exc:
            raise CorruptShardError(f"{what}: {exc}") from None
        except (DataChannelError, OSError) as exc:
            raise StoreUnavailableError(f"{what}: {exc}; {_REACH}") from None
        return m, buf

    def _get_streamed(self, key: pb.ShardKey, what: str) -> tuple[Manifest, torch.Tensor]:
        call = self._stub.Get(pb.GetRequest(key=key), timeout=self._timeout + 600)
        try:
            first = next(call)
            m = _checked(first.manifest, key)
            buf = empty_buffer(m.nbytes)
            receive_chunks((msg.chunk for msg in call), m, byte_view(buf, m.nbytes))
        except grpc.RpcError as err:
            raise_for_rpc(err, what)
        except StreamError as exc:
            raise CorruptShardError(f"{what}: {exc}") from None
        return m, buf


def _checked(manifest: pb.Manifest, key: pb.ShardKey) -> Manifest:
    m = manifest_from_pb(manifest)
    problem = manifest_problem(m)
    if problem:
        raise CorruptShardError(f"store sent a bad manifest for step {key.step}: {problem}")
    return m
