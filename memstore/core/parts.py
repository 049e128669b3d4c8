"""A shard's blocks in its host's erasure-coded part, row by row (``--redundancy ec:K+M``).

``memstore.core.erasure_layout`` says where each block of a shard goes: block ``b`` of a host's part to the
``b mod K``-th of its data rows, at position ``b // K``. Within one row a shard's blocks are therefore one *run*: the
consecutive positions ``first .. first + count - 1``, whose bytes are every K-th block of the shard from ``start``
(a stride of K blocks). What the engine sends, keeps and reads is a run: a contribution to a row's parity, a parity
fragment's contents, the pieces a rebuild reads from a survivor (``ReadRange`` with that stride).

Pure Python: no gRPC, no torch, no numpy.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from memstore.core.erasure_layout import BLOCK, block_positions, data_rows, padded_size, rows
from memstore.core.model import ErasurePlace


@dataclass(frozen=True)
class Run:
    """One shard's blocks in one row: positions ``first .. first+count-1``; in the shard, ``count`` blocks of ``block``
    bytes from byte ``start``, ``stride`` bytes apart (the last one may end past the shard: zeros)."""

    row: int
    first: int
    count: int
    start: int
    stride: int
    block: int = BLOCK

    @property
    def end(self) -> int:
        """One past the last position."""
        return self.first + self.count

    def overlaps(self, first: int, end: int) -> bool:
        """Whether any of positions ``first .. end-1`` is one of this run's."""
        return self.first < end and first < self.end

    def clipped(self, first: int, end: int) -> Run | None:
        """This run's part within positions ``first .. end-1`` (None: none of them)."""
        lo, hi = max(first, self.first), min(end, self.end)
        if lo >= hi:
            return None
        return Run(self.row, lo, hi - lo, self.start + (lo - self.first) * self.stride, self.stride, self.block)


def data_columns(place: ErasurePlace) -> int:
    """K of the owner's group: its size less the parity columns (a group with remainder hosts has more)."""
    return len(place.group) - place.m


def runs(place: ErasurePlace, nbytes: int, block: int = BLOCK) -> list[Run]:
    """The runs of a shard of ``nbytes`` at ``place``, one per row its blocks fall in, in row order."""
    group_size = len(place.group)
    k = data_columns(place)
    mine = data_rows(place.column, group_size, place.m)
    by_slot: dict[int, tuple[int, int, int]] = {}  # slot -> (first position, count, shard offset of its first block)
    for b in block_positions(place.offset, nbytes, k, block):
        first, count, begin = by_slot.get(b.slot, (b.position, 0, b.start))
        by_slot[b.slot] = (min(first, b.position), count + 1, min(begin, b.start))
    return sorted((Run(mine[slot], first, count, begin, k * block, block) for slot, (first, count, begin) in by_slot.items()),
                  key=lambda r: r.row)  # fmt: skip


def parity_columns(place: ErasurePlace, row: int) -> tuple[int, ...]:
    """The group indexes of the hosts holding ``row``'s parity fragments, in fragment order (fragment j on the j-th)."""
    return tuple(rows(len(place.group), place.m)[row].parity)


def row_data_columns(place: ErasurePlace, row: int) -> tuple[int, ...]:
    """The group indexes of ``row``'s data hosts, in the codec's column order."""
    return tuple(rows(len(place.group), place.m)[row].data)


def next_offset(placed: Iterable[tuple[int, int]], block: int = BLOCK) -> int:
    """Where the next shard of a part goes: after every placed ``(offset, nbytes)``, on a block boundary."""
    return max((offset + padded_size(nbytes, block) for offset, nbytes in placed), default=0)
