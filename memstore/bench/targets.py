"""The ratios the bench reports, the targets they are held to, and the one table (ratio, measured, target, PASS/MISS).

:data:`RATIOS` is the one source of truth: the table of targets in ``docs/benchmarks.md`` is :func:`markdown_table`'s
output (``tests/unit/test_bench_targets.py`` checks that they agree). Pure: only reads the run's JSON document (its
``data_parallel`` section through :func:`dp_case`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from memstore.bench.state import p50, ratio

MEASURED = ("first", "early", "steady")


@dataclass(frozen=True)
class Ratio:
    """A ratio of memstore over a baseline measured in the same run; ``op``/``limit`` its target (none: reported only)."""

    name: str
    what: str
    op: str = ""  # "<=" or ">=", "" for no target
    limit: float = math.nan

    def check(self, value: float | None) -> bool | None:
        if value is None or not self.op:
            return None
        return value <= self.limit if self.op == "<=" else value >= self.limit

    @property
    def target(self) -> str:
        return f"{'≤' if self.op == '<=' else '≥'} {self.limit:g}" if self.op else "-"


RATIOS: tuple[Ratio, ...] = (
    Ratio(
        "first_save_stall_over_memcpy", "save 1 of a fresh job on fresh stores, without prepare(): stall over its paired memcpy", "<=", 5.0
    ),
    Ratio(
        "first_save_prepared_stall_over_memcpy",
        "save 1 of a fresh job on fresh stores after prepare() at set-up: stall over its paired memcpy",
        "<=",
        3.0,
    ),
    Ratio("later_saves_stall_over_memcpy_max", "every later save: stall over its paired memcpy (the worst save)", "<=", 1.5),
    Ratio("stall_over_memcpy", "steady saves: stall p50 over the paired memcpy p50", "<=", 1.5),
    Ratio("ram_peak_over_state", "the stores' shared memory at its peak across the saves over the state ((keep+1) x R + 0.5)", "<=", 6.5),
    Ratio("ram_settled_over_state", "the same right after the saves: the next save's memory reserved, the replica's spare pooled"),
    Ratio("ram_idle_over_state", "the same once the job stopped saving and gave its spares back (keep x R + 1.5)", "<=", 5.5),
    Ratio("small_save_stall_ms", "a 1 MiB state: stall p50 in ms (fixed cost per save; assumes an idle machine)", "<=", 1.0),
    Ratio("torch_save_fsync_over_stall", "torch.save + fsync of the same state over the steady stall p50", ">=", 20.0),
    Ratio("stall_over_dcp_blocking", "steady stall p50 over DCP async_save's blocking time (default staging)", "<=", 0.2),
    Ratio("stall_over_dcp_blocking_reused_stager", "the same, DCP with a stager reused across calls"),
    Ratio("replication_over_tcp", "replication throughput p50 (save return -> R copies) over raw TCP on loopback", ">=", 0.7),
    Ratio(
        "committed_over_tcp_min",
        "every save: state bytes / (call -> committed) over raw TCP of the shard right before it (the worst save)",
        ">=",
        0.7,
    ),
    Ratio("committed_over_tcp_first", "save 1 of a fresh job alone: the same"),
    Ratio("committed_over_tcp_first_prepared", "save 1 of a fresh job after prepare() at set-up: the same", ">=", 0.5),
    Ratio("save_cores_busy_min", "every save: the machine's busy CPU seconds over (call -> committed) x its cores (1: CPU-bound)"),
    Ratio("tcp_over_cpu_floor_min", "every save: its paired TCP over its CPU seconds / cores, the committed_over_tcp those allow"),
    Ratio("torch_load_over_restore_local", "torch.load (page cache warm) over a restore from local RAM in a new process", ">=", 10.0),
    Ratio(
        "restore_local_over_hash_floor",
        "restore from local RAM in a new process, from load(): its speed over the store's verification of the same bytes (p50)",
        ">=",
        0.8,
    ),
    Ratio(
        "restore_peer_over_tcp",
        "restore from peer RAM after a host loss, new process, from load(): over raw TCP of the shard right before it (p50)",
        ">=",
        0.7,
    ),
    Ratio("restore_peer_from_accept_over_tcp", "the same from the moment the replacement's port accepts (its start-up included)"),
    Ratio("stream_p1_over_tcp", "one shard pushed store to store on 1 data-channel stream: throughput over raw TCP"),
    Ratio("stream_p2_over_tcp", "the same on 2 parallel streams"),
    Ratio("stream_p4_over_tcp", "the same on 4 parallel streams"),
    Ratio("torch_load_over_restore_peer", "torch.load (page cache warm) over the same restore from peer RAM", ">=", 3.0),
    Ratio("dp2_stall_over_no_dedup", "2 DP ranks save one state at once: stall (slowest rank) with a replica group over without"),
    Ratio("dp4_stall_over_no_dedup", "the same with 4 DP ranks", "<=", 0.35),
    Ratio(
        "dp4_captured_over_no_dedup", "4 DP ranks: bytes each rank captured, with a replica group over without (1/4 + framing)", "<=", 0.3
    ),
    Ratio(
        "dp4_ram_over_no_dedup", "4 DP ranks: the stores' RAM for the step, with a replica group over without (R vs 4R copies)", "<=", 0.3
    ),
    Ratio("dp4_ram_copies", "4 DP ranks with a replica group: the stores' RAM for the step in copies of the state (R expected)"),
    Ratio("dp4_restore_over_no_dedup", "4 DP ranks load() at once: slowest restore with a replica group over without", "<=", 1.5),
    Ratio("dp4_restore_read_over_no_dedup", "the same, each load() followed by a first read of every byte"),
)
BY_NAME = {r.name: r for r in RATIOS}
DP_RATIOS = tuple(r.name for r in RATIOS if r.name.startswith("dp"))  # from the data_parallel section


def _saves(doc: dict[str, Any], phase: str | None = None) -> list[dict[str, Any]]:
    return [s for s in doc["saves"] if phase is None or s["phase"] == phase]


def _over_memcpy(save: dict[str, Any]) -> float | None:
    return ratio(save["stall_seconds"], save["memcpy_seconds"])


def _committed_over_tcp(save: dict[str, Any], tcp_rate: float | None, state_bytes: int) -> float:
    """A save's (call -> committed) throughput over raw TCP: the transfer of the shard paired with it (``tcp_seconds``),
    else the state bytes over the run's baseline (documents from before the pairing); 0 for a save that failed."""
    if save["error"]:
        return 0.0
    paired = save.get("tcp_seconds")
    if paired:
        return paired / save["committed_seconds"]
    return ratio(state_bytes / save["committed_seconds"], tcp_rate) or 0.0


def dp_case(section: dict[str, Any] | None, degree: int, path: str) -> dict[str, Any] | None:
    """The case of ``degree`` ranks on ``path`` in a run's ``data_parallel`` section (None: not measured)."""
    found = [c for c in (section or {}).get("cases", []) if c["degree"] == degree and c["path"] == path]
    return found[0] if found else None


def dp_over_no_dedup(section: dict[str, Any] | None, degree: int, key: str) -> float | None:
    """``key`` of the dedup case over the same of today's path, at ``degree`` ranks."""
    dedup, today = dp_case(section, degree, "dedup"), dp_case(section, degree, "no_dedup")
    return ratio(dedup[key], today[key]) if dedup and today else None


def _least_cores_busy(doc: dict[str, Any]) -> float | None:
    """The least ``cores_busy`` over the saves; None where no save measured its CPU."""
    busy = [c for c in ((s.get("cpu") or {}).get("cores_busy") for s in doc["saves"]) if c is not None]
    return min(busy, default=None)


def _tcp_over_cpu_floor(doc: dict[str, Any], tcp_seconds: float | None) -> float | None:
    """The least over the saves of the TCP of its bytes (paired, else the run's baseline, ``tcp_seconds``) over its CPU baseline:
    the machine's busy seconds / cores, the shortest the save could take on these cores; None where none measured it."""
    cpus = doc.get("machine", {}).get("cpus") or 1
    values = []
    for save in doc["saves"]:
        machine, tcp = (save.get("cpu") or {}).get("machine"), save.get("tcp_seconds") or tcp_seconds
        if machine and tcp:
            values.append(tcp / (machine / cpus))
    return min(values, default=None)


def _restore_over_tcp(peer: dict[str, Any] | None, key: str, shard_bytes: int, tcp_rate: float | None) -> float | None:
    """The restores' (``key``: from ``load()``, or from the port accepting) speed over raw TCP, p50 over the runs: each
    against the TCP transfer paired with it (``tcp_seconds``), else the shard over the run's baseline (documents from
    before the pairing)."""
    if not peer:
        return None
    runs = peer.get("runs") or []
    if runs and all(r.get("tcp_seconds") for r in runs):
        return p50([r["tcp_seconds"] / r[key] for r in runs])
    seconds = peer.get("load_p50", peer["p50"]) if key == "load_seconds" else peer["p50"]
    return ratio(shard_bytes / seconds, tcp_rate)


def _stream_over_tcp(doc: dict[str, Any], streams: int, tcp: float | None) -> float | None:
    case = (doc.get("streams") or {}).get(f"p{streams}")
    return ratio(doc["streams"]["bytes"] / case["p50"], tcp) if case and case["p50"] else None


def _ram_ratios(ram: dict[str, Any] | None) -> dict[str, float | None]:
    """The RAM multiples of the save series (None: a document from before they were measured)."""
    ram = ram or {}
    return {f"ram_{when}_over_state": ram.get(f"ram_multiple_{when}") for when in ("peak", "settled", "idle")}


def compute_ratios(doc: dict[str, Any]) -> tuple[dict[str, float | None], dict[str, str]]:
    """Every ratio of :data:`RATIOS` from a run's document, and why each missing one is n/a."""
    baselines, restores = doc["floors"], doc["restores"]
    shard_bytes, state_bytes = doc["state"]["shard_bytes"], doc["state"]["bytes"]
    tcp = baselines["tcp"]["p50"]
    steady = _saves(doc, "steady")
    stall = p50([s["stall_seconds"] for s in steady])
    committed = [s for s in steady if not s["error"]]
    replication = p50([shard_bytes / (s["committed_seconds"] - s["stall_seconds"]) for s in committed])
    dcp = baselines["dcp"]
    peer = restores.get("peer")
    small = doc.get("small_saves")
    later = [r for r in (_over_memcpy(s) for s in _saves(doc)[1:]) if r is not None]
    dp = doc.get("data_parallel")
    dp4 = dp_case(dp, 4, "dedup")
    prepared = doc.get("prepared")  # None: a document from before the bench measured it
    values: dict[str, float | None] = {
        "first_save_stall_over_memcpy": _over_memcpy(doc["saves"][0]),
        "first_save_prepared_stall_over_memcpy": _over_memcpy(prepared["save"]) if prepared else None,
        "later_saves_stall_over_memcpy_max": max(later, default=None),
        "stall_over_memcpy": ratio(stall, p50([s["memcpy_seconds"] for s in steady])),
        **_ram_ratios(doc.get("ram")),
        "small_save_stall_ms": small["stall_p50"] * 1000 if small and small["stall_p50"] is not None else None,
        "torch_save_fsync_over_stall": ratio(baselines["disk"]["save_fsync_seconds"], stall),
        "stall_over_dcp_blocking": ratio(stall, dcp["default"]["blocking_p50"]),
        "stall_over_dcp_blocking_reused_stager": ratio(stall, dcp["reused_stager"]["blocking_p50"]),
        "replication_over_tcp": ratio(replication, tcp),
        "committed_over_tcp_min": min(_committed_over_tcp(s, tcp, state_bytes) for s in _saves(doc)),
        "committed_over_tcp_first": _committed_over_tcp(doc["saves"][0], tcp, state_bytes),
        "committed_over_tcp_first_prepared": _committed_over_tcp(prepared["save"], tcp, state_bytes) if prepared else None,
        "save_cores_busy_min": _least_cores_busy(doc),
        "tcp_over_cpu_floor_min": _tcp_over_cpu_floor(doc, ratio(state_bytes, tcp)),
        "torch_load_over_restore_local": ratio(baselines["disk"]["load_warm_p50"], restores["local"]["p50"]),
        "restore_local_over_hash_floor": ratio(baselines["hash"]["p50"], restores["local"]["load_p50"]) if "hash" in baselines else None,
        "restore_peer_over_tcp": _restore_over_tcp(peer, "load_seconds", shard_bytes, tcp),
        "restore_peer_from_accept_over_tcp": _restore_over_tcp(peer, "seconds", shard_bytes, tcp),
        "torch_load_over_restore_peer": ratio(baselines["disk"]["load_warm_p50"], peer.get("load_p50", peer["p50"])) if peer else None,
        **{f"stream_p{p}_over_tcp": _stream_over_tcp(doc, p, tcp) for p in (1, 2, 4)},
        "dp2_stall_over_no_dedup": dp_over_no_dedup(dp, 2, "stall_max"),
        "dp4_stall_over_no_dedup": dp_over_no_dedup(dp, 4, "stall_max"),
        "dp4_captured_over_no_dedup": dp_over_no_dedup(dp, 4, "captured_max"),
        "dp4_ram_over_no_dedup": dp_over_no_dedup(dp, 4, "ram_bytes"),
        "dp4_ram_copies": dp4["ram_copies"] if dp4 else None,
        "dp4_restore_over_no_dedup": dp_over_no_dedup(dp, 4, "restore_max"),
        "dp4_restore_read_over_no_dedup": dp_over_no_dedup(dp, 4, "restore_read_max"),
    }
    why = {
        "small_save_stall_ms": "not measured (--small-saves 0)",
        "first_save_prepared_stall_over_memcpy": "",
        "committed_over_tcp_first_prepared": "",
        "ram_idle_over_state": "not measured (--idle-wait 0)" if doc.get("ram") else "",
        "stall_over_dcp_blocking": dcp["default"]["unavailable"] or "",
        "stall_over_dcp_blocking_reused_stager": dcp["reused_stager"]["unavailable"] or "",
        "replication_over_tcp": "R=1 replicates nothing" if doc["config"]["replicas"] < 2 else "",
        "restore_peer_over_tcp": "R=1 keeps no peer copy" if not peer else "",
        "restore_peer_from_accept_over_tcp": "R=1 keeps no peer copy" if not peer else "",
        "torch_load_over_restore_peer": "R=1 keeps no peer copy" if not peer else "",
        **{name: "not measured (--dp-size 0)" for name in DP_RATIOS if not dp},
        **{f"stream_p{p}_over_tcp": "not measured" for p in (1, 2, 4)},
        "restore_local_over_hash_floor": "",  # a document from before the bench measured the verification baseline
        "save_cores_busy_min": "",  # no /proc (not Linux), or a document from before the bench measured CPU
        "tcp_over_cpu_floor_min": "",
    }
    return values, {k: v or "not measured" for k, v in why.items() if values[k] is None}


def evaluate(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per ratio: name, value, target, pass (None: n/a, or no target), note."""
    values, why = compute_ratios(doc)
    return [
        {"ratio": r.name, "value": values[r.name], "target": r.target, "pass": r.check(values[r.name]), "note": why.get(r.name, "")}
        for r in RATIOS
    ]


def verdict(row: dict[str, Any]) -> str:
    if row["pass"] is None:
        return "n/a" if row["target"] != "-" else ""
    return "PASS" if row["pass"] else "MISS"


def text_table(rows: list[dict[str, Any]]) -> str:
    """The table the bench prints: ratio, measured, target, PASS/MISS (and why a ratio is n/a)."""
    width = max(len(r["ratio"]) for r in rows)
    lines = [f"{'ratio':<{width}}  {'measured':>9}  {'target':<7}  result", "-" * (width + 32)]
    for r in rows:
        value = "n/a" if r["value"] is None else f"{r['value']:.3g}"
        note = f"  ({r['note']})" if r["note"] else ""
        lines.append(f"{r['ratio']:<{width}}  {value:>9}  {r['target']:<7}  {verdict(r)}{note}")
    return "\n".join(lines)


def markdown_table() -> str:
    """The targets as ``docs/benchmarks.md`` shows them (generated from :data:`RATIOS`)."""
    lines = ["| ratio | what it compares | target |", "|---|---|---|"]
    lines += [f"| `{r.name}` | {r.what} | {r.target} |" for r in RATIOS]
    return "\n".join(lines)
