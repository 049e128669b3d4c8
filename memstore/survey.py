"""What the read commands show (``status``, ``ls``, ``inspect``): one survey of a cluster, asked through any store.

Not a command. A :class:`Survey` holds, for every member the entry store knows: its health, its slot and
what it lists, plus the cluster layout. The per-job and per-step views are plain functions over a survey
that return JSON-able rows. The commands print them as tables, or as JSON with ``--json``, so both
outputs always carry the same facts.
"""

from __future__ import annotations

import hashlib
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

COMMITTED_STATES = ("committed", "under_replicated", "replica")  # a settled copy a restore may use


@dataclass
class Survey:
    """One look at the cluster through ``store``."""

    store: str
    replicas: int = 0
    placement: str = ""
    version: int = 0
    redundancy: str = ""  # "replicas:R" | "ec:K+M"
    slots: list[dict[str, Any]] = field(default_factory=list)
    health: dict[str, dict[str, Any]] = field(default_factory=dict)  # host -> health row (or {"error": CODE})
    shards: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # host -> its verified, settled copies
    restorable: dict[str, dict[str, Any]] = field(default_factory=dict)  # job -> the LatestStep answer

    @property
    def hosts(self) -> list[str]:
        return list(self.health)

    def jobs(self) -> list[str]:
        names = {s["job"] for rows in self.shards.values() for s in rows}
        names |= {j["job"] for h in self.health.values() for j in h.get("spill", [])}
        return sorted(names)


def hello(store: str, timeout: float) -> Any:
    """The entry store's Hello: the cluster layout and every member (``peer_ids``/``peer_addresses``).
    Raises grpc.RpcError when it does not answer."""
    from memstore.v1 import store_pb2 as pb
    from memstore.v1.channel import store_stub

    channel, stub = store_stub(store)
    try:
        return stub.Hello(pb.HelloRequest(), timeout=timeout)
    finally:
        channel.close()


def take(store: str, timeout: float, job: str = "") -> Survey:
    """Ask ``store`` for the members, then every member (in parallel) for its health and its shards of ``job``
    ("" = every job), and the entry store for each job's newest restorable step. Raises grpc.RpcError when
    the entry store does not answer; members that do not answer get ``{"error": CODE}``."""
    hello_ = hello(store, timeout)
    redundancy = hello_.redundancy or f"replicas:{hello_.replicas}"  # an older store does not say: it replicates
    s = Survey(store, hello_.replicas, hello_.placement, hello_.slots.version, redundancy)
    s.slots = [{"slot": x.index, "host": x.host_id, "address": x.address, "domain": x.domain, "former": list(x.former)}
               for x in hello_.slots.slots]  # fmt: skip
    members = dict(zip(hello_.peer_ids, hello_.peer_addresses, strict=True))
    slot_of = {x["host"]: x["slot"] for x in s.slots if x["host"]}
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(members)))) as pool:
        rows = list(pool.map(lambda item: _ask(item[0], item[1], timeout, job), members.items()))
    for host, (health, shards) in zip(members, rows, strict=True):
        s.health[host] = {**health, "slot": slot_of.get(host)}
        if shards is not None:
            s.shards[host] = shards
    for name in [job] if job else s.jobs():
        s.restorable[name] = _latest(store, name, timeout)
    return s


def _ask(host: str, address: str, timeout: float, job: str) -> tuple[dict[str, Any], list[dict[str, Any]] | None]:
    """One member's health row and its shards of ``job`` (None when it did not answer)."""
    import grpc

    from memstore.v1 import store_pb2 as pb
    from memstore.v1.channel import store_stub

    channel, stub = store_stub(address)
    try:
        h = stub.Health(pb.HealthRequest(), timeout=timeout)
        listing = stub.List(pb.ListRequest(job_id=job), timeout=timeout)
    except grpc.RpcError as err:
        return {"host": host, "address": address, "error": err.code().name}, None
    finally:
        channel.close()
    health = {
        "host": host,
        "address": address,
        "ready": not h.not_ready,
        "not_ready": h.not_ready,
        "draining": h.draining,
        "drain_progress": h.drain_progress,
        "used": h.used_bytes,
        "pooled": h.pooled_bytes,  # part of used: free segments kept faulted in
        "reserve": h.reserve_bytes,  # part of pooled: the --prefault reserve
        "jobs_memory": {j.job_id: {"in_use": j.in_use_bytes, "pooled": j.pooled_bytes} for j in h.jobs_memory},
        "ring_limit": h.ring_limit,  # segments a rank's capture ring holds once warm (--keep + 1; --keep under ec:K+M)
        "ring_overflows": h.ring_overflows,  # saves that grew a full capture ring past its bound
        "capacity": h.capacity_bytes,
        "shards": h.shards,
        "replicating": h.replications_in_flight,
        "repairing": h.repairs_in_flight,
        "uptime_seconds": round(h.uptime_seconds, 1),
        "spill_url": h.spill_url,
        "spill": [_spill_row(j) for j in h.spill],
        "orphans": [{"path": o.path, "host_id": o.host_id, "bytes": o.bytes, "files": o.files} for o in h.orphans],
        "adopted_shards": h.adopted_shards,
        "capture": {
            "registrations": h.capture.registrations,
            "fallbacks": h.capture.fallbacks,
            "fallback_cause": h.capture.fallback_cause,
        },
        "saves_superseded": h.saves_superseded,
        "scrubbed_bytes": h.scrubbed_bytes,  # re-verified by the background scrub since the store started
        "scrub_corrupt": h.scrub_corrupt,  # copies it found corrupt (dropped; repair pulls them again)
        "discovery": {"source": h.discovery.source, "members": h.discovery.members, "error": h.discovery.error},
    }
    return health, [shard_row(x) for x in listing.shards]


def _spill_row(j: Any) -> dict[str, Any]:
    return {
        "job": j.job_id,
        "last_spilled_step": j.last_spilled_step,
        "last_spill_unix": j.last_spill_unix,
        "failures": j.consecutive_failures,
        "error": j.last_error,
        "bytes_written": j.bytes_written,
    }


def shard_row(info: Any) -> dict[str, Any]:
    from memstore.v1 import store_pb2 as pb

    m = info.manifest
    return {
        "job": m.key.job_id,
        "step": m.key.step,
        "rank": m.key.rank,
        "timeline": m.key.timeline,
        "world_size": m.world_size,
        "bytes": m.nbytes,
        "state": pb.ShardState.Name(info.state).removeprefix("SHARD_STATE_").lower(),
        "verified": info.verified,
        "owner": m.owner_host,
        "copies": info.copies,
        "error": info.error,
        "checksum": f"{m.checksum_algo}:{digest(list(m.chunk_checksums))}" if m.chunk_checksums else "",
        "chunks": len(m.chunk_checksums),
        "created_unix": m.created_unix,
        "stripe": _stripe_row(m.stripe) if m.HasField("stripe") else None,
        "cached": info.cached,
        # ec:K+M: a parity host's record of this shard (state "parity", no copy): the row its fragment covers, and every
        # row the shard's blocks fall in
        "parity": {"row": info.parity.row, "spans": list(info.parity.spans)} if info.HasField("parity") else None,
    }


def _stripe_row(s: Any) -> dict[str, Any]:
    """A stripe shard's descriptor (``Manifest.stripe``): its replica group's ranks in stripe order, its index there,
    the group's logical size and the bytes this stripe holds of it."""
    return {"group": list(s.group), "index": s.index, "logical_bytes": s.logical_nbytes, "stripe_bytes": s.stripe_nbytes}


def logical_bytes(shards: list[dict[str, Any]]) -> tuple[int, list[list[int]]]:
    """The logical size of one version's ``shards`` (one row per rank) and its replica groups (in first-rank order).

    Each replica group's state counts once (its ``logical_bytes``), plus what each stripe shard holds besides its
    stripe (the rank's own part and framing), plus every ordinary shard whole.
    """
    groups: dict[tuple[int, ...], int] = {}
    total = 0
    for r in shards:
        s = r.get("stripe")
        if s is None:
            total += r["bytes"]
            continue
        group = tuple(s["group"])
        groups[group] = max(groups.get(group, 0), s["logical_bytes"])
        total += max(0, r["bytes"] - s["stripe_bytes"])
    return total + sum(groups.values()), [list(g) for g in sorted(groups)]


def digest(chunk_checksums: list[int]) -> str:
    """One short fingerprint of a shard's chunk checksums: two copies with the same bytes show the same one."""
    return hashlib.sha256(struct.pack(f"<{len(chunk_checksums)}Q", *chunk_checksums)).hexdigest()[:16]


def _latest(store: str, job: str, timeout: float) -> dict[str, Any]:
    import grpc

    from memstore.v1 import store_pb2 as pb
    from memstore.v1.channel import store_stub

    channel, stub = store_stub(store)
    try:
        r = stub.LatestStep(pb.LatestStepRequest(job_id=job), timeout=timeout)
    except grpc.RpcError as err:
        return {"step": None, "error": err.code().name}
    finally:
        channel.close()
    return {"step": r.step if r.found else None, "timeline": r.timeline, "unreachable": list(r.unreachable_hosts), "note": r.note}


# -- views ----------------------------------------------------------------------------------------------
def steps_of(s: Survey, job: str) -> list[dict[str, Any]]:
    """One row per (step, timeline) of ``job``, newest first: ranks held, fewest copies of any rank, bytes (one
    copy of each rank), logical bytes (each replica group's state once: ``logical_bytes``) and the replica groups,
    where it lives (ram and/or durable, as far as the stores report), and whether it is the restorable one."""
    by_version: dict[tuple[int, str], dict[int, list[dict[str, Any]]]] = {}
    for host, rows in s.shards.items():
        for r in rows:
            if r["job"] == job and r["verified"] and r["state"] in COMMITTED_STATES and not r.get("cached"):
                by_version.setdefault((r["step"], r["timeline"]), {}).setdefault(r["rank"], []).append({**r, "host": host})
    spilled = max((j["last_spilled_step"] for h in s.health.values() for j in h.get("spill", []) if j["job"] == job), default=-1)
    restorable = s.restorable.get(job, {})
    out: list[dict[str, Any]] = []
    for (step, timeline), ranks in sorted(by_version.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        world = max(c["world_size"] for copies in ranks.values() for c in copies)
        copies = [len(ranks.get(r, [])) for r in range(world)]
        logical, groups = logical_bytes([cs[0] for cs in ranks.values()])
        out.append({
            "step": step,
            "timeline": timeline,
            "ranks": f"{len(ranks)}/{world}",
            "complete": len(ranks) == world,
            "min_copies": min(copies),
            "bytes": sum(c["bytes"] for cs in ranks.values() for c in cs[:1]),
            "logical_bytes": logical,
            "replica_groups": groups,
            "tiers": ["ram"] + (["durable"] if step == spilled else []),
            "restorable": restorable.get("step") == step and restorable.get("timeline", timeline) == timeline,
            "redundancy": s.redundancy,
            "parity_complete": _parity_complete(s, job, step, timeline, ranks),
        })  # fmt: skip
    if spilled >= 0 and not any(r["step"] == spilled for r in out):
        out.append({"step": spilled, "timeline": "", "ranks": "?", "complete": True, "min_copies": 0, "bytes": 0,
                    "logical_bytes": 0, "replica_groups": [], "tiers": ["durable"],
                    "restorable": restorable.get("step") == spilled, "redundancy": s.redundancy, "parity_complete": None})  # fmt: skip
        out.sort(key=lambda r: -r["step"])
    return out


def _parity_complete(s: Survey, job: str, step: int, timeline: str, ranks: dict[int, list[dict[str, Any]]]) -> bool | None:
    """Under ec:K+M, whether every rank of the version held has its parity in every row its blocks fall in, from each of
    the row's M parity hosts (the parity hosts' PARITY rows); None under replicas."""
    if not s.redundancy.startswith("ec:"):
        return None
    m = int(s.redundancy.rpartition("+")[2])
    covers: dict[int, set[tuple[int, str]]] = {}
    spans: dict[int, set[int]] = {}
    for host, rows in s.shards.items():
        for r in rows:
            if r["job"] == job and r["step"] == step and r["timeline"] == timeline and r["parity"] is not None:
                covers.setdefault(r["rank"], set()).add((r["parity"]["row"], host))
                spans[r["rank"]] = set(r["parity"]["spans"])
    return all(len(covers.get(rank, ())) >= m * len(spans.get(rank, ())) > 0 for rank in ranks)


def jobs_of(s: Survey) -> list[dict[str, Any]]:
    """One row per job: the shared memory it holds, the newest step every rank committed, the newest restorable
    step (the stores' own answer, durable tier included) and the newest spilled step.

    RAM: ``ram_bytes`` is every byte of the job's segments on every store (``HealthResponse.jobs_memory``): its
    copies, the leases of saves being written or reserved ahead, and pooled spares; ``state_bytes`` is its newest
    step in RAM counted once (each replica group's state once); ``ram_multiple`` is their ratio, what a host's RAM
    pays per byte of state (at most about ``(keep + 1) x R`` while saving, ``keep x R + 1`` settled).

    And how many times the job's state is held: ``copies_bytes`` are the bytes of its copies alone; ``logical_bytes``
    sums, over the steps in RAM, each version's state counted once per replica group (``steps_of``); ``cached_bytes``
    are copies a store pulled ahead of a restore (other members' stripes, in spare room: not among the R);
    ``copies_of_state`` is ``(copies_bytes - cached_bytes) / logical_bytes`` (about R for an ordinary job, and for a
    deduplicated one; None while nothing is settled); ``replica_groups`` counts the groups of the newest step in RAM
    (0: no stripes there). ``redundancy`` is the cluster's scheme; under ec:K+M ``parity_complete`` says whether every
    step in RAM has its parity from every parity host (None under replicas), and parity is no copy: ``copies_of_state``
    is about 1 while the parity's bytes count in ``ram_bytes`` (about 1 + M/K of the state per kept step)."""
    out = []
    for job in s.jobs():
        steps = steps_of(s, job)
        ram = [r for r in steps if "ram" in r["tiers"]]
        copies_bytes = sum(r["bytes"] for rows in s.shards.values() for r in rows if r["job"] == job and r.get("parity") is None)
        cached = sum(r["bytes"] for rows in s.shards.values() for r in rows if r["job"] == job and r.get("cached"))
        spilled = [j["last_spilled_step"] for h in s.health.values() for j in h.get("spill", []) if j["job"] == job]
        logical = sum(r["logical_bytes"] for r in ram)
        held = sum(m["in_use"] + m["pooled"] for h in s.health.values() for j, m in h.get("jobs_memory", {}).items() if j == job)
        state = ram[0]["logical_bytes"] if ram else 0
        out.append({
            "job": job,
            "ram_bytes": held,
            "state_bytes": state,
            "ram_multiple": round(held / state, 2) if state else None,
            "copies_bytes": copies_bytes,
            "cached_bytes": cached,
            "logical_bytes": logical,
            "copies_of_state": round((copies_bytes - cached) / logical, 2) if logical else None,
            "replica_groups": len(ram[0]["replica_groups"]) if ram else 0,
            "steps_in_ram": len(ram),
            "newest_committed": max((r["step"] for r in ram if r["complete"]), default=None),
            "newest_restorable": s.restorable.get(job, {}).get("step"),
            "newest_spilled": max((x for x in spilled if x >= 0), default=None),
            "redundancy": s.redundancy,
            "parity_complete": None if not s.redundancy.startswith("ec:") else all(r["parity_complete"] for r in ram),
        })  # fmt: skip
    return out


def shards_of(s: Survey, job: str, step: int) -> list[dict[str, Any]]:
    """One row per (rank, timeline) of ``job``'s ``step``: size, checksum fingerprint, owner, its stripe (None: an
    ordinary shard), and every copy."""
    ranks: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for host, rows in s.shards.items():
        for r in rows:
            if r["job"] == job and r["step"] == step:
                ranks.setdefault((r["rank"], r["timeline"]), []).append({**r, "host": host})
    out = []
    for (rank, timeline), copies in sorted(ranks.items()):
        first = copies[0]
        out.append({
            "rank": rank,
            "timeline": timeline,
            "world_size": first["world_size"],
            "bytes": first["bytes"],
            "checksum": first["checksum"],
            "chunks": first["chunks"],
            "owner": first["owner"],
            "stripe": first["stripe"],
            "copies": [{"host": c["host"], "state": c["state"], "verified": c["verified"], "checksum": c["checksum"],
                        "error": c["error"], "cached": c.get("cached", False)} for c in copies],
            "consistent": len({c["checksum"] for c in copies}) == 1,
        })  # fmt: skip
    return out
