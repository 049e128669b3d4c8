"""Every conversion between the wire messages (memstore.v1) and the core's plain types, for the store.

The engine (``memstore.server.store``) speaks only core types; the servicer converts requests and
responses here, the peer client (``memstore.server.peers``) converts what it sends to and receives
from other stores, and the sidecars of segments (``memstore.server.memory.leftovers``: written for the catalog, read at
adoption) are encoded and decoded through ``sidecar_bytes`` and ``sidecar_info``. Keys and manifests are
converted by ``memstore.v1.manifests`` (the trainer client needs them too) and re-exported here.
"""

from __future__ import annotations

import dataclasses

from memstore.core.agreement import Seen
from memstore.core.model import ErasurePlace, ParityCover, PutOrigin, ShardInfo, ShardState, TransferHeader
from memstore.core.restorable import RestoreAnswer
from memstore.core.slots import Slot, SlotTable
from memstore.core.status import CaptureReport, HealthReport, HelloReport
from memstore.errors import InvalidArgument
from memstore.v1 import store_pb2 as pb
from memstore.v1.integrity import ChunkChecksums
from memstore.v1.keys import timeline_problem
from memstore.v1.manifests import key_from_pb, key_to_pb, manifest_from_pb, manifest_to_pb, set_floor, stripe_from_pb

__all__ = [
    "health_to_pb",
    "hello_from_pb",
    "hello_to_pb",
    "info_from_pb",
    "info_to_pb",
    "key_from_pb",
    "key_to_pb",
    "latest_to_pb",
    "manifest_from_pb",
    "manifest_to_pb",
    "place_from_pb",
    "place_to_pb",
    "seen_to_pb",
    "sidecar_bytes",
    "sidecar_info",
    "state_from_pb",
    "state_to_pb",
    "stripe_from_pb",
    "transfer_from_pb",
    "transfer_to_pb",
]

_STATE_TO_PB: dict[ShardState, int] = {
    ShardState.CAPTURED: pb.SHARD_STATE_CAPTURED,
    ShardState.REPLICATING: pb.SHARD_STATE_REPLICATING,
    ShardState.COMMITTED: pb.SHARD_STATE_COMMITTED,
    ShardState.UNDER_REPLICATED: pb.SHARD_STATE_UNDER_REPLICATED,
    ShardState.REPLICA: pb.SHARD_STATE_REPLICA,
    ShardState.PARITY: pb.SHARD_STATE_PARITY,
}
_STATE_FROM_PB = {v: k for k, v in _STATE_TO_PB.items()}

_ORIGIN_TO_PB: dict[PutOrigin, int] = {
    PutOrigin.CLIENT: pb.PUT_ORIGIN_CLIENT,
    PutOrigin.REPLICA: pb.PUT_ORIGIN_REPLICA,
    PutOrigin.REPAIR: pb.PUT_ORIGIN_REPAIR,
}
_ORIGIN_FROM_PB = {v: k for k, v in _ORIGIN_TO_PB.items()}


def state_to_pb(state: ShardState | None) -> pb.ShardState:
    return pb.SHARD_STATE_UNSPECIFIED if state is None else _STATE_TO_PB[state]  # type: ignore[return-value]


def state_from_pb(state: int) -> ShardState | None:
    return _STATE_FROM_PB.get(state)


# -- shard reports and sidecars -------------------------------------------------------
def capture_from_pb(c: pb.CaptureStats) -> CaptureReport:
    return CaptureReport(c.registrations, c.fallbacks, c.fallback_cause)


def client_checksums_from_pb(request: pb.CommitRequest) -> ChunkChecksums | None:
    """The chunk checksums a Commit carries (``CommitRequest.chunk_checksums``), or None when it carries none."""
    if not request.chunk_checksums:
        return None
    return ChunkChecksums(request.chunk_size, tuple(request.chunk_checksums), request.checksum_algo)


def place_to_pb(place: ErasurePlace) -> pb.ErasurePlace:
    return pb.ErasurePlace(group=list(place.group), column=place.column, m=place.m, offset=place.offset)


def place_from_pb(place: pb.ErasurePlace) -> ErasurePlace:
    return ErasurePlace(tuple(place.group), place.column, place.m, place.offset)


def info_to_pb(info: ShardInfo) -> pb.ShardInfo:
    out = pb.ShardInfo(
        manifest=manifest_to_pb(info.manifest),
        state=state_to_pb(info.state),
        verified=info.verified,
        error=info.error,
        copies=info.copies,
        superseded=info.superseded,
        cached=info.cached,
    )
    if info.erasure is not None:
        out.erasure.CopyFrom(place_to_pb(info.erasure))
    if info.parity is not None:
        cover = info.parity
        needs = [key_to_pb(k) for k in cover.needs]
        out.parity.CopyFrom(pb.ParityCover(row=cover.row, place=place_to_pb(cover.place), needs=needs, spans=list(cover.spans)))
    return out


def info_from_pb(info: pb.ShardInfo) -> ShardInfo:
    erasure = place_from_pb(info.erasure) if info.HasField("erasure") else None
    parity = None
    if info.HasField("parity"):
        p = info.parity
        parity = ParityCover(p.row, place_from_pb(p.place), tuple(p.spans), tuple(key_from_pb(k) for k in p.needs))
    return ShardInfo(
        manifest_from_pb(info.manifest), state_from_pb(info.state), info.verified, info.error, info.copies, info.superseded, info.cached,
        erasure, parity,
    )  # fmt: skip


def sidecar_bytes(info: ShardInfo) -> bytes:
    """What the sidecar of a segment holds: the serialized ``memstore.v1.ShardInfo`` (a restarted store adopts it)."""
    return info_to_pb(info).SerializeToString()


def sidecar_info(meta: bytes) -> ShardInfo:
    """The ShardInfo a sidecar holds; raises ``google.protobuf.message.DecodeError`` on malformed bytes."""
    return info_from_pb(pb.ShardInfo.FromString(meta))


# -- restorable floors ------------------------------------------------------------------
def floor_from_pb(message: pb.CommitRequest | pb.WaitCommittedRequest | pb.PutHeader | pb.AllocateRequest) -> tuple[int | None, str]:
    """The restorable floor ``message`` carries: (its step, its timeline; "" = the shard's), (None, "") if none
    (``memstore.core.floors``). InvalidArgument when it sets both forms or names an invalid timeline."""
    if not message.HasField("restorable_floor_version"):
        return (message.restorable_floor if message.HasField("restorable_floor") else None), ""
    if message.HasField("restorable_floor"):
        raise InvalidArgument("restorable_floor and restorable_floor_version are both set: expected one of them")
    version = message.restorable_floor_version
    problem = timeline_problem(version.timeline)
    if problem:
        raise InvalidArgument(f"restorable_floor_version: {problem}")
    return version.step, version.timeline


# -- transfers --------------------------------------------------------------------------
def transfer_to_pb(header: TransferHeader) -> pb.PutHeader:
    msg = pb.PutHeader(
        manifest=manifest_to_pb(header.manifest), origin=_ORIGIN_TO_PB[header.origin], sender_host=header.sender_host,  # type: ignore[arg-type]
    )  # fmt: skip
    set_floor(msg, header.restorable_floor, header.restorable_floor_timeline)
    return msg


def transfer_from_pb(header: pb.PutHeader) -> TransferHeader:
    """The header of an incoming shard; InvalidArgument unless it names who sends it (origin)."""
    origin = _ORIGIN_FROM_PB.get(header.origin)
    if origin is None:
        what = "unspecified" if header.origin == pb.PUT_ORIGIN_UNSPECIFIED else f"{header.origin} (unknown)"
        raise InvalidArgument(f"PutHeader.origin is {what}: expected CLIENT, REPLICA or REPAIR")
    floor, floor_timeline = floor_from_pb(header)
    return TransferHeader(manifest_from_pb(header.manifest), origin, header.sender_host, floor, floor_timeline)


# -- answers ----------------------------------------------------------------------------
def latest_to_pb(answer: RestoreAnswer) -> pb.LatestStepResponse:
    resp = pb.LatestStepResponse(found=answer.version is not None, unreachable_hosts=list(answer.unreachable_hosts), note=answer.note)
    if answer.version is not None:
        resp.step, resp.world_size, resp.timeline = answer.version.step, answer.version.world_size, answer.version.timeline
    return resp


def seen_to_pb(seen: list[Seen], unreachable: list[str]) -> pb.LatestStepResponse:
    versions = [pb.SeenVersion(step=v.step, timeline=v.timeline, world_size=v.world_size, created_unix=v.created_unix,
                               ranks=v.ranks, durable=v.durable) for v in seen]  # fmt: skip
    return pb.LatestStepResponse(found=bool(seen), versions=versions, unreachable_hosts=unreachable)


def hello_to_pb(h: HelloReport, brief: bool = False) -> pb.HelloResponse:
    """``brief``: a gossip answer to an asker whose table is as new as ours: the slot table and the member list (the
    parts that grow with the cluster) are left out, so the answer's size does not depend on the cluster's."""
    values = {f.name: getattr(h, f.name) for f in dataclasses.fields(h)}  # same names on both sides
    if brief:
        values.update(slots=None, peer_ids=(), peer_addresses=())
        return pb.HelloResponse(**{k: v for k, v in values.items() if v is not None}, slots_omitted=True)
    return pb.HelloResponse(**{**values, "slots": slots_to_pb(h.slots)})


def slots_to_pb(t: SlotTable) -> pb.SlotTable:
    return pb.SlotTable(
        version=t.version,
        slots=[
            pb.Slot(
                index=s.index,
                host_id=s.host_id,
                address=s.address,
                domain=s.domain,
                former=list(s.former),
                former_until=list(s.former_until),
            )
            for s in t.slots
        ],
    )


def slots_from_pb(t: pb.SlotTable) -> SlotTable:
    """A peer's slot table; SlotTableError if it is malformed (validated like any table)."""
    return SlotTable(
        t.version, tuple(Slot(s.index, s.host_id, s.address, s.domain, tuple(s.former), tuple(s.former_until)) for s in t.slots)
    )


def hello_from_pb(h: pb.HelloResponse) -> HelloReport:
    values = {f.name: getattr(h, f.name) for f in dataclasses.fields(HelloReport)}
    values.update(peer_ids=tuple(h.peer_ids), peer_addresses=tuple(h.peer_addresses), slots=slots_from_pb(h.slots))
    return HelloReport(**values)


def health_to_pb(h: HealthReport) -> pb.HealthResponse:
    return pb.HealthResponse(
        serving=h.serving,
        host_id=h.host_id,
        used_bytes=h.used_bytes,
        pooled_bytes=h.pooled_bytes,
        reserve_bytes=h.reserve_bytes,
        reserve_filling=h.reserve_filling,
        capacity_bytes=h.capacity_bytes,
        shards=h.shards,
        replications_in_flight=h.replications_in_flight,
        repairs_in_flight=h.repairs_in_flight,
        uptime_seconds=h.uptime_seconds,
        spill_url=h.spill_url,
        spill=[
            pb.SpillStatus(
                job_id=s.job_id,
                last_spilled_step=s.last_spilled_step,
                last_spill_unix=s.last_spill_unix,
                consecutive_failures=s.consecutive_failures,
                last_error=s.last_error,
                bytes_written=s.bytes_written,
            )
            for s in h.spill
        ],
        adopted_shards=h.adopted_shards,
        orphans=[pb.OrphanedSegments(path=o.path, host_id=o.host_id, bytes=o.bytes, files=o.files) for o in h.orphans],
        draining=h.draining,
        drain_progress=h.drain_progress,
        slots=slots_to_pb(h.slots),
        not_ready=h.not_ready,
        capture=pb.CaptureStats(
            registrations=h.capture.registrations, fallbacks=h.capture.fallbacks, fallback_cause=h.capture.fallback_cause
        ),
        saves_superseded=h.saves_superseded,
        jobs_memory=[pb.JobMemory(job_id=j.job_id, in_use_bytes=j.in_use_bytes, pooled_bytes=j.pooled_bytes) for j in h.jobs_memory],
        ring_overflows=h.ring_overflows,
        ring_limit=h.ring_limit,
        scrubbed_bytes=h.scrubbed_bytes,
        scrub_corrupt=h.scrub_corrupt,
        discovery=None
        if h.discovery is None
        else pb.DiscoveryStatus(
            source=h.discovery.source,
            members=h.discovery.members,
            last_ok_unix=h.discovery.last_ok_unix,
            error=h.discovery.error,
            consecutive_failures=h.discovery.consecutive_failures,
        ),
    )
