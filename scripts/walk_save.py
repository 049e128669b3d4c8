"""The walk of one save through the code: which files ``CheckpointClient.save`` calls into, in order, and how often it
returns to a file it already left (issue 41: at most 4; the client and the capture code entered once).

One steady-state save (``capture="copied"``, a CPU state, the third save of a client whose ring has reserved its lease
ahead) on the caller's thread, traced with ``sys.setprofile``, once per save path: shared memory and remote (the same
in-process store, ``Connection(shared_memory=False)``). Every call from one file into another of ``trainer_client/`` or
``memstore/v1/`` (generated ``*_pb2`` modules aside) is an *entry*; consecutive entries into one file are one *stay*;
a stay in a file entered before is a *return*. ``trainer_client/serialization/`` and ``memstore/v1/`` count as one box
each (the format, the wire rules). Calls within a file or a box, and threads the save starts, are not followed.

    python scripts/walk_save.py            # both walks and their returns; exit 1 if a walk returns more than --most
    python scripts/walk_save.py --most 4
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BOXES = {"trainer_client/serialization/": "trainer_client/serialization/", "memstore/v1/": "memstore/v1/"}
MOST = 4  # issue 41's bound on the returns of each walk
ONCE = ("trainer_client/client.py", "trainer_client/capture/device_save.py")  # entered once each (issue 41)


def place(filename: str) -> str | None:
    """The file (or box) of the walk ``filename`` belongs to; None for code the walk does not follow."""
    path = os.path.abspath(filename)
    if not path.startswith(f"{ROOT}/"):
        return None
    rel = path[len(str(ROOT)) + 1 :]
    if not rel.startswith(("trainer_client/", "memstore/v1/")) or "_pb2" in rel:
        return None
    return next((box for prefix, box in BOXES.items() if rel.startswith(prefix)), rel)


@dataclass
class Walk:
    """One save's walk: its stays, in order, each a file (or box) and the functions first called there."""

    path: str
    stays: list[tuple[str, list[str]]]

    @property
    def entered(self) -> collections.Counter[str]:
        return collections.Counter(where for where, _ in self.stays)

    @property
    def returns(self) -> int:
        """Stays in a file entered before."""
        return len(self.stays) - len(self.entered)

    def report(self) -> str:
        seen: set[str] = set()
        lines = [f"{self.path}:"]
        for i, (where, names) in enumerate(self.stays, 1):
            mark = "R" if where in seen else " "
            seen.add(where)
            more = " ..." if len(names) > 4 else ""
            lines.append(f"  {i:2d} {mark} {where}: {', '.join(names[:4])}{more}")
        again = ", ".join(f"{where} x{n}" for where, n in self.entered.most_common() if n > 1)
        lines.append(f"  {len(self.stays)} stays in {len(self.entered)} files; returns to a file already left: {self.returns} ({again})")
        return "\n".join(lines)


def trace(call: Any) -> list[tuple[str, list[str]]]:
    """The stays of ``call()`` on this thread."""
    entries: list[tuple[str, str]] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        where = place(frame.f_code.co_filename)
        caller = place(frame.f_back.f_code.co_filename) if frame.f_back is not None else None
        if where is not None and where != caller:
            entries.append((where, frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    stays: list[tuple[str, list[str]]] = []
    for where, name in entries:
        if not stays or stays[-1][0] != where:
            stays.append((where, [name]))
        elif name not in stays[-1][1]:
            stays[-1][1].append(name)
    return stays


def walk(address: str, shared_memory: bool) -> Walk:
    """The walk of a steady-state save into the store at ``address``, by shared memory or not."""
    import torch

    from trainer_client import CheckpointClient, Connection

    state = {"w": torch.randn(1 << 20), "b": torch.randn(1000), "step": 1}
    job = "walk-shm" if shared_memory else "walk-remote"
    with CheckpointClient(job, 0, 1, connection=Connection(address, shared_memory=shared_memory), run_id="r", group=False) as client:
        for step in (1, 2):
            client.save(step, state).wait(30)
        if client._ring is not None:
            client._ring.wait_ahead()  # the steady state: the next save's lease is reserved and mapped
        stays = trace(lambda: client.save(3, state))
    return Walk("shared memory" if shared_memory else "remote", stays)


def walks() -> list[Walk]:
    """Both paths' walks, on one in-process store."""
    from tests.harness.inprocess import InProcessCluster

    cluster = InProcessCluster(hosts=1, replicas=1, capacity="256MiB", workdir=tempfile.mkdtemp(prefix="walk-save-")).start()
    try:
        return [walk(cluster.address("h0"), shared) for shared in (True, False)]
    finally:
        cluster.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--most", type=int, default=MOST, help="returns a walk may make (default %(default)s)")
    args = parser.parse_args(argv)
    failed = False
    for w in walks():
        print(w.report())
        twice = [f for f in ONCE if w.entered[f] > 1]
        if w.returns > args.most or twice:
            failed = True
            print(f"  over the bound: {w.returns} returns (at most {args.most}); entered more than once: {twice or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
