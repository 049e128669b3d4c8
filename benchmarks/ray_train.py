"""Checkpoint cost of a Ray Train job, memstore vs Ray Train's own: ``python benchmarks/ray_train.py [--mib 64] [--json PATH]``.

Same as ``python -m memstore.ray.train_bench`` (needs ``memstore[ray]``); the code is in ``memstore/ray/train_bench.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memstore.ray.train_bench import main

if __name__ == "__main__":
    sys.exit(main())
