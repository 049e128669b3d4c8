"""Where erasure-coded redundancy puts each byte: the rows of a group, and the blocks of a host's part.

With ``--redundancy ec:K+M`` the hosts form groups of ``G >= K + M`` stores (placement's job). Every host keeps
its own shards whole; the group adds parity. This module says, as pure functions of ``(G, M)``, which host's
bytes each parity covers and which hosts hold it, so that every store computes the same answer on its own.

**Rows.** A group of ``G`` hosts (indexes ``0 .. G-1`` in slot order) has ``G`` rows. Row ``r``'s ``M`` parity
fragments live on hosts ``r, r+1, .., r+M-1 (mod G)`` (parity ``j`` on host ``r+j``); its data comes from the
other ``G - M`` hosts, in ascending order: data *column* ``c`` of the row is its ``c``-th data host, the column
the codec (:class:`memstore.erasure.codec.Codec` with ``k = G - M``) multiplies. Every host is a member of every
row: a data host of ``G - M`` rows and a parity host of ``M`` rows, so no host holds more parity than its share.

**Parts and blocks.** For one (job, step, timeline) a host's owned shards form its *part*: shards one after another
at offsets the host assigns as they complete, each starting on a :data:`BLOCK` boundary (the last block of a
shard is padded with zeros). Block ``b`` of the part goes to the ``(b mod K)``-th of the host's data rows
(ascending), at *position* ``b // K`` of that row; a row's parity fragment at position ``t`` is the code over its
data hosts' blocks at position ``t`` (a missing block counts as zeros). A parity fragment is so about ``1/K`` of
the largest part in the group.

Worked example, ``G = 5, M = 1`` (``ec:4+1``)::

    row  parity host  data hosts (columns 0..3)
    0    0            1 2 3 4
    1    1            0 2 3 4
    2    2            0 1 3 4
    3    3            0 1 2 4
    4    4            0 1 2 3

Host 0 is the parity host of row 0 and a data host of rows 1..4 (column 0 in each). Its part's blocks
0, 1, 2, 3 go to rows 1, 2, 3, 4 at position 0, blocks 4..7 to the same rows at position 1, and so on. Host 2's
block 0 goes to row 0 (column 1 there), block 1 to row 1 (column 1), block 2 to row 3 (column 2).

**Loss.** Every row has every host of the group as a member, so a set of lost hosts costs each row that many
columns: the group can rebuild iff at most ``M`` of its hosts are lost (:func:`can_rebuild`), and
:func:`rebuild_sources` says which survivors each row is read from.

Pure Python standard library only: no numpy, ``torch`` or ``grpc`` imports.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from memstore.errors import UnrecoverableLoss

#: Bytes per block: the unit a part is cut into and a parity fragment is built of (1 MiB).
BLOCK = 1 << 20

#: The most columns (``K + M``, so the most hosts of a group) one code spans: the codec's limit, and the one
#: ``Redundancy`` and placement check against.
MAX_COLUMNS = 64


@dataclass(frozen=True)
class Row:
    """One row of a group: ``data`` hosts (ascending; column ``c`` is ``data[c]``) and ``parity`` hosts
    (parity fragment ``j`` on ``parity[j]``). Together they are every host of the group."""

    index: int
    data: tuple[int, ...]
    parity: tuple[int, ...]

    def column(self, host: int) -> int:
        """The codec column of ``host`` in this row: ``0 .. K-1`` for a data host, ``K + j`` for parity ``j``."""
        if host in self.data:
            return self.data.index(host)
        if host in self.parity:
            return len(self.data) + self.parity.index(host)
        raise ValueError(f"host {host} is not in row {self.index} (data {self.data}, parity {self.parity})")


@dataclass(frozen=True)
class BlockPlace:
    """Where one block of a shard goes: the host's ``slot``-th data row (an index into :func:`data_rows`), at
    ``position`` in that row, holding the shard's bytes ``[start, stop)`` (a short last block is zero-padded)."""

    slot: int
    position: int
    start: int
    stop: int


@dataclass(frozen=True)
class RowRebuild:
    """What rebuilding one row after a loss reads: the row's ``lost_data`` and ``lost_parity`` hosts, and the
    surviving hosts read (``read``: every surviving data host, then as many surviving parity hosts as there are
    lost data hosts, so exactly ``K`` columns; empty when the row lost no data host, as its parity is then
    re-contributed by its data hosts)."""

    row: int
    lost_data: tuple[int, ...]
    lost_parity: tuple[int, ...]
    read: tuple[int, ...]


def _check_shape(group_size: int, m: int) -> None:
    if m < 1:
        raise ValueError(f"an erasure code needs at least one parity fragment per row (m >= 1), got m={m}")
    if group_size < m + 1:
        raise ValueError(f"a group of {group_size} hosts cannot hold {m} parity fragments per row and any data: it needs at least {m + 1}")


def _check_host(host: int, group_size: int) -> None:
    if not 0 <= host < group_size:
        raise ValueError(f"host index {host} is outside the group of {group_size} hosts (0..{group_size - 1})")


def rows(group_size: int, m: int) -> tuple[Row, ...]:
    """The ``group_size`` rows of a group with ``m`` parity fragments per row, row ``r`` at index ``r``."""
    _check_shape(group_size, m)
    out = []
    for r in range(group_size):
        parity = tuple((r + j) % group_size for j in range(m))
        data = tuple(h for h in range(group_size) if h not in parity)
        out.append(Row(index=r, data=data, parity=parity))
    return tuple(out)


def data_rows(host_index: int, group_size: int, m: int) -> tuple[int, ...]:
    """The rows (ascending) whose data includes host ``host_index``'s blocks: ``group_size - m`` of them."""
    _check_shape(group_size, m)
    _check_host(host_index, group_size)
    return tuple(r for r in range(group_size) if (host_index - r) % group_size >= m)


def parity_rows(host_index: int, group_size: int, m: int) -> tuple[int, ...]:
    """The rows (ascending) whose parity host ``host_index`` keeps: ``m`` of them."""
    _check_shape(group_size, m)
    _check_host(host_index, group_size)
    return tuple(r for r in range(group_size) if (host_index - r) % group_size < m)


def padded_size(nbytes: int, block: int = BLOCK) -> int:
    """The bytes a shard of ``nbytes`` takes in its part: whole blocks, so the next shard starts on a boundary."""
    if nbytes < 0 or block < 1:
        raise ValueError(f"a shard's size must be >= 0 and the block >= 1 byte, got nbytes={nbytes}, block={block}")
    return -(-nbytes // block) * block


def block_positions(offset: int, nbytes: int, k: int, block: int = BLOCK) -> tuple[BlockPlace, ...]:
    """Where each block of a shard of ``nbytes`` at part ``offset`` (a multiple of ``block``) goes, with ``k``
    data rows per host: block ``b`` of the part to slot ``b mod k`` at position ``b // k``. The byte ranges cover
    ``[0, nbytes)`` exactly once, in order; a shard of no bytes has no blocks."""
    if k < 1:
        raise ValueError(f"a host has at least one data row (k >= 1), got k={k}")
    padded_size(nbytes, block)  # checks nbytes and block
    if offset < 0 or offset % block:
        raise ValueError(f"a shard's part offset must be a non-negative multiple of the block ({block} bytes), got {offset}")
    first = offset // block
    return tuple(
        BlockPlace(slot=(first + i) % k, position=(first + i) // k, start=start, stop=min(start + block, nbytes))
        for i, start in enumerate(range(0, nbytes, block))
    )


def _lost_set(lost: Iterable[int], group_size: int) -> frozenset[int]:
    out = frozenset(lost)
    for host in out:
        _check_host(host, group_size)
    return out


def can_rebuild(lost: Iterable[int], group_size: int, m: int) -> bool:
    """Whether a group that lost the hosts ``lost`` can rebuild every row: at most ``m`` lost, as every host is a
    member of every row."""
    _check_shape(group_size, m)
    return len(_lost_set(lost, group_size)) <= m


def rebuild_sources(lost: Iterable[int], group_size: int, m: int) -> tuple[RowRebuild, ...]:
    """For each row with a lost member, the hosts read to rebuild it (:class:`RowRebuild`), ordered by row.

    The surviving parity hosts read are rotated by the row's index, so when ``m > 1`` the reads spread over them.
    More than ``m`` lost raises :class:`~memstore.errors.UnrecoverableLoss`.
    """
    gone = _lost_set(lost, group_size)
    _check_shape(group_size, m)
    if len(gone) > m:
        raise UnrecoverableLoss(
            f"lost {len(gone)} hosts {sorted(gone)} of a group of {group_size}: its parity survives at most {m}",
            missing=len(gone),
            tolerated=m,
        )
    out = []
    for row in rows(group_size, m):
        lost_data = tuple(h for h in row.data if h in gone)
        lost_parity = tuple(h for h in row.parity if h in gone)
        if not lost_data and not lost_parity:
            continue
        spare = [h for h in row.parity if h not in gone]
        turn = row.index % len(spare) if spare else 0
        spare = spare[turn:] + spare[:turn]
        read = (*(h for h in row.data if h not in gone), *spare[: len(lost_data)]) if lost_data else ()
        out.append(RowRebuild(row=row.index, lost_data=lost_data, lost_parity=lost_parity, read=read))
    return tuple(out)
