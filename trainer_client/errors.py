"""Every error of the ``trainer_client`` package, and its one table from a store's gRPC status to them.

Every error says what was expected, what was found and, where it helps, what to do. Everything that
talks to a store from the client side (``CheckpointClient``, the DCP reader/writer, ``memstore export``,
the CLI) turns a failed call into one of these with :func:`raise_for_rpc`.
"""

from __future__ import annotations

from typing import NoReturn

import grpc

from memstore.v1.channel import capacity_numbers


class MemstoreClientError(Exception):
    """Base class of every error raised by ``trainer_client``."""


class SerializationError(MemstoreClientError, TypeError):
    """The state holds a value memstore cannot capture without pickling.

    ``path`` names where in the state the value sits, e.g. ``state['optim'][3]``.
    """

    def __init__(self, message: str, path: str = "state") -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


class CorruptShardError(MemstoreClientError):
    """Shard bytes failed a format or checksum check; the copy must be discarded."""


class InvalidArgumentError(MemstoreClientError, ValueError):
    """A caller passed a value outside what the API accepts (bad job id, negative step, ...)."""


class StoreUnavailableError(MemstoreClientError):
    """The store could not be reached or did not answer within the deadline."""


class CapacityExceededError(MemstoreClientError):
    """The store refused a write because it would exceed its RAM budget.

    ``needed``, ``used`` and ``capacity`` are byte counts reported by the store.
    """

    def __init__(self, message: str, needed: int = 0, used: int = 0, capacity: int = 0) -> None:
        super().__init__(message)
        self.needed = needed
        self.used = used
        self.capacity = capacity


class ReplicationError(MemstoreClientError):
    """A shard did not reach its replication factor; the message says which peer failed and why."""


class RingBusyError(MemstoreClientError):
    """The memory reserved ahead of a rank's next save: the store found that rank's capture ring full (every segment
    holding a kept step or a save in flight) until the client stopped asking. Nothing was reserved; the next save
    allocates when it comes. Internal to the capture ring: ``save()`` never raises it."""


class CaptureError(MemstoreClientError):
    """Copying the state's CUDA tensors into host memory failed (a CUDA error on the copy or its event).

    Raised by ``save()`` (``capture="copied"``) or by the handle's ``wait_captured()`` / ``wait()``
    (``capture="enqueued"``); the shard was not committed.
    """


class ReplicaMismatchError(MemstoreClientError):
    """The members of a replica group do not hold the same state (``verify_replicas=True``); nothing was saved.

    ``ranks``: the job ranks whose state differs from the majority's (on a tie ``tie`` is True and they are the
    ranks that differ from the group's first member), or that could not fingerprint theirs; ``members``: the job
    ranks of the replica group. Raised on every member alike.
    """

    def __init__(self, message: str, ranks: tuple[int, ...] = (), members: tuple[int, ...] = (), tie: bool = False) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.members = members
        self.tie = tie


class AlreadySavedError(InvalidArgumentError):
    """The store already holds this rank's shard of this step on this timeline: a re-save needs a new timeline."""


class CheckpointExistsError(MemstoreClientError, RuntimeError):
    """``MemStoreWriter(overwrite=False)`` was asked to save a step that is already restorable.

    A ``RuntimeError``, like the one ``FileSystemWriter(overwrite=False)`` raises; ``dcp.save`` reports
    it inside a ``CheckpointException``.
    """


class AuthenticationError(MemstoreClientError, PermissionError):
    """The store refused the call's credentials: no token, an unknown token, or TLS it does not accept."""


class AccessDeniedError(MemstoreClientError, PermissionError):
    """The token is valid but does not allow this (another job's data, an admin operation)."""


class NotFoundError(MemstoreClientError, LookupError):
    """The requested job, step or shard does not exist anywhere it was looked for."""


class NoCheckpointError(NotFoundError):
    """Nothing restorable exists for the job (no step has a verified copy for every rank)."""


_BY_STATUS: dict[grpc.StatusCode, type[MemstoreClientError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.DATA_LOSS: CorruptShardError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadySavedError,
    grpc.StatusCode.UNAVAILABLE: StoreUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: StoreUnavailableError,
    grpc.StatusCode.CANCELLED: StoreUnavailableError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: AccessDeniedError,
}


def error_for_rpc(err: grpc.RpcError, what: str) -> MemstoreClientError:
    """The typed error for a failed call to a store; ``what`` names the operation."""
    code = err.code()
    detail = err.details() or ""
    message = f"{what}: {detail}" if detail else f"{what}: {code.name}"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return CapacityExceededError(message, **capacity_numbers(err))
    cls = _BY_STATUS.get(code)
    return cls(message) if cls is not None else MemstoreClientError(f"{message} ({code.name})")


def raise_for_rpc(err: grpc.RpcError, what: str) -> NoReturn:
    """Raise :func:`error_for_rpc` of ``err`` (without the gRPC traceback)."""
    raise error_for_rpc(err, what) from None
