"""Which shards without a copy can be rebuilt from parity (``--redundancy ec:K+M``), from what the stores list.

Under ec:K+M a shard lives whole on its owner only; its group's parity hosts list, per row the shard's blocks fall in,
a ``ParityCover`` (``Holding.parity``): the shard is in that row's fragment, ``spans`` names every row its blocks fall
in, and ``needs`` the other data shards whose blocks share its positions in this row. A shard nobody holds a verified
copy of is rebuildable when, in every row it spans, the parity fragments listed outnumber the data shards missing
there (the shard itself and any of its ``needs`` without a verified copy): the codec solves for as many missing
columns as there are parities (M=1: XOR of the others). That is the rule ``rebuilt`` applies;
``memstore.core.restorable`` and ``memstore.core.agreement`` count a rebuildable shard as a copy (on the pseudo-host
``REBUILD``), so a step stays restorable while its group lost at most M hosts, and is unrestorable from RAM beyond
that (not a wrong step, not a hang).

Pure Python: no gRPC, no torch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

from memstore.core.model import Holding, ShardKey

REBUILD = "rebuild"  # the pseudo-host a rebuildable shard's synthetic holding names


def can_rebuild_from(covers: Sequence[Holding], held: set[ShardKey]) -> bool:
    """Whether the parity ``covers`` listed for one shard (each with ``Holding.parity``) rebuild it, given the shards
    ``held`` (a verified copy somewhere): in every row it spans, more fragments listed than data shards missing."""
    by_row: dict[int, set[str]] = defaultdict(set)
    missing: dict[int, set[ShardKey]] = defaultdict(set)
    spans: set[int] = set()
    for h in covers:
        assert h.parity is not None
        by_row[h.parity.row].add(h.host)
        missing[h.parity.row].update(k for k in h.parity.needs if k not in held)
        spans.update(h.parity.spans)
    return bool(spans) and all(len(by_row[row]) >= 1 + len(missing[row]) for row in spans)


def with_rebuilt(holdings: Iterable[Holding], job_id: str) -> list[Holding]:
    """``holdings`` of ``job_id`` plus a verified holding on ``REBUILD`` for every shard with no verified copy among them
    that the parity covers listed can rebuild (the module's rule). Covers themselves stay (they are never verified)."""
    mine = [h for h in holdings if h.key.job_id == job_id]
    held = {h.key for h in mine if h.verified and h.parity is None}
    covers: dict[ShardKey, list[Holding]] = defaultdict(list)
    for h in mine:
        if h.parity is not None and h.key not in held:
            covers[h.key].append(h)
    rebuilt = [
        Holding(REBUILD, key, listed[0].world_size, True, listed[0].created_unix)
        for key, listed in sorted(covers.items())
        if can_rebuild_from(listed, held)
    ]
    return mine + rebuilt
