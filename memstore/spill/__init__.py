"""The durable tier: committed steps spilled to any fsspec URL (file://, s3://, ...).

``build_spiller`` is what the server's composition root calls; ``memstore.spill.port`` is all the
store and this tier know of each other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memstore.config import StoreConfig
from memstore.core.spill_policy import RetentionPolicy
from memstore.errors import ConfigError, SpillStorageError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from memstore.spill.port import ShardSource, SpillListener, SpillObserver
    from memstore.spill.spiller import Spiller


def build_spiller(
    config: StoreConfig, source: ShardSource, listeners: Sequence[SpillListener] = (), observer: SpillObserver | None = None
) -> Spiller | None:
    """The spiller of a store configured with ``--spill`` (None without), reading from ``source``, telling ``listeners``
    of each published rank and ``observer`` (the store's metrics) of each shard written."""
    from memstore.spill.spiller import Spiller
    from memstore.spill.storage import Durable, parse_options

    if not config.spill:
        return None
    try:
        durable = Durable(config.spill, parse_options(config.spill_options))
        retention = RetentionPolicy(config.spill_keep_last, config.spill_keep_best, config.spill_metric, config.spill_metric_mode == "max")
    except (SpillStorageError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    return Spiller(
        source,
        durable,
        every_steps=config.spill_every_steps,
        every_seconds=config.spill_every_seconds,
        retention=retention,
        codec=config.spill_compression,
        orphan_seconds=config.spill_orphan_seconds,
        max_rate=config.spill_max_rate,
        listeners=listeners,
        observer=observer,
    )
