"""Trainer-side library of memstore: snapshot training state into the host's store and restore it.

``from trainer_client import CheckpointClient`` is the public entry point. The import is lazy so that
light-weight submodules (``trainer_client.serialization``) load without gRPC.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer_client.client import CheckpointClient, SaveHandle

__all__ = ["CheckpointClient", "SaveHandle"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from trainer_client import client

        return getattr(client, name)
    raise AttributeError(f"module 'trainer_client' has no attribute {name!r}")
