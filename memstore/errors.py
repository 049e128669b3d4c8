"""Every error of the ``memstore`` package, and its one table between errors and gRPC status codes.

The core raises these; it imports no gRPC, so each class names its status as a string (``status``):
the servicer answers with it (anything else becomes INTERNAL, logged with its traceback), and
:func:`from_status` turns a peer's status (a gRPC call to another store, or the data channel's status
byte) back into the same types. Kinds are types: callers catch classes, never match messages.
Messages say what was expected, what was found and what to do.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base of all store errors. ``status`` names the gRPC status code the servicer answers with."""

    status: str = "INTERNAL"

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


class InvalidArgument(StoreError):
    status = "INVALID_ARGUMENT"


class ConfigError(InvalidArgument):
    """A flag, environment variable or config file value is wrong."""


class PlacementError(ConfigError, ValueError):
    """The host list, replication factor or failure-domain labels don't form a valid placement."""


class NotFound(StoreError):
    status = "NOT_FOUND"


class UnknownJob(NotFound):
    pass


class ShardNotFound(NotFound):
    pass


class AlreadyExists(StoreError):
    status = "ALREADY_EXISTS"


class AlreadySaved(AlreadyExists):
    """A client saved a shard this store already holds under the same (job, step, rank, timeline).

    A re-save of a step must go to a new timeline, or the two saves could mix; the store refuses it.
    """


class CaptureAbandoned(StoreError):
    """A capture the store was pushing while its client wrote it (``CommitRequest.captured_bytes``) was never
    finished: its client stopped making progress. The shard is dropped, with every copy in flight."""

    status = "ABORTED"


class ChecksumMismatch(StoreError):
    """Bytes did not match the checksum computed at capture; the copy was discarded."""

    status = "DATA_LOSS"


class CapacityExceeded(StoreError):
    """A write would exceed the store's RAM budget. Carries the byte counts."""

    status = "RESOURCE_EXHAUSTED"
    limit = "capacity"  # the flag (without --) whose limit was hit: trailing metadata ``memstore-limit``

    def __init__(self, message: str, *, needed: int, used: int, capacity: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.used = used
        self.capacity = capacity

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return (
            ("memstore-needed-bytes", str(self.needed)),
            ("memstore-used-bytes", str(self.used)),
            ("memstore-capacity-bytes", str(self.capacity)),
            ("memstore-limit", self.limit),
        )


class QuotaExceeded(CapacityExceeded):
    """A write would take a job beyond its byte quota on this store (``--job-quota``).

    The byte counts are the job's: ``used`` what it holds here, ``capacity`` its quota.
    """

    limit = "job-quota"

    def __init__(self, message: str, *, job_id: str, needed: int, used: int, quota: int) -> None:
        super().__init__(message, needed=needed, used=used, capacity=quota)
        self.job_id = job_id
        self.quota = quota

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return (*super().trailing_metadata(), ("memstore-job-id", self.job_id))


class RingBusy(StoreError):
    """Memory reserved ahead of a rank's next save found that rank's capture ring full, every segment holding a kept
    step or a save in flight, and retention freed none in time. Nothing was allocated; the next save allocates
    when it comes (and reuses the ring's oldest unprotected step, or grows it a little)."""

    status = "FAILED_PRECONDITION"


class TooManyStreams(StoreError):
    """A sender (a peer store, or one job's clients) has as many transfers open to this store as it may
    (``--max-streams-per-peer``); it retries once one has finished."""

    status = "RESOURCE_EXHAUSTED"
    limit = "max-streams-per-peer"

    def __init__(self, message: str, *, sender: str, active: int, max_streams: int) -> None:
        super().__init__(message)
        self.sender = sender
        self.active = active
        self.max_streams = max_streams

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return (
            ("memstore-active-streams", str(self.active)),
            ("memstore-max-streams", str(self.max_streams)),
            ("memstore-limit", self.limit),
        )


class PeerUnavailable(StoreError):
    """A peer store could not be reached or failed the request."""

    status = "UNAVAILABLE"


class Draining(PeerUnavailable):
    """The store is leaving on purpose (SIGTERM or ``memstore drain``) and takes no new shards or copies."""


class Superseded(StoreError):
    """An in-flight older step was dropped because a newer step of the same rank arrived."""

    status = "ABORTED"


class LeaseError(StoreError):
    status = "FAILED_PRECONDITION"


class Unauthenticated(StoreError):
    """The call carries no auth token, or one the store does not know (the token is never echoed)."""

    status = "UNAUTHENTICATED"


class AccessDenied(StoreError):
    """The caller's token does not allow this call (another job's data, a store-level or admin operation)."""

    status = "PERMISSION_DENIED"


class IdentityMismatch(StoreError):
    """A peer answered with a different host id or cluster layout than this store expects."""

    status = "FAILED_PRECONDITION"


class Unimplemented(StoreError):
    status = "UNIMPLEMENTED"


# -- wire streams and the bulk data channel ----------------------------------------------------


class StreamError(InvalidArgument):
    """A chunk stream broke the wire contract: wrong chunk size, too many or too few chunks."""


class OversizedChunk(StreamError):
    """A chunk is larger than the manifest's chunk size."""


class ManifestTooLarge(StreamError):
    """A manifest from the network carries more than a shard may have (chunk checksums, metrics); refused before it is converted."""


class StreamChecksumError(StreamError, ChecksumMismatch):
    """A chunk did not match the checksum its manifest carries; nothing was stored."""

    status = "DATA_LOSS"


class DataChannelError(PeerUnavailable):
    """The bulk data connection broke, timed out, or the peer refused the bytes."""


class DataChannelUnsupported(Unimplemented):
    """The peer has no bulk data channel; use the gRPC stream instead."""


# -- durable tier ------------------------------------------------------------------------------


class SpillStorageError(StoreError):
    """Durable storage failed. The subclass says how; ``kind`` is its short name for status output."""

    status = "UNAVAILABLE"
    kind = "other"


class SpillPermissionDenied(SpillStorageError):
    status = "PERMISSION_DENIED"
    kind = "permission"


class SpillStorageFull(SpillStorageError):
    status = "RESOURCE_EXHAUSTED"
    kind = "full"


class SpillUnreachable(SpillStorageError):
    kind = "unavailable"


class SpillCorrupt(SpillStorageError, ChecksumMismatch):
    """A spilled shard failed its capture checksums (or is truncated)."""

    status = "DATA_LOSS"
    kind = "corrupt"


class LayoutError(InvalidArgument, ValueError):
    """A durable-storage name or manifest does not match the layout."""


class CodecError(InvalidArgument, ValueError):
    """A spilled chunk cannot be decoded with its codec."""


class SpillExportError(StoreError):
    """A spilled DCP step cannot be exported to plain DCP files (memstore.interop.dcp_export)."""


# -- erasure coding -------------------------------------------------------------------------------------


class ErasureUnavailable(ConfigError):
    """``--redundancy ec:K+M`` with ``M >= 2`` needs the Reed-Solomon library of the ``erasure`` extra
    (``pip install 'memstore[erasure]'``), and it is not installed. (``M = 1`` is XOR and needs nothing.)"""


class UnrecoverableLoss(StoreError):
    """More columns of an erasure-coded row (or hosts of a group) are lost than its parity survives.

    ``missing`` is how many are lost, ``tolerated`` how many the code survives (its ``M``). The bytes cannot be
    rebuilt from RAM; a spilled copy, if any, is what is left.
    """

    status = "DATA_LOSS"

    def __init__(self, message: str, *, missing: int, tolerated: int) -> None:
        super().__init__(message)
        self.missing = missing
        self.tolerated = tolerated


# -- fault injection and tools -------------------------------------------------------------------


class FaultInjected(StoreError):
    """Raised by the ``error`` action of a fault point (MEMSTORE_FAULTS)."""

    status = "UNAVAILABLE"


class FaultConfigError(ConfigError):
    """MEMSTORE_FAULTS names an unknown point or action."""


class ExportFailed(StoreError):
    """``memstore export`` cannot produce the file; the message says why."""


class DemoFailure(StoreError):
    """The demo (or the chaos run) ended without a bit-identical result or within its deadline."""


class BenchSetupError(StoreError):
    """``memstore bench`` cannot run as asked (an unreachable --endpoints cluster, nothing fits in RAM)."""


class StaleLock(StoreError):
    """A shared-memory directory's lock file was replaced while being taken; take it again."""


# -- membership discovery --------------------------------------------------------------------------


class DiscoveryError(StoreError):
    """A discovery source (--peers-file, --discovery dns://, fed members) gave no usable membership.

    UNAVAILABLE: the membership cannot be learned right now and asking again later may succeed (a file
    being rewritten, a DNS server down or not yet serving the new pods); the watcher keeps polling and
    keeps the last good membership meanwhile. The message names the source and what was wrong.
    """

    status = "UNAVAILABLE"


# -- the status table ------------------------------------------------------------------------------

_BY_STATUS: dict[str, type[StoreError]] = {
    "INVALID_ARGUMENT": InvalidArgument,
    "NOT_FOUND": NotFound,
    "ALREADY_EXISTS": AlreadyExists,
    "DATA_LOSS": ChecksumMismatch,
    "RESOURCE_EXHAUSTED": CapacityExceeded,
    "UNAVAILABLE": PeerUnavailable,
    "DEADLINE_EXCEEDED": PeerUnavailable,
    "CANCELLED": PeerUnavailable,
    "ABORTED": Superseded,
    "FAILED_PRECONDITION": IdentityMismatch,
    "UNIMPLEMENTED": Unimplemented,
    "UNAUTHENTICATED": Unauthenticated,
    "PERMISSION_DENIED": AccessDenied,
}


def from_status(status: str, message: str, *, needed: int = 0, used: int = 0, capacity: int = 0) -> StoreError:
    """The typed error for a status a peer answered with (gRPC code name or the data channel's status word)."""
    cls = _BY_STATUS.get(status, StoreError)
    if cls is CapacityExceeded:
        return CapacityExceeded(message, needed=needed, used=used, capacity=capacity)
    return cls(message)


# -- Ray ---------------------------------------------------------------------------------------------


class RayStoreError(StoreError):
    """A store actor on a Ray node could not be started, found or reached (memstore.ray); the message names the node."""

    status = "UNAVAILABLE"


class RayTrainError(StoreError):
    """Ray Train's checkpoint pointer and memstore disagree (memstore.ray.train): the step it names cannot be restored."""

    status = "NOT_FOUND"
