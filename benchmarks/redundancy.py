"""replicas:2 against ec:4+1 side by side (issue 42): the same job on 5 stores, one rank per store.

    python benchmarks/redundancy.py [--size 256MiB] [--saves 3] [--restores 1] [--idle-wait 45] [--keep 2] [--json PATH]

For each scheme, on 5 freshly started local stores (``memstore.bench.rig.start_cluster``, ``--keep``, ``--redundancy`` the
scheme), 5 rank processes (``memstore.bench.ranks``), rank r on store hr, each with its own state of ``--size`` bytes
(the bench's layout, seeded per rank), save 1 + keep + 1 + ``--saves`` steps together; each round:

1. raw loopback TCP of one rank's bytes (``baselines.PairedTcp``), on a machine otherwise idle;
2. every rank copies its state into a pre-faulted buffer of its own (its memcpy), then every rank ``save()``s at once:
   stall (call -> return) over its own memcpy, and call -> committed; the round's slowest committed over the TCP;
3. retention settles (the oldest of keep steps dropped everywhere).

Meanwhile the stores' shared memory is sampled as the bench counts it (``RamSampler``: the sum of Health's
``used_bytes``, every segment a store holds: shards, parity, leases, pooled spares and the reserve). Reported per store
over one rank's state: at the peak, right after the saves (``settled``: the ranks still connected, their next saves'
memory reserved ahead under replicas; under ec:4+1 a save takes its rank's oldest kept step's memory when it comes,
docs/erasure.md "RAM"), and once the job went idle (spares given back, ``--idle-wait``); ``settled_max_store``: the
store holding the most then. The issue's bound for ec:4+1 is 1.25 x keep + 0.75 per store (2.0 at ``--keep 1``).

Then the ranks exit and the restores run, each in a new process as rank 0 of the job (``memstore.bench.measure``): local
(a trainer restarted after a crash, from h0's RAM) and after a host loss (SIGKILL h0, start its replacement with empty
RAM, rank 0 loads from it: a peer's copy under replicas, a rebuild from the four survivors under ec), the latter paired
with raw TCP of the same bytes. Every restore is checked against rank 0's state. The machine's load average is
recorded before and after each scheme.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from memstore.bench.baselines import PairedTcp
from memstore.bench.measure import phase_of, restore_after_host_loss, restore_local
from memstore.bench.ranks import JOB, Rank, everyone
from memstore.bench.rig import RamSampler, health, idle_ram, ram_fields, running, start_cluster, wait_idle, wait_settled
from memstore.bench.state import MiB, fingerprint, make_state, p50, ratio
from memstore.core.sizes import parse_size

SCHEMES = ("replicas:2", "ec:4+1")
HOSTS = 5
KEEP = 2  # the default of --keep
RUN_ID = "redundancy-bench"


def measure_scheme(scheme: str, size: int, saves: int, restores: int, idle_wait: float, seed: int, keep: int = KEEP) -> dict[str, Any]:
    """One scheme's document: the rounds, the RAM, the restores."""
    os.environ["MEMSTORE_RUN_ID"] = RUN_ID  # the ranks and the restore processes share no process group: one run id
    ranks = [Rank(r) for r in range(HOSTS)]
    load_before = os.getloadavg()
    try:
        # room per store for its rank's cycle and a peer's (replicas) with the reserve beside them: the same for both
        cluster = start_cluster(HOSTS, 2, keep, 2 * size, None, {}, redundancy=scheme)
        with running(cluster):
            wait_idle(cluster)
            for r in ranks:
                r.start(cluster.address(f"h{r.rank}"), HOSTS, size, seed + r.rank)
            state_bytes = [int(r.answer()["state_bytes"]) for r in ranks]
            ram = RamSampler(cluster)
            try:
                with PairedTcp(state_bytes[0]) as tcp:
                    rounds = save_rounds(cluster, ranks, tcp, 1 + keep + 1 + saves, ram, keep)
                settled = ram.used()
                per_store = [stored(cluster, h) for h in cluster.stores]
                idle = idle_ram(ram, idle_wait) if idle_wait > 0 else None
            finally:
                ram.close()
            everyone(ranks, {"op": "close"})
            for r in ranks:
                r.child.close()
            expected = fingerprint(make_state(size, seed))  # rank 0's state
            timeout = 120.0 + state_bytes[0] / (20 * MiB)
            local = restore_local(cluster, JOB, expected, restores, timeout, world_size=HOSTS)
            with PairedTcp(state_bytes[0]) as tcp:
                peer = restore_after_host_loss(cluster, JOB, expected, restores, keep, timeout, tcp, world_size=HOSTS)
    finally:
        for r in ranks:
            if r.child.proc.returncode is None:  # not closed above: the run failed
                r.child.close()
    doc = summary(scheme, rounds, state_bytes, local, peer, keep)
    doc.update(ram_fields(ram.peak, settled, idle, sum(state_bytes)))
    doc["settled_per_store"] = [None if b is None else b / s for b, s in zip(per_store, state_bytes, strict=True)]
    doc["settled_max_store"] = max((x for x in doc["settled_per_store"] if x is not None), default=None)
    doc["load_average"] = {"before": load_before, "after": os.getloadavg()}
    return doc


def stored(cluster: Any, host: str) -> int | None:
    """The shared memory ``host``'s store holds now, as the bench counts it (Health's ``used_bytes``)."""
    h = health(cluster.address(host))
    return None if h is None else int(h.used_bytes)


def save_rounds(cluster: Any, ranks: list[Rank], tcp: PairedTcp, count: int, ram: RamSampler, keep: int = KEEP) -> list[dict[str, Any]]:
    """``count`` rounds: raw TCP of one rank's bytes, then every rank's memcpy, then every rank's save at once."""
    rounds = []
    for i in range(count):
        tcp_seconds = tcp.seconds()
        with ram.sampling():
            memcpy = everyone(ranks, {"op": "memcpy"})
            saved = everyone(ranks, {"op": "save", "step": i + 1})
        rounds.append({
            "step": i + 1, "phase": phase_of(i, keep), "tcp_seconds": tcp_seconds,
            "ranks": [{"rank": r.rank, "memcpy_seconds": m["memcpy_seconds"], **s,
                       "stall_over_memcpy": ratio(s["stall_seconds"], m["memcpy_seconds"])}
                      for r, m, s in zip(ranks, memcpy, saved, strict=True)],
        })  # fmt: skip
        wait_settled(cluster, JOB, keep)
    return rounds


def summary(
    scheme: str, rounds: list[dict[str, Any]], state_bytes: list[int], local: dict[str, Any], peer: dict[str, Any], keep: int = KEEP
) -> dict[str, Any]:
    """The figures the table shows, over the steady rounds (after save 1 and the early saves), and every raw number."""
    steady = [r for r in rounds if r["phase"] == "steady"]
    stalls = [x["stall_over_memcpy"] for r in steady for x in r["ranks"] if x["stall_over_memcpy"] is not None]
    committed = [max(x["committed_seconds"] for x in r["ranks"]) for r in steady]  # the round's slowest rank
    everything = [x for r in rounds for x in r["ranks"]]
    peer_tcp = [float(x["tcp_seconds"]) for x in peer["runs"] if x.get("tcp_seconds")]
    return {
        "scheme": scheme, "hosts": HOSTS, "keep": keep, "rank_state_bytes": state_bytes,
        "stall_over_memcpy_p50": p50(stalls), "stall_over_memcpy_max": max(stalls, default=None),
        "committed_p50": p50(committed), "tcp_p50": p50([r["tcp_seconds"] for r in steady]),
        "committed_over_tcp_p50": p50([max(x["committed_seconds"] for x in r["ranks"]) / r["tcp_seconds"] for r in steady]),
        "copies_min": min(x["copies"] for x in everything), "errors": [x["error"] for x in everything if x["error"]],
        "restore_local": local, "restore_after_host_loss": peer,
        "host_loss_over_tcp": ratio(peer["p50"], statistics.median(peer_tcp) if peer_tcp else None),
        "rounds": rounds,
    }  # fmt: skip


def table(docs: list[dict[str, Any]]) -> str:
    """One line per scheme: RAM per store over the state, save and restore figures."""

    def x(v: float | None, unit: str = "x") -> str:
        return "n/a" if v is None else f"{v:.2f}{unit}"

    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v * 1000:.0f} ms"

    head = ("scheme", "RAM peak", "settled", "settled max", "idle", "stall/memcpy p50 (max)", "committed p50", "/TCP",
            "host loss restore", "/TCP", "local restore", "exact")  # fmt: skip
    rows = [head]
    for d in docs:
        peer, local = d["restore_after_host_loss"], d["restore_local"]
        exact = peer["verified_equal"] and local["verified_equal"]
        rows.append((
            d["scheme"], x(d["ram_multiple_peak"]), x(d["ram_multiple_settled"]), x(d["settled_max_store"]), x(d["ram_multiple_idle"]),
            f"{x(d['stall_over_memcpy_p50'])} ({x(d['stall_over_memcpy_max'])})", ms(d["committed_p50"]), x(d["committed_over_tcp_p50"]),
            ms(peer["p50"]), x(d["host_loss_over_tcp"]), ms(local["p50"]), "yes" if exact else "NO",
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    size = docs[0]["rank_state_bytes"][0] / MiB
    title = f"{HOSTS} stores, one rank each, {size:.0f} MiB per rank, keep {docs[0]['keep']}; RAM per store over one rank's state"
    return "\n".join([title, lines[0], "-" * len(lines[0]), *lines[1:]])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="256MiB", help="state bytes of each rank (default 256MiB)")
    p.add_argument("--saves", type=int, default=3, help="steady saves after save 1 and the early saves (default 3)")
    p.add_argument("--restores", type=int, default=1, help="repetitions of each restore (default 1)")
    p.add_argument("--idle-wait", type=float, default=45.0, help="seconds to wait for the job's spares to go back (default 45; 0: skip)")
    p.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma-separated (default {','.join(SCHEMES)})")
    p.add_argument("--keep", type=int, default=KEEP, help=f"the stores' --keep (default {KEEP})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="also write every raw number here")
    args = p.parse_args()
    try:
        size = parse_size(args.size)
    except ValueError as exc:
        p.error(f"--size {args.size!r} is invalid: {exc}")
    if size < MiB:
        p.error(f"--size must be at least 1MiB, got {args.size}")
    for name in ("saves", "restores", "keep"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.idle_wait < 0:
        p.error(f"--idle-wait must be at least 0, got {args.idle_wait}")
    schemes = [s for s in args.schemes.split(",") if s]
    unknown = [s for s in schemes if s not in SCHEMES]
    if unknown or not schemes:
        p.error(f"--schemes must name some of {', '.join(SCHEMES)}, got {args.schemes!r}")
    started = time.time()
    docs = [measure_scheme(s, size, args.saves, args.restores, args.idle_wait, args.seed, args.keep) for s in schemes]
    print(table(docs))
    for d in docs:
        print(f"{d['scheme']}: load average {d['load_average']['before'][0]:.2f} before, {d['load_average']['after'][0]:.2f} after; "
              f"min copies {d['copies_min']}, errors {len(d['errors'])}")  # fmt: skip
    if args.json:
        result = {"size": size, "saves": args.saves, "restores": args.restores, "idle_wait": args.idle_wait, "keep": args.keep,
                  "cpus": os.cpu_count(), "started_unix": started, "schemes": docs}  # fmt: skip
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if any(d["errors"] or not (d["restore_after_host_loss"]["verified_equal"] and d["restore_local"]["verified_equal"]) for d in docs):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
