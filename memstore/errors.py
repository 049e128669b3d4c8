"""Typed errors of the store server and the one table mapping them to gRPC status codes.

The core raises these; it imports no gRPC, so each class names its status as a string
(``status``) and the servicer turns it into a ``grpc.StatusCode``. Anything else becomes INTERNAL and
is logged with its traceback.
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


class ChecksumMismatch(StoreError):
    """Bytes did not match the checksum computed at capture; the copy was discarded."""

    status = "DATA_LOSS"


class CapacityExceeded(StoreError):
    """A write would exceed the store's RAM budget. Carries the byte counts."""

    status = "RESOURCE_EXHAUSTED"

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
        )


class PeerUnavailable(StoreError):
    """A peer store could not be reached or failed the request."""

    status = "UNAVAILABLE"


class Superseded(StoreError):
    """An in-flight older step was dropped because a newer step of the same rank arrived."""

    status = "ABORTED"


class LeaseError(StoreError):
    status = "FAILED_PRECONDITION"


class IdentityMismatch(StoreError):
    """A peer answered with a different host id or cluster layout than this store expects."""

    status = "FAILED_PRECONDITION"
