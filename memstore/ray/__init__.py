"""memstore on Ray: a store actor on every node, and Ray Train jobs that checkpoint into it.

    pip install "memstore[ray]"

    import memstore.ray
    memstore.ray.ensure_stores(replicas=2, capacity="8GiB")     # once, from the driver
    connection = memstore.ray.local_store_connection()            # in a task, actor or Ray Train worker

Ray Train: :class:`memstore.ray.train.RayTrainCheckpoints`. Ray is imported only inside this package;
see docs/ray.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memstore.ray.stores import (
        ensure_stores,
        local_store_address,
        local_store_connection,
        stop_stores,
        store_addresses,
        store_credentials,
    )

__all__ = ["ensure_stores", "local_store_address", "local_store_connection", "stop_stores", "store_addresses", "store_credentials"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        try:
            from memstore.ray import stores
        except ImportError as exc:
            if exc.name is not None and exc.name.split(".")[0] == "ray":
                raise ImportError(f"memstore.ray needs Ray: pip install 'memstore[ray]' ({exc})") from exc
            raise
        return getattr(stores, name)
    raise AttributeError(f"module 'memstore.ray' has no attribute {name!r}")
