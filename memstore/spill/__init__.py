"""The durable tier: committed steps spilled to any fsspec URL (file://, s3://, ...).

``build_spiller`` is what the server's composition root calls; ``memstore.spill.port`` is all the
store and this tier know of each other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memstore.core.spill_policy import RetentionPolicy
from memstore.errors import ConfigError, SpillStorageError
from memstore.spill.options import SpillOptions

if TYPE_CHECKING:
    from collections.abc import Sequence

    from memstore.spill.port import ShardSource, SpillListener, SpillObserver
    from memstore.spill.spiller import Spiller

__all__ = ["SpillOptions", "build_spiller"]


def build_spiller(
    options: SpillOptions | None, source: ShardSource, listeners: Sequence[SpillListener] = (), observer: SpillObserver | None = None
) -> Spiller | None:
    """The spiller of a store with a durable tier (None without: ``options`` None, see
    ``memstore.config.StoreConfig.spill_settings``), reading from ``source``, telling ``listeners`` of each published
    rank and ``observer`` (the store's metrics) of each shard written."""
    from memstore.spill.spiller import Spiller
    from memstore.spill.storage import Durable, parse_options

    if options is None:
        return None
    try:
        durable = Durable(options.url, parse_options(options.storage_options))
        retention = RetentionPolicy(options.keep_last, options.keep_best, options.metric, options.metric_max)
    except (SpillStorageError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    return Spiller(
        source,
        durable,
        every_steps=options.every_steps,
        every_seconds=options.every_seconds,
        retention=retention,
        codec=options.compression,
        orphan_seconds=options.orphan_seconds,
        max_rate=options.max_rate,
        listeners=listeners,
        observer=observer,
    )
