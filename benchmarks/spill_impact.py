"""Does the durable tier slow training down? ``python benchmarks/spill_impact.py [--mib 256] [--saves 8] [--json PATH]``.

Same as ``python -m memstore.bench.spill_impact``; the code is in ``memstore/bench/spill_impact.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memstore.bench.spill_impact import main

if __name__ == "__main__":
    sys.exit(main())
