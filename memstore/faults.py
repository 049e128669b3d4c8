"""Named fault points: kill or stall a store at an exact step of the protocol, for tests.

Inert unless the environment says otherwise, e.g.::

    MEMSTORE_FAULTS="replicate.after_chunk:3=kill,spill.before_manifest=stall:5"

Each entry is ``POINT[:N]=ACTION``: on the N-th time (default: the first; ``*``: every time) the process
reaches ``POINT``, it performs ACTION: ``kill`` (SIGKILL itself, no cleanup, like a power cut), ``stall:S``
(sleep S seconds), ``error`` (raise ``FaultInjected``) or ``exit`` (``os._exit(1)``). The points
are listed in ``POINTS``; an unknown point or action in the variable is a startup error, so a typo
cannot silently disable a test.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from memstore.errors import FaultConfigError, FaultInjected

POINTS = {
    "commit.before_ack": "the store owns the shard's bytes but has not answered Commit",
    "replicate.before_send": "the owner is about to push a shard to a peer",
    "replicate.after_chunk": "the owner has pushed N chunks of a shard to a peer",
    "replicate.after_ack": "a peer acknowledged its copy; the owner has not marked the shard committed",
    "contribute.before_send": "under ec:K+M, a store is about to send one shard's contribution to a row's parity host",
    "receive.after_chunk": "a peer has received N chunks of a shard",
    "receive.before_register": "a peer verified a full copy but has not registered it",
    "serve.after_chunk": "a store has sent N chunks of a shard to a reader or puller",
    "repair.before_pass": "a store is about to look for shards to repair",
    "repair.after_pull": "a store pulled one missing shard during repair",
    "fetch.before_pull": "a store is about to pull a shard a trainer asked to restore",
    "spill.after_chunk": "the spiller wrote N chunks of a shard",
    "spill.before_manifest": "the spiller wrote a shard but not its manifest",
}
ACTIONS = ("kill", "stall", "error", "exit")


def parse(spec: str) -> dict[str, tuple[int, str, float]]:
    out: dict[str, tuple[int, str, float]] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        target, sep, action = item.partition("=")
        point, _, count = target.partition(":")
        if not sep or point not in POINTS:
            raise FaultConfigError(f"MEMSTORE_FAULTS entry {item!r}: unknown point {point!r}; known: {', '.join(sorted(POINTS))}")
        name, _, arg = action.partition(":")
        if name not in ACTIONS:
            raise FaultConfigError(f"MEMSTORE_FAULTS entry {item!r}: unknown action {name!r}; expected one of {', '.join(ACTIONS)}")
        try:
            nth = 0 if count == "*" else int(count) if count else 1
            seconds = float(arg) if arg else 0.0
        except ValueError:
            raise FaultConfigError(f"MEMSTORE_FAULTS entry {item!r}: count and stall seconds must be numbers") from None
        out[point] = (nth, name, seconds)
    return out


_PLAN = parse(os.environ.get("MEMSTORE_FAULTS", ""))
_HITS: dict[str, int] = {}
_LOCK = threading.Lock()


def fault(point: str) -> None:
    """Mark that execution reached ``point``; act if a fault is planned there. Free when none is."""
    if not _PLAN:
        return
    planned = _PLAN.get(point)
    if planned is None:
        return
    nth, action, seconds = planned
    with _LOCK:
        _HITS[point] = _HITS.get(point, 0) + 1
        hit = nth == 0 or _HITS[point] == nth
    if not hit:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "exit":
        os._exit(1)
    elif action == "stall":
        time.sleep(seconds)
    else:
        raise FaultInjected(f"fault injected at {point}")
