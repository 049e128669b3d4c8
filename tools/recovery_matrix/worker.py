"""One trainer rank as a real process: save the deterministic state of every step until killed.

    python -m tools.recovery_matrix.worker --job J --rank R --world W --store ADDR --progress FILE

The matrix forks its workers from a forkserver that imported this module (torch and the client) once
(``memstore.children.start_forked``, by ``Scenario.start``): each is still a process of its own that a fault SIGKILLs, without
importing torch again (~4 s of a core per rank, about a third of a row).

After each step that committed (every copy the store promises), the step is appended to ``FILE``: the runner
reads the newest step committed by every rank from there. A failed save is noted (``error <step> ...``) and the
next step is tried, as a training loop that logs and carries on would. The ranks step in lockstep, as the
collectives of a data-parallel job make them: a rank starts step N once every rank has finished step N-1 (read
from the other ranks' files, ``rank<r>.progress`` next to ``FILE``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from memstore.children import die_with_parent
from tools.recovery_matrix.state import make_state
from trainer_client import CheckpointClient, Connection


def finished(path: Path) -> int:
    """The newest step a rank finished (committed or failed) by its progress file; 0 if none."""
    try:
        words = [line.split()[:2] for line in path.read_text().splitlines()]
    except FileNotFoundError:
        return 0
    return max((int(w[-1]) for w in words if w and w[-1].isdigit()), default=0)


def committed(path: Path) -> int:
    """The newest step a rank committed by its progress file; 0 if none."""
    try:
        return max((int(x) for x in path.read_text().split("\n") if x.isdigit()), default=0)
    except FileNotFoundError:
        return 0


def main(argv: list[str] | None = None) -> None:
    die_with_parent()
    p = argparse.ArgumentParser()
    p.add_argument("--job", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--progress", required=True)
    p.add_argument("--kib", type=int, default=64)
    p.add_argument("--interval", type=float, default=0.1, help="seconds between steps (the training compute)")
    p.add_argument("--remote", action="store_true", help="save over the network (no shared memory with the store)")
    args = p.parse_args(argv)
    connection = Connection(args.store, timeout=10, shared_memory=False if args.remote else None)
    with CheckpointClient(args.job, args.rank, args.world, connection=connection) as client, open(args.progress, "a") as out:
        step = 0
        while True:
            step += 1
            while min(finished(Path(args.progress).with_name(f"rank{r}.progress")) for r in range(args.world)) < step - 1:
                time.sleep(0.01)  # the collective of the step before: every rank is done with it
            try:
                client.save(step, make_state(args.rank, step, args.kib)).wait(timeout=30)
                out.write(f"{step}\n")
            except Exception as exc:
                out.write(f"error {step} {type(exc).__name__}: {str(exc)[:200]!r}\n")
            out.flush()
            time.sleep(args.interval)


if __name__ == "__main__":
    main()
