"""Calls from this store to its peers: push a shard, pull a shard, list holdings, handshake.

One channel per peer address, created lazily and reused. Every call has a deadline; a failure
becomes PeerUnavailable (or the peer's typed answer, such as RESOURCE_EXHAUSTED) naming the peer.
Callers speak the core's types: this client converts at its boundary (``memstore.server.convert``),
once per call, never per chunk.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc

from memstore.core.model import Manifest, ShardInfo, ShardKey, TransferHeader
from memstore.core.slots import SlotTable, SlotTableError
from memstore.core.status import HelloReport
from memstore.errors import (
    ChecksumMismatch,
    DataChannelError,
    DataChannelUnsupported,
    IdentityMismatch,
    PeerUnavailable,
    StoreError,
    StreamError,
    from_status,
)
from memstore.faults import fault
from memstore.server.convert import hello_from_pb, info_from_pb, key_to_pb, manifest_from_pb, transfer_to_pb
from memstore.v1 import datachannel
from memstore.v1 import store_pb2 as pb
from memstore.v1.channel import capacity_numbers, store_stub
from memstore.v1.integrity import StreamedChecksums
from memstore.v1.security import Credentials
from memstore.v1.streams import put_requests

log = logging.getLogger(__name__)
T = TypeVar("T")


def _peer_error(host_id: str, what: str, err: grpc.RpcError) -> StoreError:
    """The typed error (``memstore.errors.from_status``) for a failed call to a peer, naming the peer."""
    code = err.code() if hasattr(err, "code") else None
    detail = err.details() if hasattr(err, "details") else str(err)
    status = code.name if code else "UNAVAILABLE"
    return from_status(status, f"{what} on peer {host_id} failed: {status}: {detail}", **capacity_numbers(err))


# A peer that just (re)started is reachable a moment after its channel first failed; a dead one keeps
# refusing connections. Retrying UNAVAILABLE for this long tells the two apart without hanging.
RETRY_BUDGET_SECONDS = 1.5


def _retrying(fn: Callable[[], T], budget: float = RETRY_BUDGET_SECONDS) -> T:
    deadline = time.monotonic() + budget
    delay = 0.05
    while True:
        try:
            return fn()
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() + delay > deadline:
                raise
        time.sleep(delay)
        delay = min(0.5, delay * 2)


class Peer:
    # After a peer failed a call despite retries, later calls try once only for this long, so a dead
    # peer costs one refused connection per call rather than a full retry budget.
    SUSPECT_SECONDS = 30.0

    def __init__(self, host_id: str, address: str, credentials: Credentials | None = None) -> None:
        self.host_id = host_id
        self.address = address
        self.credentials = credentials or Credentials()  # this store's cluster token and TLS identity
        self._ssl = self.credentials.client_ssl_context()  # the data channel's TLS (None = plaintext)
        self._channel, self.stub = store_stub(address, self.credentials)
        self._retired: list[grpc.Channel] = []
        self._lock = threading.Lock()
        self._suspect_until = 0.0

    def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (which uses ``self.stub``) with the peer's retry policy."""
        suspect = time.monotonic() < self._suspect_until
        try:
            try:
                result = _retrying(fn, 0.0 if suspect else RETRY_BUDGET_SECONDS)
            except grpc.RpcError as err:
                if not (suspect and err.code() == grpc.StatusCode.UNAVAILABLE):
                    raise
                # The old channel may still be backing off from the peer's death although a replacement is up:
                # a fresh channel connects at once. A peer that is really gone costs one more refused connection.
                self._fresh_channel()
                result = fn()
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                self._suspect_until = time.monotonic() + self.SUSPECT_SECONDS
            raise
        self._suspect_until = 0.0
        return result

    def _fresh_channel(self) -> None:
        with self._lock:
            # Calls in flight on the old channel finish on it; it is closed with the peer.
            self._retired.append(self._channel)
            self._channel, self.stub = store_stub(self.address, self.credentials)
            while len(self._retired) > 4:
                self._retired.pop(0).close()

    def close(self) -> None:
        for channel in [*self._retired, self._channel]:
            channel.close()

    def hello(self, timeout: float, known: SlotTable | None = None, asker: str = "", fresh: bool = False) -> HelloReport:
        """The peer's handshake, asked once: no retries, so a peer that is down costs one refused call. With ``known``
        (gossip: our table, and ``asker`` our host id) the peer leaves its slot table and member list out unless its
        table is newer (the report then holds an empty table, which nobody adopts).

        ``fresh``: an UNAVAILABLE answer is asked once more on a fresh channel. A channel to a peer that was down
        backs off its reconnects and fails calls at once meanwhile, even after the peer's replacement serves: a drain
        deciding whether a peer can take its copies must not mistake that for the peer being gone."""
        request = pb.HelloRequest()
        if known is not None:
            request = pb.HelloRequest(known_slots_version=known.version, known_slots_digest=known.digest, asker_host_id=asker)
        try:
            try:
                return hello_from_pb(self.stub.Hello(request, timeout=timeout))
            except grpc.RpcError as err:
                if not fresh or err.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                self._fresh_channel()
                return hello_from_pb(self.stub.Hello(request, timeout=timeout))
        except grpc.RpcError as err:
            raise _peer_error(self.host_id, "Hello", err) from None
        except SlotTableError as exc:
            raise PeerUnavailable(f"peer {self.host_id} at {self.address} sent a malformed slot table: {exc}") from None

    def list(self, job_id: str, timeout: float, retrying: bool = True) -> list[ShardInfo]:
        """The peer's shards of ``job_id`` (every job: ""). ``retrying=False``: asked once, and a failure does not mark
        the peer suspect (a starting store probing peers that may not serve yet)."""

        def ask() -> pb.ListResponse:
            return self.stub.List(pb.ListRequest(job_id=job_id), timeout=timeout)

        try:
            resp = self._call(ask) if retrying else ask()
        except grpc.RpcError as err:
            raise _peer_error(self.host_id, "List", err) from None
        if resp.host_id != self.host_id:
            raise IdentityMismatch(
                f"the store at {self.address} says it is host {resp.host_id!r}, but --peers names it {self.host_id!r}; "
                "fix --peers or restart that store with the right --host-id"
            )
        return [info_from_pb(i) for i in resp.shards]

    def expect(self, job_id: str, rank: int, nbytes: int, timeout: float) -> None:
        """Tell the peer that replicas of ``job_id``'s rank ``rank``, ``nbytes`` each, will land on it (with the peer's
        retry policy: a channel still backing off from a peer that was not listening yet fails at once otherwise)."""
        request = pb.ExpectRequest(job_id=job_id, rank=rank, nbytes=nbytes)
        try:
            self._call(lambda: self.stub.Expect(request, timeout=timeout))
        except grpc.RpcError as err:
            raise _peer_error(self.host_id, "Expect", err) from None

    def push(self, header: TransferHeader, view: memoryview, timeout: float) -> None:
        """Stream a shard to the peer over gRPC: a fresh stream per attempt (Put is idempotent)."""
        wire = transfer_to_pb(header)
        try:
            self._call(lambda: self.stub.Put(put_requests(wire, view), timeout=timeout))
        except grpc.RpcError as err:
            raise _peer_error(self.host_id, "Put", err) from None

    @property
    def host(self) -> str:
        return self.address.rpartition(":")[0].strip("[]")

    def _data_connection(self, port: int, control_timeout: float) -> socket.socket:
        return datachannel.connect(self.host, port, control_timeout, self._ssl, self.credentials.server_name)

    def push_data(
        self,
        header: TransferHeader,
        view: memoryview,
        timeout: float,
        control_timeout: float,
        streams: int = 1,
        sums: StreamedChecksums | None = None,
        ready: Callable[[int], None] | None = None,
        source_fd: int | None = None,
    ) -> None:
        """Push a shard over the bulk data channel in up to ``streams`` parallel streams (as many as the peer grants).

        ``sums``: the header's checksums are placeholders; each chunk is hashed as it goes and its checksum follows it
        (a peer too old for that raises DataChannelUnsupported, as does one without a data channel: UNIMPLEMENTED).
        ``ready``: each stream waits for its next bytes to be final (``datachannel.send_chunks``). ``source_fd``: the
        file ``view`` maps from its first byte (a segment): its pages are sent without a copy (``sendfile``)."""
        wire = transfer_to_pb(header)
        wire.streams = streams
        wire.checksums_follow = sums is not None
        try:
            # The peer reserves (and faults in) the whole segment before answering: give it the transfer deadline.
            ticket = self._call(lambda: self.stub.PrepareReceive(wire, timeout=max(control_timeout, timeout)))
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise DataChannelUnsupported(self.host_id) from None
            raise _peer_error(self.host_id, "PrepareReceive", err) from None
        deadline = time.monotonic() + timeout
        m = header.manifest
        tickets = datachannel.split_tickets(ticket.ticket)
        if sums is not None and not ticket.checksums_follow:  # it expects the placeholders: fail its streams at once
            for one in tickets:
                with contextlib.suppress(DataChannelError), self._data_connection(ticket.data_port, control_timeout) as sock:
                    sock.sendall(one)
            raise DataChannelUnsupported(f"{self.host_id} (no streamed checksums)")
        errors: list[str] = []

        def stream(one: bytes, chunks: tuple[int, int]) -> Callable[[threading.Event], None]:
            def run(failed: threading.Event) -> None:
                check = datachannel.abort_check(failed)

                def on_piece() -> None:
                    fault("replicate.after_chunk")
                    check()

                with self._data_connection(ticket.data_port, control_timeout) as sock:
                    error = datachannel.push_part(sock, one, view, m.chunk_size, chunks, deadline, sums, on_piece, ready, source_fd)
                if error is not None:
                    errors.append(error)

            return run

        spans = datachannel.part_spans(m.nbytes, m.chunk_size, len(tickets))
        try:
            datachannel.run_streams([stream(t, c) for t, c in zip(tickets, spans, strict=True)])
        except DataChannelError as exc:
            raise DataChannelError(f"push to peer {self.host_id}: {exc}") from None
        if errors:
            status, _, detail = errors[0].partition(": ")
            raise from_status(status, f"peer {self.host_id} refused the shard: {detail or status}")

    def pull_data(
        self, key: ShardKey, into: Callable[[Manifest], memoryview], timeout: float, control_timeout: float, streams: int = 0,
        fresh: Callable[[], bool] = lambda: True,
    ) -> Manifest:  # fmt: skip
        """Pull a shard over the bulk data channel into the view ``into(manifest)`` returns; verified per chunk.

        ``streams``: at most this many parallel streams (``--transfer-streams``; 0 = auto: as many as the peer's size rule
        grants, ``datachannel.granted_streams``). ``fresh()``, asked once ``into`` answered: the view is fresh memory, so
        each stream faults its pages in ahead of the socket (``FaultAhead``)."""
        request = pb.GetRequest(key=key_to_pb(key), streams=streams or datachannel.MAX_STREAMS)
        try:
            prepared = self._call(lambda: self.stub.PrepareSend(request, timeout=control_timeout))
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise DataChannelUnsupported(self.host_id) from None
            raise _peer_error(self.host_id, "PrepareSend", err) from None
        manifest = manifest_from_pb(prepared.manifest)
        dest = into(manifest)
        fault_ahead = fresh()  # memory faulted in already (the reserve, a pool) needs no thread faulting it again
        deadline = time.monotonic() + timeout

        def stream(one: bytes, chunks: tuple[int, int]) -> Callable[[threading.Event], None]:
            def run(failed: threading.Event) -> None:
                with self._data_connection(prepared.data_port, control_timeout) as sock:
                    sock.sendall(one)
                    datachannel.receive_verified(sock, manifest, dest, deadline, datachannel.abort_check(failed), fault_ahead, chunks)

            return run

        try:
            tickets = datachannel.split_tickets(prepared.ticket)
            spans = datachannel.part_spans(manifest.nbytes, manifest.chunk_size, len(tickets))
            datachannel.run_streams([stream(t, c) for t, c in zip(tickets, spans, strict=True)])
        except DataChannelError as exc:
            raise DataChannelError(f"pull from peer {self.host_id}: {exc}") from None
        except StreamError as exc:  # the peer sent bytes that do not match its own manifest
            raise (ChecksumMismatch if isinstance(exc, ChecksumMismatch) else PeerUnavailable)(f"copy from {self.host_id}: {exc}") from None
        return manifest

    def contribute(self, header: pb.ContributeHeader, blocks: Callable[[], Iterable[bytes | memoryview]], timeout: float) -> bool:
        """Send one shard's contribution to the peer's parity fragment of a row (``--redundancy ec:K+M``): ``header``,
        then the bytes ``blocks()`` yields (asked again on a retry). True if the peer added it, False if it held it."""

        def requests() -> Iterator[pb.ContributeRequest]:
            yield pb.ContributeRequest(header=header)
            for block in blocks():
                yield pb.ContributeRequest(data=bytes(block))

        try:
            return not self._call(lambda: self.stub.Contribute(requests(), timeout=timeout)).already
        except grpc.RpcError as err:
            raise _peer_error(self.host_id, "Contribute", err) from None

    def read_range(self, key: ShardKey, offset: int, length: int, stride: int, count: int, into: memoryview, timeout: float) -> None:
        """Read ``count`` pieces of ``length`` bytes of the peer's verified copy of ``key``, piece i at ``offset + i *
        stride`` (zeros past its end), into ``into`` (``count * length`` bytes)."""
        request = pb.ReadRangeRequest(key=key_to_pb(key), offset=offset, length=length, stride=stride, count=count)
        self._read_stream(lambda: self.stub.ReadRange(request, timeout=timeout), into, "ReadRange", lambda msg: msg.data)

    def read_parity(self, version: ShardKey, row: int, first: int, blocks: int, into: memoryview, timeout: float) -> tuple[ShardInfo, ...]:
        """Read blocks ``first .. first+blocks-1`` of the peer's parity fragment of ``row`` of ``version`` into ``into``;
        returns whose contributions they hold (their manifests and places)."""
        request = pb.ReadParityRequest(version=key_to_pb(version), row=row, first_position=first, blocks=blocks)
        contents: builtins.list[pb.ParityContents] = []

        def data(msg: pb.ReadParityResponse) -> bytes:
            if msg.WhichOneof("body") == "contents":
                contents.append(msg.contents)
                return b""
            return msg.data

        self._read_stream(lambda: self.stub.ReadParity(request, timeout=timeout), into, "ReadParity", data)
        if len(contents) != 1:
            raise PeerUnavailable(f"ReadParity on peer {self.host_id} sent {len(contents)} descriptions of its contents, expected one")
        return tuple(info_from_pb(i) for i in contents[0].contributors)

    def _read_stream(self, call: Callable[[], Iterator[T]], into: memoryview, what: str, data: Callable[[T], bytes]) -> None:
        got = 0
        try:
            for msg in call():
                piece = data(msg)
                if got + len(piece) > len(into):
                    raise PeerUnavailable(f"{what} on peer {self.host_id} sent more than the {len(into)} bytes asked for")
                into[got : got + len(piece)] = piece
                got += len(piece)
        except grpc.RpcError as err:
            raise _peer_error(self.host_id, what, err) from None
        if got != len(into):
            raise PeerUnavailable(f"{what} on peer {self.host_id} sent {got} of {len(into)} bytes")

    def get(self, key: ShardKey, timeout: float) -> tuple[Manifest, Iterator[bytes], grpc.Future]:
        """Start a Get stream: returns (manifest, iterator over chunk bytes, call to cancel)."""
        call = self.stub.Get(pb.GetRequest(key=key_to_pb(key)), timeout=timeout)
        try:
            first = next(call)
        except grpc.RpcError as err:
            raise _peer_error(self.host_id, "Get", err) from None
        except StopIteration:
            raise PeerUnavailable(f"Get on peer {self.host_id} returned an empty stream") from None
        if first.WhichOneof("body") != "manifest":
            call.cancel()
            raise PeerUnavailable(f"Get on peer {self.host_id} did not start with a manifest")

        def chunks() -> Iterator[bytes]:
            try:
                for msg in call:
                    yield msg.chunk
            except grpc.RpcError as err:
                raise _peer_error(self.host_id, "Get", err) from None

        return manifest_from_pb(first.manifest), chunks(), call


class PeerDirectory:
    """The cluster's other stores, addressed by host id."""

    def __init__(self, self_id: str, peers: Iterable[tuple[str, str]] = (), credentials: Credentials | None = None) -> None:
        self.self_id = self_id
        self.credentials = credentials or Credentials()
        self._peers = {hid: Peer(hid, addr, self.credentials) for hid, addr in peers if hid != self_id}
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="peer-list")
        self._lock = threading.Lock()
        self._gone: list[Peer] = []  # replaced or removed: closed with the directory (calls in flight finish on them)

    def __getitem__(self, host_id: str) -> Peer:
        try:
            return self._peers[host_id]
        except KeyError:
            raise PeerUnavailable(f"host {host_id!r} is not a member of the cluster (any more)") from None

    def set_members(self, members: Mapping[str, str]) -> None:
        """The cluster's members changed (host id -> address): new peers get a channel, moved or removed ones are retired."""
        with self._lock:
            peers = dict(self._peers)
            for hid, peer in list(peers.items()):
                if members.get(hid) != peer.address:
                    self._gone.append(peers.pop(hid))
            for hid, address in members.items():
                if hid != self.self_id and hid not in peers:
                    peers[hid] = Peer(hid, address, self.credentials)
            self._peers = peers  # replaced whole: readers iterate a consistent dict without the lock
            while len(self._gone) > 16:  # long gone: calls that were in flight on it have ended
                self._gone.pop(0).close()

    def ids(self) -> list[str]:
        return list(self._peers)

    def list_all(
        self, job_id: str, timeout: float, hosts: Iterable[str] | None = None, retrying: bool = True
    ) -> dict[str, list[ShardInfo] | StoreError]:
        """List every (or the given) peer in parallel; failures are returned, not raised (``Peer.list``'s ``retrying``)."""
        peers = self._peers
        targets = [h for h in (hosts if hosts is not None else peers) if h in peers]

        def one(h: str) -> list[ShardInfo] | StoreError:
            try:
                return peers[h].list(job_id, timeout, retrying)
            except StoreError as exc:
                return exc

        return dict(zip(targets, self._pool.map(one, targets), strict=True))

    def announce(self, hosts: Iterable[str], job_id: str, rank: int, nbytes: int, timeout: float) -> None:
        """``Peer.expect`` on each of ``hosts``, in the background: a peer that does not answer only faults its
        replicas' memory in later (when they arrive), so failures are logged, never raised."""
        peers = self._peers

        def one(h: str) -> None:
            try:
                peers[h].expect(job_id, rank, nbytes, timeout)
            except StoreError as exc:
                log.info("telling peer %s to expect replicas of job %s rank %d failed: %s", h, job_id, rank, exc)

        for h in hosts:
            if h in peers:
                self._pool.submit(one, h)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for p in [*self._peers.values(), *self._gone]:
            p.close()
