"""The run's table in Markdown, and the section of ``docs/benchmarks.md`` it replaces."""

from __future__ import annotations

from pathlib import Path
from typing import Any

BEGIN, END = "<!-- peers-table:begin -->", "<!-- peers-table:end -->"
HEADER = (
    "| system | state | stall: first / steady | survives a host loss: first / steady | restore, local | restore, host lost "
    "| memory: trainer + / servers / shared | version |"
)


def secs(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.1f} ms" if v < 1 else f"{v:.2f} s"


def mib(v: int | None) -> str:
    return "-" if v is None else f"{v / (1 << 20):,.0f} MiB"


def restore_cell(r: dict[str, Any] | None) -> str:
    if not r:
        return "-"
    mark = "" if r.get("verified", "").startswith("bit-exact") else f" ({r.get('verified', 'unverified')})"
    return secs(r.get("seconds")) + mark


def memory_cell(m: dict[str, Any] | None) -> str:
    if not m:
        return "-"
    servers = sum(p["anon"] for p in m.get("servers", {}).values()) if m.get("servers") else None
    shm = m.get("shm_bytes")
    if shm is None:
        shm = m["trainer"]["shmem"]
    return f"{mib(m['trainer']['anon_added'])} / {mib(servers) if servers is not None else 'none'} / {mib(shm)}"


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    lines = [
        f"One run: `{doc['command']}` ({doc['seconds']:.0f} s), torch {m['torch']}, python {m['python']}, {m['cpus']} CPUs, "
        f"load average {m['loadavg_start'][0]:.2f} at the start, {m['loadavg_end'][0]:.2f} at the end.",
        "",
        HEADER,
        "|" + "---|" * 8,
    ]
    legend = (
        "Memory, after the saves: the trainer's added private memory (RssAnon), the private memory of the system's "
        "server or agent processes, and the shared memory the system holds (its shared-memory files or tmpfs; "
        "DCP: the trainer's RssShmem), each counted once."
    )
    notes: list[str] = []
    for r in doc["rows"]:
        state = doc["states"][r["state"]]
        what = f"{r['state']} ({state['tensors']} tensors, {state['bytes'] / (1 << 30):.2f} GiB)"
        if not r["available"]:
            lines.append(f"| {r['system']} | {what} | unavailable: see below | | | | | |")
            notes.append(f"- **{r['system']}** could not run here: {r['reason']}")
            continue
        if r.get("error"):
            notes.append(f"- **{r['system']}**, {r['state']}: failed with `{r['error']}`")
        lines.append(
            f"| {r['system']} | {what} | {secs(r.get('stall_first'))} / {secs(r.get('stall_steady'))} "
            f"| {secs(r.get('durable_first'))} / {secs(r.get('durable_steady'))} | {restore_cell(r.get('restore_local'))} "
            f"| {restore_cell(r.get('restore_after_loss'))} | {memory_cell(r.get('memory'))} | {r['version']} |"
        )
        notes += [f"- **{r['system']}**, {r['state']}: {n}" for n in r.get("notes", [])]
    commands = sorted({f"- `{r['command']}`" for r in doc["rows"]})
    return "\n".join([*lines, "", legend, "", "Each row alone:", "", *commands, *(["", *notes] if notes else [])]) + "\n"


def rewrite_section(page: Path, table: str) -> None:
    """Replace what lies between the markers of ``page`` with ``table`` (ValueError without the markers)."""
    text = page.read_text()
    head, begin, rest = text.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"{page} has no {BEGIN} ... {END} section")
    page.write_text(f"{head}{BEGIN}\n{table}{END}{tail}")
