"""The environment's switches of the save path, read by each ``CheckpointClient`` when it starts: whether a large CPU
state is pushed while it is copied (``MEMSTORE_MARKED_CAPTURES``) and whether the trainer hashes what it copies
(``MEMSTORE_TRAINER_HASHING``). A bad value is refused by name (InvalidArgumentError)."""

from __future__ import annotations

import os

from trainer_client.errors import InvalidArgumentError

MARK_MIN_CPUS = 8  # below this many cores the push takes the copy's cores: the stall doubled on 2 (docs/benchmarks.md)


def marked_captures_wanted() -> bool:
    """Whether large saves are pushed while they are copied: ``MEMSTORE_MARKED_CAPTURES`` on / off / auto (default:
    on with at least MARK_MIN_CPUS cores)."""
    choice = os.environ.get("MEMSTORE_MARKED_CAPTURES", "auto").strip().lower()
    if choice not in ("auto", "on", "off"):
        raise InvalidArgumentError(f"MEMSTORE_MARKED_CAPTURES={choice!r} is invalid: expected on, off or auto")
    return choice == "on" or (choice == "auto" and (os.cpu_count() or 1) >= MARK_MIN_CPUS)


def trainer_hashing_wanted() -> bool:
    """Whether a save copied into shared memory is hashed by the trainer as it copies (``CommitRequest.chunk_checksums``):
    ``MEMSTORE_TRAINER_HASHING`` on / off (default off). On, the store never reads the shard back to hash it, which
    on a machine whose few cores the trainer, the owner and the replica share takes 0.05 s per GiB off save ->
    committed; but the hashing makes the stall itself 0.04 s per GiB longer (a real model's 0.6 GB state: 104 ms
    against 79 ms on the 2-core VM), and the stall is what training waits for."""
    choice = os.environ.get("MEMSTORE_TRAINER_HASHING", "off").strip().lower()
    if choice not in ("on", "off"):
        raise InvalidArgumentError(f"MEMSTORE_TRAINER_HASHING={choice!r} is invalid: expected on or off")
    return choice == "on"


def save_switches() -> dict[str, bool]:
    """Every switch as this environment sets it (what ``memstore bench`` records); InvalidArgumentError for a bad one."""
    return {"trainer_hashing": trainer_hashing_wanted(), "marked_captures": marked_captures_wanted()}
