"""The records the store engine keeps (entries, leases, inbound transfers) and small checks they share.

The catalog (``memstore.server.engine.catalog``) holds them under its lock; the engine's other parts read their fields
and hand them back to the catalog's methods, which alone change them. The data channel's tickets refer to them
(``memstore.server.engine.tickets``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from memstore.core.model import ErasurePlace, Holding, Manifest, PutOrigin, ShardInfo, ShardKey, ShardState, Stripe
from memstore.errors import ChecksumMismatch, InvalidArgument
from memstore.server.engine.progress import CaptureProgress
from memstore.server.memory.segment import Segment
from memstore.v1.integrity import SPILL_CODECS

ALLOCATE_LEASE_SECONDS = 600.0  # a trainer that allocated but never committed (it crashed) frees the segment after this
READ_LEASE_SECONDS = 600.0
GONE_REMEMBERED = 4096  # own shards dropped lately whose outcome WaitCommitted still reports


@dataclass
class Entry:
    key: ShardKey
    world_size: int
    nbytes: int
    segment: Segment
    owner_host: str
    state: ShardState
    manifest: Manifest | None = None  # None until checksums are computed
    error: str = ""
    copies: int = 1
    pins: int = 0
    dropped: bool = False  # removed from the catalog while pinned; segment freed at last unpin
    metrics: dict[str, float] = field(default_factory=dict)
    format_version: int = 0
    created_unix: float = field(default_factory=time.time)
    source: str = ""  # peer a pulled copy came from
    spill_codec: str = ""  # the job's choice of durable codec ("" = the store's default)
    stripe: Stripe | None = None  # a stripe of a replica group's save (named at Commit); None: an ordinary shard
    checksumming: bool = False  # replication took it up (its checksums are being computed): no longer supersedable
    superseded: bool = False  # dropped before replication: a newer save of its rank came first (newest wins)
    allocated_at: float = field(default_factory=time.monotonic)  # when this entry was made (Allocate, or registration)
    taken_at: float = 0.0  # when the store took a client's save in (Commit, or its stream's end): replication starts
    cached: bool = False  # pulled ahead of a restore (memstore.server.engine.assembler): the first dropped under pressure
    arrived_verified: float = 0.0  # monotonic time a pull landed with every chunk verified; the first Open soon after skips hashing
    progress: CaptureProgress | None = None  # a capture pushed while its client writes it (memstore.server.engine.progress)
    client_checksums: tuple[int, ...] | None = None  # its chunks' checksums as its client computed them (Commit): none to compute
    erasure: ErasurePlace | None = None  # ec:K+M: where this owned shard lies in its part (memstore.server.engine.encoding)

    @property
    def verified(self) -> bool:
        return self.manifest is not None and self.state is not ShardState.CAPTURED

    def info(self) -> ShardInfo:
        """This copy as the store reports it (listings, commit status, its sidecar)."""
        m = self.manifest
        if m is None:  # not checksummed yet: what is known of it
            m = Manifest(self.key, self.world_size, self.nbytes, chunk_size=0, checksums=(), owner_host=self.owner_host, stripe=self.stripe)
        return ShardInfo(m, self.state, self.verified, self.error, self.copies, self.superseded, self.cached, self.erasure)


@dataclass
class Inbound:
    key: ShardKey
    manifest: Manifest
    origin: PutOrigin
    segment: Segment
    sender: str = ""  # whom the transfer counts against (memstore.core.limits.transfer_sender)
    started: float = field(default_factory=time.monotonic)  # when its header was accepted


def sender_error(exc: BaseException) -> BaseException:
    """The error the sender of a failed transfer sees: stream and channel errors are typed already."""
    if isinstance(exc, ChecksumMismatch):
        return type(exc)(f"{exc}; the copy was discarded, the sender should retry")
    return exc


@dataclass
class Lease:
    entry: Entry
    expires: float
    ahead: bool = False  # an allocation for a rank's next save, whose step is named at commit


def codec_problem(codec: str) -> str | None:
    if codec and codec not in SPILL_CODECS:
        return f"spill codec {codec!r} is unknown: expected one of {', '.join(SPILL_CODECS)} (or empty for the store's default)"
    return None


def ensure(problem: str | None) -> None:
    if problem:
        raise InvalidArgument(problem)


def holdings_of(host: str, shards: Iterable[ShardInfo]) -> list[Holding]:
    """What ``host`` listed, as the core's holdings: its copies, and the shards its parity covers (ec:K+M)."""
    return [
        Holding(host, i.manifest.key, i.manifest.world_size, i.verified and i.parity is None, i.manifest.created_unix, i.parity, settled)
        for i in shards
        for settled in [i.state is not None and i.state.settled]  # a state a newer store knows: not known settled
    ]


def bind_problem(lease: Lease, key: ShardKey | None, nbytes: int) -> str | None:
    """What is wrong with committing ``lease`` as ``key`` of ``nbytes`` (ahead leases name their shard at commit)."""
    held = lease.entry
    if not lease.ahead:
        if key is not None and key != held.key:
            return f"commit names shard {key} but the lease holds {held.key}"
        if nbytes and nbytes != held.nbytes:
            return f"commit names {nbytes} bytes but the lease was allocated for {held.nbytes}"
        return None
    if key is None:
        return "an ahead lease (allocated before its step was known) needs the shard's key at commit"
    if (key.job_id, key.rank) != (held.key.job_id, held.key.rank):
        return f"commit names shard {key} but the ahead lease is rank {held.key.rank} of job {held.key.job_id!r}"
    if nbytes < 0 or nbytes > held.segment.size:
        return f"commit names {nbytes} bytes but the ahead lease's segment holds {held.segment.size}"
    return None
