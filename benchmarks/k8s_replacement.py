"""Time one store replacement (drain, new pod start, Ready) at two state sizes, the way the rolling test does it.

Three stores run as pods on loopback IPs behind a real DNS server (tools/dns_server.py), with R=2. Three
ranks save two steps. Then node 0's store is drained and replaced by a new pod, with a new IP and a new
host id. For each size, one JSON line gives: the drain time, new pod start to holding the slot, start to
Ready (repair done), and the bytes the new store repaired.

    .venv/bin/python benchmarks/k8s_replacement.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.harness

import torch

from memstore.testing import wait_for
from tests.harness.pods import Pods
from tools.dns_server import DnsServer
from trainer_client import CheckpointClient, Connection

NODES = 3


def holds_slot(pods: Pods, node: int) -> bool:
    h = pods.health(node)
    return h is not None and pods.host_id(node) in [s.host_id for s in h.slots.slots]


def run(mib: int) -> dict[str, float]:
    dns = DnsServer()
    pods = Pods(Path(tempfile.mkdtemp()), dns, NODES, extra=("--capacity", f"{max(64, 8 * mib)}MiB"))
    try:
        pods.start_all(timeout=60)
        for r in range(NODES):
            with CheckpointClient("bench", r, NODES, connection=Connection(pods.node_address(r), timeout=60), run_id="run") as c:
                for step in (1, 2):
                    c.save(step, {"w": torch.full((mib << 18,), float(r + step))}).wait(timeout=120)  # mib MiB of fp32
        t0 = time.monotonic()
        pods.drain(0)
        drained = time.monotonic() - t0
        t1 = time.monotonic()
        pods.start(0)
        wait_for(lambda: holds_slot(pods, 0), timeout=60, what="the new pod to take the slot")
        slot = time.monotonic() - t1
        wait_for(lambda: pods.probe(0) == "SERVING", timeout=300, interval=0.05, what="the new pod ready")
        ready = time.monotonic() - t1
        h = pods.health(0)
        assert h is not None
        return {"mib_per_rank": mib, "drain_s": round(drained, 2), "start_to_slot_s": round(slot, 2),
                "start_to_ready_s": round(ready, 2), "repaired_mib": round(h.used_bytes / 2**20, 1), "shards": h.shards}  # fmt: skip
    finally:
        pods.close()
        dns.stop()


if __name__ == "__main__":
    for size in (1, 256):
        print(json.dumps(run(size)), flush=True)
