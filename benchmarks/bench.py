"""Run the memstore benchmark: ``python benchmarks/bench.py [--size 1GiB] [--json out.json]``.

Same as ``memstore bench``; see memstore/bench.py for what is measured.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memstore.bench import main

if __name__ == "__main__":
    sys.exit(main())
