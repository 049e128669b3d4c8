"""What the durable tier is told to do: ``SpillOptions``, which the store's configuration produces
(``memstore.config.StoreConfig.spill_settings``). The tier knows nothing of the configuration it came from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpillOptions:
    """``--spill`` and its ``--spill-*`` options, checked by the configuration (which holds their defaults)."""

    url: str  # an fsspec URL: file:///data/ckpt, s3://bucket/prefix
    storage_options: str  # fsspec options, key=value pairs (``memstore.spill.storage.parse_options``)
    every_steps: int  # spill every step that is a multiple of N (0: off)
    every_seconds: float  # spill the newest step when this long passed since the last (0: off)
    keep_last: int
    keep_best: int
    metric: str
    metric_max: bool  # the best steps have the largest metric
    compression: str
    max_rate: int  # bytes/s, 0 = unlimited
    orphan_seconds: float
