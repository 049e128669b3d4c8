"""``memstore status``: the cluster at a glance, asked through any one store.

Hosts (slot, readiness, memory used against the budget, shards in flight), jobs (the shared memory each holds, its
state, and their ratio: RAM per byte of state; the bytes of its copies, its state counted once per replica group and
how many copies of it RAM holds; the newest committed, restorable and spilled step), and what needs attention
(vacant slots, failing spills or discovery, capture rings grown past their bound, orphaned shared memory). ``--json``
prints the same facts. Exit code 0 when every host answers and is ready, else 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from memstore.cli.common import add_store_address_arguments

HELP = "the cluster at a glance: hosts, memory, jobs and their newest steps, problems"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_store_address_arguments(p)
    p.add_argument("--json", action="store_true", help="print the same facts as JSON")


def run(args: argparse.Namespace) -> int:
    import grpc

    from memstore import survey
    from memstore.cli import render

    try:
        s = survey.take(args.store, args.timeout)
    except grpc.RpcError as err:
        print(render.rpc_problem("status", args.store, err), file=sys.stderr)
        return 1
    hosts = [{**h, "serving": "error" not in h and not h["draining"]} for h in s.health.values()]
    jobs = survey.jobs_of(s)
    healthy = all("error" not in h and h["ready"] for h in hosts)
    if args.json:
        render.print_json({"redundancy": s.redundancy, "replicas": s.replicas, "placement": s.placement,
                           "membership_version": s.version, "slots": s.slots, "hosts": hosts, "jobs": jobs})  # fmt: skip
        return 0 if healthy else 1
    out = render.console()
    out.print(f"cluster: {len(hosts)} hosts in {len(s.slots)} slots (membership v{s.version}), redundancy={s.redundancy}, "
              f"placement={s.placement}", markup=False)  # fmt: skip
    out.print(render.table("hosts", ["slot", "host", "address", "state", "memory", "shards", "replicating", "repairing"],
                           [_host_cells(h) for h in hosts]))  # fmt: skip
    if jobs:
        columns = ["job", "RAM held", "state", "RAM / state", "copies", "cached ahead", "logical (once)", "copies of state",
                   "replica groups", "steps in RAM", "newest committed", "newest restorable", "newest spilled", "parity"]  # fmt: skip
        rows = [[j["job"], render.size(j["ram_bytes"]), render.size(j["state_bytes"]), _times(j["ram_multiple"]),
                 render.size(j["copies_bytes"]), render.size(j["cached_bytes"]) if j["cached_bytes"] else "-",
                 render.size(j["logical_bytes"]), _times(j["copies_of_state"]),
                 j["replica_groups"] or "-", j["steps_in_ram"], render.step(j["newest_committed"]),
                 render.step(j["newest_restorable"]), render.step(j["newest_spilled"]), _parity(j["parity_complete"])]
                for j in jobs]  # fmt: skip
        out.print(render.table("jobs", columns, rows))
    for line in _problems(s, hosts):
        out.print(line, soft_wrap=True)
    return 0 if healthy else 1


def _parity(complete: bool | None) -> object:
    """Under ec:K+M whether every step in RAM has its parity ("-" under replicas)."""
    from memstore.cli import render

    return "-" if complete is None else "complete" if complete else render.warn("incomplete")


def _times(copies: float | None) -> str:
    return "-" if copies is None else f"{copies:.2f}x"


def _host_cells(h: dict[str, Any]) -> list[Any]:
    from memstore.cli import render

    slot = "-" if h.get("slot") is None else h["slot"]
    if "error" in h:
        return [slot, h["host"], h["address"], render.bad(f"DOWN ({h['error']})"), "-", "-", "-", "-"]
    if h["draining"]:
        state = render.warn(f"DRAINING: {h['drain_progress'] or 'started'}")
    elif h["not_ready"]:
        state = render.warn(f"NOT READY: {h['not_ready']}")
    else:
        state = render.ok("ready")
    pct = 100 * h["used"] / h["capacity"] if h["capacity"] else 0
    memory = f"{render.size(h['used'])} / {render.size(h['capacity'])} ({pct:.0f}%)"
    memory = render.bad(memory) if pct >= 90 else memory
    adopted = f" (adopted {h['adopted_shards']})" if h["adopted_shards"] else ""
    return [slot, h["host"], h["address"], state, memory, f"{h['shards']}{adopted}", h["replicating"], h["repairing"]]


def _host_problems(h: dict[str, Any]) -> list[Any]:
    """What needs attention on one host that answered."""
    from memstore.cli import render

    lines = []
    if h["discovery"]["error"]:
        lines.append(render.bad(f"{h['host']}: discovery FAILING ({h['discovery']['source']}), keeping the last good "
                                f"membership: {h['discovery']['error']}"))  # fmt: skip
    if h.get("ring_overflows"):
        lines.append(render.warn(
            f"{h['host']}: {h['ring_overflows']} saves grew a full capture ring past its bound of {h['ring_limit']} + 1 "
            "segments (saves outran replication and retention, and no older step could be reused): RAM above the floor"
        ))  # fmt: skip
    if h.get("scrub_corrupt"):
        lines.append(render.bad(
            f"{h['host']}: the background scrub found {h['scrub_corrupt']} corrupt copies in RAM (each dropped, and pulled "
            "again from a copy that verifies by repair): check this host's memory"
        ))  # fmt: skip
    capture = h.get("capture", {})
    if capture.get("fallbacks"):
        lines.append(render.bad(
            f"{h['host']}: {capture['fallbacks']} captures copied through PAGEABLE memory (cudaHostRegister failed: "
            f"{capture['fallback_cause'] or 'unknown cause'}): saves there are synchronous and slow"
        ))  # fmt: skip
    for j in h["spill"]:
        if j["failures"]:
            lines.append(render.bad(f"{h['host']}: spill of {j['job']} FAILING x{j['failures']}: {j['error']}"))
    return lines


def _problems(s: Any, hosts: list[dict[str, Any]]) -> list[Any]:
    from memstore.cli import render

    lines = []
    for x in s.slots:
        if not x["host"]:
            last = x["former"][-1] if x["former"] else "-"
            lines.append(render.warn(f"slot {x['slot']} VACANT (last held by {last}): its group is short of a copy"))
    for h in hosts:
        if "error" not in h:
            lines += _host_problems(h)
    seen: set[tuple[str, str]] = set()
    for h in hosts:
        machine = h["address"].rpartition(":")[0]
        for o in h.get("orphans", []):
            if (machine, o["path"]) in seen:
                continue
            seen.add((machine, o["path"]))
            lines.append(render.warn(
                f"orphaned shared memory: {o['path']} (host {o['host_id']}, {o['files']} segments, {render.size(o['bytes'])}) on "
                f"the machine of {h['host']}; its stores adopt it (a predecessor's) or reclaim it after --shm-reclaim-after, "
                f"or at once with: memstore reclaim-shm --shm-dir {os.path.dirname(o['path'])}"
            ))  # fmt: skip
    return lines
