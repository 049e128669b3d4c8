"""The gRPC servicer: convert each request to the core's types, delegate to the Store engine, convert
its answer back, and map typed errors to status codes.

Every call is authorized first (``memstore.server.auth``: the token in its metadata, the job it names).
Conversions are ``memstore.server.convert``'s, once per call (a shard's manifest once per transfer,
never per chunk). Known errors (``memstore.errors``) become their status with the message; anything
else becomes INTERNAL and is logged with its traceback. Each call and each failure's status code is told
to the store's events (``memstore_rpcs_total``, ``memstore_rpc_errors_total``). No logic lives here.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from memstore.core.erasure_layout import BLOCK
from memstore.core.model import PutOrigin, TransferHeader
from memstore.errors import InvalidArgument, RingBusy, StoreError
from memstore.server.auth import Authenticator, Need, Principal
from memstore.server.convert import (
    capture_from_pb,
    client_checksums_from_pb,
    floor_from_pb,
    health_to_pb,
    hello_to_pb,
    info_to_pb,
    key_from_pb,
    key_to_pb,
    latest_to_pb,
    manifest_from_pb,
    manifest_to_pb,
    place_from_pb,
    seen_to_pb,
    stripe_from_pb,
    transfer_from_pb,
)
from memstore.server.engine.entries import ALLOCATE_LEASE_SECONDS, Entry
from memstore.server.events import StoreEvents
from memstore.server.store import Store
from memstore.v1 import store_pb2 as pb
from memstore.v1 import store_pb2_grpc as pb_grpc
from memstore.v1.security import token_of
from memstore.v1.streams import get_responses

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])
MAX_CONTRIBUTION_BLOCKS = 1 << 16  # blocks of one Contribute or ReadParity (64 GiB: a row of a shard MAX_CHUNKS_PER_SHARD allows)


def _abort(context: grpc.ServicerContext, exc: BaseException, events: StoreEvents, method: str) -> None:
    if isinstance(exc, StoreError):
        events.rpc_failed(method, exc.status)
        if exc.trailing_metadata():
            context.set_trailing_metadata(exc.trailing_metadata())
        context.abort(getattr(grpc.StatusCode, exc.status), str(exc))
    events.rpc_failed(method, "INTERNAL")
    log.error("internal error", exc_info=exc)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


def rpc(method: F) -> F:
    """Wrap a unary handler: counted; typed errors -> status."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self: StoreServicer, request: Any, context: grpc.ServicerContext) -> Any:
        events = self.store.events
        events.rpc(name)
        try:
            return method(self, request, context)
        except Exception as exc:
            _abort(context, exc, events, name)

    return wrapper  # type: ignore[return-value]


def stream_rpc(method: F) -> F:
    """Wrap a server-streaming handler the same way."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self: StoreServicer, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        events = self.store.events
        events.rpc(name)
        try:
            yield from method(self, request, context)
        except Exception as exc:
            _abort(context, exc, events, name)

    return wrapper  # type: ignore[return-value]


class StoreServicer(pb_grpc.StoreServicer):
    def __init__(self, store: Store, on_drain: Callable[[], None] | None = None, auth: Authenticator | None = None) -> None:
        self.store = store
        self.auth = auth or Authenticator()  # no tokens: open (the config allows that on loopback or with --insecure)
        self._on_drain = on_drain  # the server's shutdown path drains, then exits

    def _allow(self, context: grpc.ServicerContext, need: Need, job_id: str = "") -> Principal:
        return self.auth.authorize(token_of(context.invocation_metadata()), need, job_id)

    def _allow_transfer(self, context: grpc.ServicerContext, header: TransferHeader) -> None:
        """A client's save needs its job's access; a copy between stores needs the cluster token."""
        if header.origin is PutOrigin.CLIENT:
            self._allow(context, Need.JOB, header.manifest.key.job_id)
        else:
            self._allow(context, Need.CLUSTER)

    @rpc
    def Hello(self, request: pb.HelloRequest, context: grpc.ServicerContext) -> pb.HelloResponse:
        self._allow(context, Need.ANY)
        report = self.store.hello()
        if not request.known_slots_digest:  # a client, a join check, drain, survey: the whole answer
            return hello_to_pb(report)
        membership = self.store.membership
        newer = membership.answer_gossip(report.slots, request.known_slots_version, request.known_slots_digest, request.asker_host_id)
        return hello_to_pb(report, brief=not newer)

    @rpc
    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthResponse:
        self._allow(context, Need.ANY)
        return health_to_pb(self.store.health())

    @rpc
    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        self._allow(context, Need.JOB, request.key.job_id)
        key = key_from_pb(request.key)
        floor, floor_timeline = floor_from_pb(request)
        try:
            lease_id, segment = self.store.allocate(
                key, request.world_size, request.nbytes, request.preferred_segment, request.ahead, grow=request.grow,
                restorable_floor=floor, floor_timeline=floor_timeline,
            )  # fmt: skip
        except RingBusy:
            if not request.ahead or request.grow:
                raise
            # A reservation ahead found the ring full for now: an answer, not an error (the client asks again).
            return pb.AllocateResponse(ring_busy=True, ring_paths=self.store.ring_paths(key.job_id, key.rank),
                                       ring_limit=self.store.pool.ring_limit, reserve_at_save=self.store.reserve_at_save)  # fmt: skip
        return pb.AllocateResponse(
            lease_id=lease_id,
            segment_path=segment.path or "",
            segment_bytes=segment.size,
            ring_paths=self.store.ring_paths(key.job_id, key.rank),
            lease_seconds=ALLOCATE_LEASE_SECONDS,
            ring_limit=self.store.pool.ring_limit,
            reserve_at_save=self.store.reserve_at_save,
        )

    @rpc
    def Commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> pb.CommitResponse:
        self._allow(context, Need.ANY)  # the lease id, issued to an authorized Allocate, is the capability
        floor, floor_timeline = floor_from_pb(request)
        key = self.store.commit(
            request.lease_id,
            dict(request.metrics),
            request.format_version,
            request.spill_codec,
            key=key_from_pb(request.key) if request.HasField("key") else None,
            nbytes=request.nbytes,
            capture=capture_from_pb(request.capture),
            capture_seconds=request.capture_seconds,
            stripe=stripe_from_pb(request.stripe, request.key.job_id) if request.HasField("stripe") else None,
            restorable_floor=floor,
            floor_timeline=floor_timeline,
            captured_bytes=request.captured_bytes if request.HasField("captured_bytes") else None,
            checksums=client_checksums_from_pb(request),
        )
        return pb.CommitResponse(key=key_to_pb(key))

    @rpc
    def Put(self, request_iterator: Iterator[pb.PutRequest], context: grpc.ServicerContext) -> pb.PutResponse:
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("body") != "header":
            raise InvalidArgument("Put stream must start with a PutHeader message")
        header = transfer_from_pb(first.header)
        self._allow_transfer(context, header)

        def chunks() -> Iterator[bytes]:
            for msg in request_iterator:
                if msg.WhichOneof("body") != "chunk":
                    raise InvalidArgument("Put stream carries a second header; expected only chunks after the first message")
                yield msg.chunk

        manifest = self.store.receive(header, chunks())
        return pb.PutResponse(key=key_to_pb(manifest.key), bytes_received=manifest.nbytes)

    @rpc
    def WaitCommitted(self, request: pb.WaitCommittedRequest, context: grpc.ServicerContext) -> pb.WaitCommittedResponse:
        self._allow(context, Need.JOB, request.key.job_id)
        floor, floor_timeline = floor_from_pb(request)
        info, done = self.store.wait_committed(key_from_pb(request.key), request.timeout_seconds, floor, floor_timeline)
        return pb.WaitCommittedResponse(info=info_to_pb(info), done=done)

    @rpc
    def Open(self, request: pb.OpenRequest, context: grpc.ServicerContext) -> pb.OpenResponse:
        self._allow(context, Need.JOB, request.key.job_id)
        also = [key_from_pb(k) for k in request.also]
        opened = self.store.open_many(key_from_pb(request.key), also, transient=request.transient, reader_verifies=request.reader_verifies)

        def answer(lease: tuple[str, Entry] | None) -> pb.OpenResponse:
            if lease is None:
                return pb.OpenResponse()
            lease_id, entry = lease
            assert entry.manifest is not None
            return pb.OpenResponse(
                lease_id=lease_id, segment_path=entry.segment.path or "", manifest=manifest_to_pb(entry.manifest),
                verified=not request.reader_verifies,
            )  # fmt: skip

        response = answer(opened[0])
        response.also.extend(answer(lease) for lease in opened[1:])
        return response

    @rpc
    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        self._allow(context, Need.ANY)  # the lease id is the capability
        for lease_id in (request.lease_id, *request.also):
            self.store.release(lease_id)
        return pb.ReleaseResponse()

    @stream_rpc
    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> Iterator[pb.GetResponse]:
        self._allow(context, Need.JOB, request.key.job_id)
        for manifest, view in self.store.read(key_from_pb(request.key)):
            yield from get_responses(manifest_to_pb(manifest), view)

    @rpc
    def Fetch(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> pb.FetchResponse:
        self._allow(context, Need.JOB, request.key.job_id)
        manifest, source = self.store.fetch(key_from_pb(request.key), request.discard_local, request.durable_known, request.cached)
        return pb.FetchResponse(manifest=manifest_to_pb(manifest), source_host=source)

    @rpc
    def List(self, request: pb.ListRequest, context: grpc.ServicerContext) -> pb.ListResponse:
        self._allow(context, Need.JOB if request.job_id else Need.CLUSTER, request.job_id)
        shards = self.store.list_shards(request.job_id)
        return pb.ListResponse(host_id=self.store.host_id, shards=[info_to_pb(i) for i in shards], draining=self.store.draining.is_set())

    @rpc
    def Drain(self, request: pb.DrainRequest, context: grpc.ServicerContext) -> pb.DrainResponse:
        self._allow(context, Need.ADMIN)
        if self._on_drain is None:
            raise InvalidArgument(f"store {self.store.host_id} runs embedded without a shutdown path: it cannot drain")
        started = not self.store.draining.is_set()
        self.store.draining.set()  # at once: a second Drain, saves and copies see it before the serve loop wakes
        self._on_drain()
        return pb.DrainResponse(started=started)

    @rpc
    def Delete(self, request: pb.DeleteRequest, context: grpc.ServicerContext) -> pb.DeleteResponse:
        self._allow(context, Need.OWN_JOB, request.job_id)
        return pb.DeleteResponse(deleted=self.store.delete(request.job_id, request.step, request.rank))

    @rpc
    def PrepareReceive(self, request: pb.PutHeader, context: grpc.ServicerContext) -> pb.DataTicket:
        header = transfer_from_pb(request)
        self._allow_transfer(context, header)
        ticket = self.store.prepare_receive(header, request.streams, request.checksums_follow)
        return pb.DataTicket(ticket=ticket, data_port=self.store.data_port, checksums_follow=request.checksums_follow)

    @rpc
    def PrepareSend(self, request: pb.GetRequest, context: grpc.ServicerContext) -> pb.PrepareSendResponse:
        self._allow(context, Need.JOB, request.key.job_id)
        manifest, ticket = self.store.prepare_send(key_from_pb(request.key), request.streams)
        return pb.PrepareSendResponse(manifest=manifest_to_pb(manifest), ticket=ticket, data_port=self.store.data_port)

    @rpc
    def Expect(self, request: pb.ExpectRequest, context: grpc.ServicerContext) -> pb.ExpectResponse:
        self._allow(context, Need.CLUSTER)  # only a peer announces the replicas it will push here
        self.store.expect_stream(request.job_id, request.rank, request.nbytes)
        return pb.ExpectResponse()

    @rpc
    def Contribute(self, request_iterator: Iterator[pb.ContributeRequest], context: grpc.ServicerContext) -> pb.ContributeResponse:
        self._allow(context, Need.CLUSTER)  # only a data host of this store's rows contributes
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("body") != "header":
            raise InvalidArgument("Contribute stream must start with a ContributeHeader message")
        h = first.header
        if h.block_bytes != BLOCK or not 0 < h.blocks <= MAX_CONTRIBUTION_BLOCKS:
            limit = MAX_CONTRIBUTION_BLOCKS
            raise InvalidArgument(f"a contribution of {h.blocks} block(s) of {h.block_bytes} bytes: expected 1..{limit} of {BLOCK}")
        data = bytearray(h.blocks * BLOCK)
        got = 0
        for msg in request_iterator:
            piece = msg.data
            if msg.WhichOneof("body") != "data" or got + len(piece) > len(data):
                raise InvalidArgument(f"Contribute stream: a second header, or more than the {len(data)} bytes its header names")
            data[got : got + len(piece)] = piece
            got += len(piece)
        if got != len(data):
            raise InvalidArgument(f"Contribute stream ended after {got} of its {len(data)} bytes")
        added = self.store.contribute(
            manifest_from_pb(h.manifest), place_from_pb(h.place), h.row, h.first_position, h.blocks, memoryview(data), h.checksum
        )  # fmt: skip
        return pb.ContributeResponse(already=not added)

    @stream_rpc
    def ReadRange(self, request: pb.ReadRangeRequest, context: grpc.ServicerContext) -> Iterator[pb.ReadRangeResponse]:
        self._allow(context, Need.CLUSTER)  # a peer's rebuild or refill
        pieces = self.store.read_range(key_from_pb(request.key), request.offset, request.length, request.stride, request.count)
        for piece in pieces:
            yield pb.ReadRangeResponse(data=bytes(piece))

    @stream_rpc
    def ReadParity(self, request: pb.ReadParityRequest, context: grpc.ServicerContext) -> Iterator[pb.ReadParityResponse]:
        self._allow(context, Need.CLUSTER)  # a peer's rebuild
        if not 0 < request.blocks <= MAX_CONTRIBUTION_BLOCKS:
            raise InvalidArgument(f"ReadParity of {request.blocks} blocks: expected 1..{MAX_CONTRIBUTION_BLOCKS}")
        v = request.version
        contributors, data = self.store.read_parity((v.job_id, v.step, v.timeline), request.row, request.first_position, request.blocks)
        yield pb.ReadParityResponse(contents=pb.ParityContents(block_bytes=BLOCK, contributors=[info_to_pb(i) for i in contributors]))
        view = memoryview(data)
        for start in range(0, len(view), BLOCK):
            yield pb.ReadParityResponse(data=bytes(view[start : start + BLOCK]))

    @rpc
    def LatestStep(self, request: pb.LatestStepRequest, context: grpc.ServicerContext) -> pb.LatestStepResponse:
        self._allow(context, Need.JOB, request.job_id)
        if request.ranks:  # scoped: this rank's view, for agreement over the job's process group
            seen, unreachable = self.store.scoped_versions(request.job_id, list(request.ranks), request.include_durable)
            return seen_to_pb(seen, unreachable)
        return latest_to_pb(self.store.latest_step(request.job_id, request.step if request.HasField("step") else None))
