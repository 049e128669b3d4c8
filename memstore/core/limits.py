"""Limits a store puts on what arrives from the network: bytes per job and per store, transfers per sender.

Pure decisions; the engine (``memstore.server``) holds the counts, takes its lock around them and raises
the typed errors (``memstore.errors.QuotaExceeded``, ``CapacityExceeded``, ``TooManyStreams``).

- **Bytes.** A write that would take ``used`` past ``limit`` (the store's ``--capacity``, or the job's
  ``--job-quota``) may still go ahead when dropping some of the job's own older copies makes room:
  ``room_by_dropping`` picks the fewest of the candidates retention offers under pressure
  (``memstore.core.retention.pressure_victims``: never the newest settled version, never a protected
  step), in their order, or none at all when even all of them would not be enough, so a write that
  cannot fit costs no data.
- **Transfers.** Each inbound transfer (a Put stream, a data-channel receive ticket) counts against its
  sender while it is open: a peer store for copies between stores, the job for a client's save.
"""

from __future__ import annotations

from collections.abc import Iterable

from memstore.core.model import PutOrigin, ShardKey


def over_limit(used: int, needed: int, limit: int) -> bool:
    """Whether ``needed`` more bytes on top of ``used`` exceed ``limit`` (0 = unlimited)."""
    return limit > 0 and used + needed > limit


def room_by_dropping(candidates: Iterable[tuple[ShardKey, int]], used: int, needed: int, limit: int) -> list[ShardKey]:
    """The shortest prefix of ``candidates`` ((key, bytes) in the order to drop them) that makes ``needed`` fit.

    Empty when nothing has to go (it fits already) and when dropping every candidate would still not
    make room: then nothing should be dropped and the write refused.
    """
    if not over_limit(used, needed, limit):
        return []
    chosen: list[ShardKey] = []
    freed = 0
    for key, size in candidates:
        chosen.append(key)
        freed += size
        if not over_limit(used - freed, needed, limit):
            return chosen
    return []


def transfer_sender(origin: PutOrigin, job_id: str, sender_host: str, owner_host: str) -> str:
    """Whom an inbound transfer counts against: ``peer:<host>`` for copies between stores, ``job:<id>`` for a client's save."""
    if origin is PutOrigin.CLIENT:
        return f"job:{job_id}"
    return f"peer:{sender_host or owner_host}"


def admits(active: int, max_streams: int) -> bool:
    """Whether a sender with ``active`` transfers open may open one more (``max_streams`` 0 = unlimited)."""
    return max_streams <= 0 or active < max_streams
