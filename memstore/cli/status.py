"""``memstore status``: health of every store of a cluster, asked through any one of them."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from memstore.cli.common import add_store_address_arguments

HELP = "health of every store of a cluster"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_store_address_arguments(p)
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    import grpc

    from memstore.v1 import store_pb2 as pb
    from memstore.v1.channel import store_stub

    channel, stub = store_stub(args.store)
    try:
        hello = stub.Hello(pb.HelloRequest(), timeout=args.timeout)
    except grpc.RpcError as err:
        print(f"store {args.store} unreachable: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    finally:
        channel.close()
    rows = [_host_row(hid, addr, args.timeout) for hid, addr in zip(hello.peer_ids, hello.peer_addresses, strict=True)]
    slots = [
        {"slot": s.index, "host": s.host_id, "address": s.address, "domain": s.domain, "former": list(s.former)} for s in hello.slots.slots
    ]
    if args.json:
        summary = {"replicas": hello.replicas, "placement": hello.placement, "membership_version": hello.slots.version}
        print(json.dumps({**summary, "slots": slots, "hosts": rows}, indent=2))
        return 0
    vacant = [s for s in slots if not s["host"]]
    print(
        f"cluster: {len(rows)} hosts in {len(slots)} slots (membership v{hello.slots.version}), R={hello.replicas}, "
        f"placement={hello.placement}"
    )
    for r in rows:
        _print_host(r)
    for s in vacant:
        print(f"  slot {s['slot']} VACANT (last held by {s['former'][-1] if s['former'] else '-'}): its group is short of a copy")
    _print_orphans(rows)
    return 0 if all(r.get("serving") for r in rows) else 1


def _host_row(hid: str, addr: str, timeout: float) -> dict[str, Any]:
    """One store's health as a JSON-able row; ``error`` (the status code's name) if it does not answer."""
    import grpc

    from memstore.v1 import store_pb2 as pb
    from memstore.v1.channel import store_stub

    channel, stub = store_stub(addr)
    try:
        h = stub.Health(pb.HealthRequest(), timeout=timeout)
    except grpc.RpcError as err:
        return {"host": hid, "address": addr, "serving": False, "error": err.code().name}
    finally:
        channel.close()
    return {
        "host": hid,
        "address": addr,
        "serving": h.serving,
        "used": h.used_bytes,
        "capacity": h.capacity_bytes,
        "shards": h.shards,
        "replicating": h.replications_in_flight,
        "repairing": h.repairs_in_flight,
        "spill": [
            {
                "job": j.job_id,
                "last_spilled_step": j.last_spilled_step,
                "failures": j.consecutive_failures,
                "error": j.last_error,
                "bytes_written": j.bytes_written,
            }
            for j in h.spill
        ],
        "orphans": [{"path": o.path, "host_id": o.host_id, "bytes": o.bytes, "files": o.files} for o in h.orphans],
        "adopted_shards": h.adopted_shards,
        "draining": h.draining,
        "drain_progress": h.drain_progress,
        "not_ready": h.not_ready,
        "discovery": {"source": h.discovery.source, "members": h.discovery.members, "error": h.discovery.error},
    }


def _print_host(r: dict[str, Any]) -> None:
    from memstore.core.sizes import format_size

    if "error" in r:
        print(f"  {r['host']:<8} {r['address']:<22} DOWN ({r['error']})")
        return
    print(
        f"  {r['host']:<8} {r['address']:<22} up   {format_size(r['used']):>12} / {format_size(r['capacity']):<12} "
        f"shards={r['shards']} replicating={r['replicating']} repairing={r['repairing']}"
        + (f" adopted={r['adopted_shards']}" if r["adopted_shards"] else "")
        + (f" DRAINING: {r['drain_progress']}" if r["draining"] else "")
        + (f" NOT READY: {r['not_ready']}" if r["not_ready"] and not r["draining"] else "")
    )
    if r["discovery"]["error"]:
        print(f"           discovery FAILING ({r['discovery']['source']}), keeping the last good membership: {r['discovery']['error']}")
    for j in r["spill"]:
        state = f"FAILING x{j['failures']}: {j['error']}" if j["failures"] else "ok"
        print(f"           spill {j['job']}: last step {j['last_spilled_step']}, {format_size(j['bytes_written'])} written, {state}")


def _print_orphans(rows: list[dict[str, Any]]) -> None:
    """Orphaned segment dirs, once per machine (stores on one machine all report the same ones)."""
    from memstore.core.sizes import format_size

    seen: set[tuple[str, str]] = set()
    lines: list[str] = []
    for r in rows:
        machine = r["address"].rpartition(":")[0]
        for o in r.get("orphans", []):
            if (machine, o["path"]) in seen:
                continue
            seen.add((machine, o["path"]))
            lines.append(
                f"  {o['path']}  (host {o['host_id']}, {o['files']} segments, {format_size(o['bytes'])}) on the machine of {r['host']}; "
                f"reclaim there with: memstore reclaim-shm --shm-dir {os.path.dirname(o['path'])}"
            )
    if lines:
        print("orphaned shared memory (segment dirs no running store owns):")
        print("\n".join(lines))
