"""Run the memstore benchmark: ``python benchmarks/bench.py [--size 1GiB] [--json out.json]``.

Same as ``memstore bench`` (and ``python -m memstore.bench``); the code and what is measured are in the package
``memstore/bench/``, the targets in ``docs/benchmarks.md``. Examples::

    python benchmarks/bench.py                                   # headline: 1 GiB on one rank, 2 hosts, R=2
    python benchmarks/bench.py --json run.json                   # + every raw number (python benchmarks/plot_bench.py run.json)
    python benchmarks/bench.py --size 256MiB --hosts 3 --replicas 3
    python benchmarks/bench.py --quick                           # smoke test, about 20 s
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memstore.bench import main

if __name__ == "__main__":
    sys.exit(main())
