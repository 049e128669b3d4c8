"""The fresh process a restore runs in, ``python -m benchmarks.peers.child <system>``: imports torch and the system's
library (``benchmarks.peers.system_<name>.imports()``, as a trainer imports its checkpointer before it restores),
says it is ready, then on one JSON line ``{"system": name, "spec": {...}}`` calls the module's ``restore_here(spec)``,
timed from the call, and reports the seconds, the restored state's fingerprints and its own RSS. stdout carries only
the JSON lines."""

from __future__ import annotations

import importlib
import json
import os
import sys
import time


def main() -> None:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    t0 = time.perf_counter()
    import torch  # noqa: F401  # a trainer has torch loaded before it restores

    module = importlib.import_module(f"benchmarks.peers.system_{sys.argv[1].replace('-', '')}")
    module.imports()

    from benchmarks.peers.common import keys_as_str, process_memory
    from memstore.bench.state import fingerprint

    out.write(json.dumps({"ready": True, "import_seconds": time.perf_counter() - t0}) + "\n")
    cmd = json.loads(sys.stdin.readline())
    t0 = time.perf_counter()
    state, info = module.restore_here(cmd["spec"])
    seconds = time.perf_counter() - t0
    report = {"seconds": seconds, **info, "rss": process_memory(os.getpid())["rss"], "fingerprint": fingerprint(state)}
    report["fingerprint_keys_as_str"] = fingerprint(keys_as_str(state))
    out.write(json.dumps(report) + "\n")


if __name__ == "__main__":
    main()
