"""How the read commands print: rich tables on a terminal (plain text when piped), or JSON with ``--json``.

Not a command. One place decides colours and sizes, so ``status``, ``ls`` and ``inspect`` look alike.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any


def console() -> Any:
    """Colours on a terminal; piped, plain text 200 columns wide (lines are not cut for grep)."""
    from rich.console import Console

    terminal = sys.stdout.isatty()
    return Console(highlight=False, width=None if terminal else 200, no_color=not terminal)


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Any:
    """A table; cells are shown as they are (no markup: paths and [::1] addresses stay intact), styled ones
    come from :func:`ok`, :func:`bad` and :func:`warn`."""
    from rich.table import Table
    from rich.text import Text

    t = Table(title=title, title_justify="left", show_edge=False, pad_edge=False, header_style="bold")
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*[x if isinstance(x, Text) else Text(str(x)) for x in r])
    return t


def size(nbytes: int | None) -> str:
    from memstore.core.sizes import format_size

    return "-" if nbytes is None else format_size(int(nbytes))


def step(value: int | None) -> str:
    return "-" if value is None else str(value)


def ranks(group: Sequence[int]) -> str:
    """Ranks in their order, runs of 3 or more consecutive ones shortened: ``[0, 1, 2, 3, 8, 6]`` -> ``0-3,8,6``."""
    parts: list[str] = []
    i = 0
    while i < len(group):
        j = i
        while j + 1 < len(group) and group[j + 1] == group[j] + 1:
            j += 1
        parts += [f"{group[i]}-{group[j]}"] if j - i >= 2 else [str(r) for r in group[i : j + 1]]
        i = j + 1
    return ",".join(parts)


def stripe(s: dict[str, Any] | None) -> str:
    """A stripe shard's descriptor as ``survey.shard_row`` gives it, like a rank (``index/len(group)``, 0-based):
    ``1/4 of ranks 0-3: 1.00 MiB of 4.00 MiB``; ``-`` for an ordinary shard."""
    if s is None:
        return "-"
    return f"{s['index']}/{len(s['group'])} of ranks {ranks(s['group'])}: {size(s['stripe_bytes'])} of {size(s['logical_bytes'])}"


def groups(gs: Sequence[Sequence[int]]) -> str:
    """A version's replica groups: ``-`` (none: no stripe shards), ``ranks 0-3``, ``ranks 0,2; ranks 1,3``, ``8 groups``."""
    if not gs:
        return "-"
    return "; ".join(f"ranks {ranks(g)}" for g in gs) if len(gs) <= 2 else f"{len(gs)} groups"


def ok(text: str) -> Any:
    from rich.text import Text

    return Text(text, style="green")


def bad(text: str) -> Any:
    from rich.text import Text

    return Text(text, style="bold red")


def warn(text: str) -> Any:
    from rich.text import Text

    return Text(text, style="yellow")


HINTS = {
    "UNAVAILABLE": "is a store running there? Point --store (or MEMSTORE_STORE) at any store of the cluster",
    "DEADLINE_EXCEEDED": "the store did not answer in time: raise --timeout, or check the network",
    "UNAUTHENTICATED": "pass a token: --auth-token-file (or MEMSTORE_AUTH_TOKEN_FILE)",
    "PERMISSION_DENIED": "this token may not do that: use the job's token, the cluster token or the admin token",
}


def rpc_problem(command: str, store: str, err: Any) -> str:
    """``memstore COMMAND: store ADDR unreachable|refused: CODE: details; what to do`` for a failed first call."""
    code = err.code().name
    verb = "unreachable" if code in ("UNAVAILABLE", "DEADLINE_EXCEEDED") else "refused"
    hint = HINTS.get(code)
    return f"memstore {command}: store {store} {verb}: {code}: {err.details()}" + (f"; {hint}" if hint else "")


def print_json(doc: Any) -> None:
    json.dump(doc, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


@contextmanager
def progress(description: str, total: int) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr while a long operation runs; yields ``advance(n)``. Shown on a terminal (or with
    ``MEMSTORE_PROGRESS=1``), never in pipes and logs, and gone once the operation ends."""
    if not (sys.stderr.isatty() or os.environ.get("MEMSTORE_PROGRESS") == "1"):
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True, force_terminal=True), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)
