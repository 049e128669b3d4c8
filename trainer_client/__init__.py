"""Trainer-side library of memstore: snapshot training state into the host's store and restore it.

Every public name is importable from here, e.g.
``from trainer_client import CheckpointClient, Connection, MemStoreWriter, MemStoreReader``. The imports are
lazy, so light-weight submodules (``trainer_client.serialization``) load without gRPC, and the DCP classes
load ``torch.distributed.checkpoint`` only when used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memstore.v1.security import Credentials
    from trainer_client.client import CheckpointClient
    from trainer_client.connection import Connection
    from trainer_client.dcp import MemStoreReader, MemStoreWriter
    from trainer_client.errors import (
        AccessDeniedError,
        AlreadySavedError,
        AuthenticationError,
        CapacityExceededError,
        CaptureError,
        CheckpointExistsError,
        CorruptShardError,
        InvalidArgumentError,
        MemstoreClientError,
        NoCheckpointError,
        NotFoundError,
        ReplicaMismatchError,
        ReplicationError,
        SerializationError,
        StoreUnavailableError,
    )
    from trainer_client.handles import ClientStats, RestorePoint, SaveHandle, SaveResult
    from trainer_client.training_state import ResumableDataLoader, TrainingState

__all__ = [
    "AccessDeniedError",
    "AlreadySavedError",
    "AuthenticationError",
    "CapacityExceededError",
    "CaptureError",
    "CheckpointClient",
    "CheckpointExistsError",
    "ClientStats",
    "Connection",
    "CorruptShardError",
    "Credentials",
    "InvalidArgumentError",
    "MemStoreReader",
    "MemStoreWriter",
    "MemstoreClientError",
    "NoCheckpointError",
    "NotFoundError",
    "ReplicaMismatchError",
    "ReplicationError",
    "RestorePoint",
    "ResumableDataLoader",
    "SaveHandle",
    "SaveResult",
    "SerializationError",
    "StoreUnavailableError",
    "TrainingState",
]

#: the module that defines each name of ``__all__`` (imported on first use); the rest are ``trainer_client.errors``
_HOMES = {
    "CheckpointClient": "trainer_client.client",
    "Connection": "trainer_client.connection",
    "Credentials": "memstore.v1.security",
    "SaveHandle": "trainer_client.handles",
    "SaveResult": "trainer_client.handles",
    "RestorePoint": "trainer_client.handles",
    "ClientStats": "trainer_client.handles",
    "MemStoreWriter": "trainer_client.dcp",
    "MemStoreReader": "trainer_client.dcp",
    "TrainingState": "trainer_client.training_state",
    "ResumableDataLoader": "trainer_client.training_state",
}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'trainer_client' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES.get(name, "trainer_client.errors")), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
