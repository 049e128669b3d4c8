"""Run the memstore benchmark: ``python benchmarks/bench.py [--size 1GiB] [--json out.json]``.

Same as ``memstore bench`` (and ``python -m memstore.bench``); the code and what is measured are in the package
``memstore/bench/``. Examples::

    python benchmarks/bench.py                                   # headline: 1 GiB on one rank, 2 hosts, R=2
    python benchmarks/bench.py --json docs/bench/run.json        # + raw numbers, and the figures in docs/bench/run.png
    python benchmarks/bench.py --matrix --json docs/bench/m.json # sweep of sizes x hosts x R (~10 min on 2 cores)
    python benchmarks/bench.py --size 64MiB,256MiB --hosts 2,4 --replicas 1,2,3
    python benchmarks/bench.py --endpoints endpoints.json        # an already running cluster ({"hosts": {...}})
    python benchmarks/bench.py --quick                           # smoke test, < 60 s
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memstore.bench import main

if __name__ == "__main__":
    sys.exit(main())
