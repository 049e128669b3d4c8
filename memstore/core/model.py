"""Plain data types of the store: shard keys, manifests, the states a held copy goes through, the header of a
transfer and what a store reports about one copy."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True, order=True)
class ShardKey:
    """Address of one shard: (job, step, rank) of one save.

    ``timeline`` names the save that produced it (a run's timeline, or one DCP save). Two saves of the
    same step are different shards: a step is restorable only from copies of one timeline.
    """

    job_id: str
    step: int
    rank: int
    timeline: str = ""

    def __str__(self) -> str:
        where = f"{self.job_id}/step={self.step}/rank={self.rank}"
        return f"{where}@{self.timeline}" if self.timeline else where

    @property
    def version(self) -> tuple[int, str]:
        """(step, timeline): one saved version of one step."""
        return self.step, self.timeline


@dataclass(frozen=True)
class Stripe:
    """One member's stripe of a data-parallel replica group's save (``CheckpointClient(replica_group=...)``).

    The group's members promised identical states; each saves, under its own rank, an ordinary shard holding
    1/len(group) of the encoded bytes of that state (its stripe) plus its own unreplicated part. The store keeps,
    replicates and spills such a shard like any other; the stripe says what it holds, for ``ls``/``inspect``/``status``.
    """

    group: tuple[int, ...]  # the job ranks of the replica group, in stripe order: this shard's rank is group[index]
    index: int  # this shard's position in ``group``
    logical_nbytes: int  # encoded size of the group's replicated state: every stripe of it together
    stripe_nbytes: int  # of those, the bytes this stripe holds (the rest of the shard: the rank's own part and framing)
    slices_only: bool = False  # the shard holds only its slices (no own part); False: it has one, or its client did not say


@dataclass(frozen=True)
class Manifest:
    """Layout and integrity data of one shard, fixed when the shard is captured."""

    key: ShardKey
    world_size: int
    nbytes: int
    chunk_size: int
    checksums: tuple[int, ...]
    owner_host: str
    format_version: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    created_unix: float = 0.0
    spill_codec: str = ""  # per-job codec of the durable tier; "" = the store's default
    stripe: Stripe | None = None  # a stripe of a replica group's save; None: an ordinary shard


class ShardState(enum.Enum):
    CAPTURED = "captured"  # owner holds the bytes, checksums not yet computed
    REPLICATING = "replicating"  # verified locally, being pushed to group peers
    COMMITTED = "committed"  # R verified copies acknowledged
    UNDER_REPLICATED = "under_replicated"  # push failed; the local copy stays, repair may fix it
    REPLICA = "replica"  # verified copy held for another host, or pulled back by repair
    PARITY = "parity"  # no copy: a parity host's record of a shard its fragment covers (ec:K+M; ``ShardInfo.parity``)

    @property
    def settled(self) -> bool:
        """True once the copy is verified and no longer in flight on this store."""
        return self in (ShardState.COMMITTED, ShardState.UNDER_REPLICATED, ShardState.REPLICA)


@dataclass(frozen=True)
class ErasurePlace:
    """Where an owned shard sits in its host's erasure-coded *part* of one version (``--redundancy ec:K+M``).

    A host's shards of one (job, step, timeline) lie one after another in its part, each at the block-aligned
    ``offset`` its store gave it when it completed; ``group`` names the slots of the host's group in slot order (the
    codec's columns: ``memstore.core.erasure_layout``), ``column`` the owner's index in it, and ``m`` the parity
    columns of every row."""

    group: tuple[str, ...]  # slot names, in slot order
    column: int  # the owner's index in ``group``
    m: int
    offset: int  # bytes into the owner's part, a multiple of the block size


@dataclass(frozen=True)
class ParityCover:
    """A parity host's word on one data shard its fragment of one row covers (``ShardInfo.parity``).

    ``needs``: the other data shards whose blocks share the fragment's positions with this one. The shard can be rebuilt
    from this row's parity while at most as many of those (plus the shard itself) are missing as parity fragments of the
    row survive (``memstore.core.rebuildable``)."""

    row: int
    place: ErasurePlace  # the shard's place in its owner's part
    spans: tuple[int, ...]  # every row the shard's blocks fall in (each has parity hosts of its own)
    needs: tuple[ShardKey, ...] = ()


@dataclass(frozen=True)
class Holding:
    """One copy of one shard as reported by one store (input to 'latest restorable step')."""

    host: str
    key: ShardKey
    world_size: int
    verified: bool
    created_unix: float = 0.0  # when the owner captured it; orders versions of different timelines
    parity: ParityCover | None = None  # no copy: ``host`` holds parity that covers ``key`` (ec:K+M); never verified
    settled: bool = True  # no longer in flight (ec: its parity complete, or failed for good); False: still being protected


class PutOrigin(enum.Enum):
    """Who sends a shard to a store; it decides whose copy the received shard becomes."""

    CLIENT = "client"  # a trainer rank's save: the receiving store owns it and replicates it to its group
    REPLICA = "replica"  # an owner pushing its shard to a group peer
    REPAIR = "repair"  # a copy sent to restore the replication factor


@dataclass(frozen=True)
class TransferHeader:
    """What precedes a shard's bytes on a transfer (a Put stream or a data-channel push)."""

    manifest: Manifest
    origin: PutOrigin
    sender_host: str = ""
    restorable_floor: int | None = None  # the sender's restorable floor of the shard's job and timeline (core.floors)
    restorable_floor_timeline: str = ""  # the floor's timeline when it is not the shard's ("": the shard's)


@dataclass(frozen=True)
class ShardInfo:
    """One copy of one shard as a store reports it (listings, commit status, the sidecar of its segment).

    Until its checksums are computed (CAPTURED) the copy has no real manifest: ``manifest`` then
    carries the key, world size, size and owner only (``chunk_size`` 0, no checksums).
    """

    manifest: Manifest
    state: ShardState | None  # None: a state this version does not know (reported by a newer store)
    verified: bool
    error: str = ""  # why replication failed, when it did
    copies: int = 0  # the owner's count of acknowledged copies, its own included
    superseded: bool = False  # not replicated: a newer save of the same rank was captured first (newest wins)
    cached: bool = False  # pulled ahead of a restore (another member's stripe): spare room, first to go, not one of R copies
    erasure: ErasurePlace | None = None  # an owner's copy under ec:K+M: where it lies in its part (parity covers it there)
    parity: ParityCover | None = None  # state PARITY: no copy, the listing store's parity covers the shard (ec:K+M)
