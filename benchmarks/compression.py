"""Spill codecs on real-looking training state: ``python benchmarks/compression.py [--mib 64] [--json PATH]``.

Same as ``python -m memstore.bench.compression``; the code is in ``memstore/bench/compression.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memstore.bench.compression import main

if __name__ == "__main__":
    sys.exit(main())
