"""Typed errors raised by the trainer client.

Every error says what was expected, what was found and, where it helps, what to do.
"""

from __future__ import annotations


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


class AlreadySavedError(InvalidArgumentError):
    """The store already holds this rank's shard of this step on this timeline: a re-save needs a new timeline."""


class NotFoundError(MemstoreClientError, LookupError):
    """The requested job, step or shard does not exist anywhere it was looked for."""


class NoCheckpointError(NotFoundError):
    """Nothing restorable exists for the job (no step has a verified copy for every rank)."""
