"""What the durable tier is told to do: ``SpillOptions``, which the store's configuration produces
(``memstore.config.StoreConfig.spill_settings``). The tier knows nothing of the configuration it came from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpillOptions:
    """``--spill`` and its ``--spill-*`` options, checked by the configuration."""

    url: str  # an fsspec URL: file:///data/ckpt, s3://bucket/prefix
    storage_options: str = ""  # fsspec options, key=value pairs (``memstore.spill.storage.parse_options``)
    every_steps: int = 0  # spill every step that is a multiple of N (0: off)
    every_seconds: float = 0.0  # spill the newest step when this long passed since the last (0: off)
    keep_last: int = 2
    keep_best: int = 0
    metric: str = ""
    metric_max: bool = False  # the best steps have the largest metric
    compression: str = "none"
    max_rate: int = 0  # bytes/s, 0 = unlimited
    orphan_seconds: float = 300.0
