"""The erasure code over equal-length blocks of bytes: :class:`Codec` ``(k, m)``, ``k`` data and ``m`` parity columns.

A row of a group (:mod:`memstore.core.erasure_layout`) holds, at each position, one block per data column and one
per parity column; this is the arithmetic on them. Parity is linear, so a parity block can be built in any order
as the sum of each data column's :meth:`Codec.contribution` (:meth:`Codec.accumulate` adds one in place), or at
once with :meth:`Codec.encode`; :meth:`Codec.decode` gives back missing data blocks from any ``k`` columns.

- ``m = 1`` is XOR parity, in numpy (``bitwise_xor`` with ``out=``, in slices that stay in cache): about the
  speed of copying the same bytes, with nothing to install.
- ``m >= 2`` is Reed-Solomon over GF(2^8) from a maintained library (:mod:`memstore.erasure.reed_solomon`: pyeclib
  with its bundled ISA-L, the ``erasure`` extra), loaded when such a codec is made; without it
  :class:`~memstore.errors.ErasureUnavailable` names the extra.

Blocks are anything with the buffer protocol (``bytes``, ``memoryview``, a contiguous numpy array); results are
1-D ``uint8`` numpy arrays, read-only where they are views into the library's output (copy one to change it).
Addition in GF(2^8) is XOR for every ``m``, so :meth:`Codec.accumulate` is XOR. A codec keeps no state between
calls beyond its tables; it may be used from several threads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from memstore.core.erasure_layout import MAX_COLUMNS
from memstore.errors import UnrecoverableLoss

if TYPE_CHECKING:
    from memstore.erasure.reed_solomon import ReedSolomon

#: XOR runs over this many bytes of every operand before moving on, so the running parity stays in cache.
XOR_SLICE = 256 << 10


def as_block(block: Any) -> np.ndarray:
    """``block`` as a 1-D ``uint8`` array over the same memory (no copy; read-only if the buffer is)."""
    if isinstance(block, np.ndarray):
        if not block.flags.c_contiguous:
            raise ValueError("a block must be contiguous memory")
        return block.reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(block).cast("B"), dtype=np.uint8)


def xor_into(out: np.ndarray, operands: Sequence[np.ndarray], *, add: bool = True) -> None:
    """``out ^= operand`` for each operand (``add=False``: ``out`` = the operands' XOR, its old bytes ignored), slice
    by slice so the slice of ``out`` stays in cache; ``out`` and every operand of one length."""
    for start in range(0, len(out), XOR_SLICE):
        part = out[start : start + XOR_SLICE]
        rest = iter(operands)
        if not add:
            np.copyto(part, next(rest)[start : start + XOR_SLICE])
        for operand in rest:
            np.bitwise_xor(part, operand[start : start + XOR_SLICE], out=part)


class Codec:
    """``k`` data columns and ``m`` parity columns, numbered ``0 .. k-1`` and ``k .. k+m-1``."""

    def __init__(self, k: int, m: int) -> None:
        if k < 1 or m < 1 or k + m > MAX_COLUMNS:
            raise ValueError(f"an erasure code needs k >= 1, m >= 1 and k + m <= {MAX_COLUMNS}, got k={k}, m={m}")
        self.k = k
        self.m = m
        self._rs: ReedSolomon | None = None
        if m >= 2:
            from memstore.erasure.reed_solomon import ReedSolomon

            self._rs = ReedSolomon(k, m)

    def __repr__(self) -> str:
        return f"Codec(k={self.k}, m={self.m})"

    def contribution(self, index: int, block: Any) -> list[np.ndarray]:
        """What data column ``index``'s ``block`` adds to each of the ``m`` parity blocks at its position: the block
        itself for XOR (``m = 1``), its coefficient times the block otherwise. The arrays may be read-only views.

        ``block`` may be several positions' blocks one after another: the code works byte by byte.
        """
        if not 0 <= index < self.k:
            raise ValueError(f"data column {index} is outside 0..{self.k - 1} of {self!r}")
        data = as_block(block)
        if self._rs is None:
            return [data]
        return self._rs.contribution(index, data)

    def accumulate(self, parity: np.ndarray, contribution: Any) -> None:
        """Add one contribution into a parity block, in place (``parity`` a writable ``uint8`` array)."""
        add = as_block(contribution)
        if len(add) != len(parity):
            raise ValueError(f"a contribution of {len(add)} bytes cannot be added to a parity block of {len(parity)}")
        xor_into(parity, [add])

    def encode(self, blocks: Sequence[Any], out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """The ``m`` parity blocks of ``k`` data blocks of one length: new arrays (read-only for ``m >= 2``), or
        written into ``out`` (``m`` writable arrays of the blocks' length, such as parity fragments in place) and
        returned. With ``out``, XOR allocates nothing."""
        data = self._blocks(blocks, self.k, "data blocks")
        if out is not None:
            self._blocks(out, self.m, "parity blocks to write")
            if len(out[0]) != len(data[0]):
                raise ValueError(f"parity blocks of {len(out[0])} bytes cannot hold the parity of blocks of {len(data[0])}")
        if self._rs is not None:
            parity = self._rs.encode(data)
            if out is None:
                return parity
            for target, block in zip(out, parity, strict=True):
                np.copyto(target, block)
            return list(out)
        target = np.empty(len(data[0]), np.uint8) if out is None else out[0]
        xor_into(target, data, add=False)
        return [target]

    def decode(self, present: Mapping[int, Any], block_len: int) -> dict[int, np.ndarray]:
        """The missing data blocks (column -> new array of ``block_len`` bytes; read-only for ``m >= 2``) from the
        ``present`` columns, data and parity, each of ``block_len`` bytes. Any ``k`` present columns do; with every data column present the
        answer is empty. Fewer than ``k`` raises :class:`~memstore.errors.UnrecoverableLoss`."""
        blocks: dict[int, np.ndarray] = {}
        for column, block in present.items():
            if not 0 <= column < self.k + self.m:
                raise ValueError(f"column {column} is outside 0..{self.k + self.m - 1} of {self!r}")
            blocks[column] = as_block(block)
            if len(blocks[column]) != block_len:
                raise ValueError(f"column {column} has {len(blocks[column])} bytes where every block has {block_len}")
        missing = [c for c in range(self.k) if c not in blocks]
        if not missing:
            return {}
        lost = self.k + self.m - len(blocks)
        if len(blocks) < self.k:
            raise UnrecoverableLoss(
                f"{lost} of the {self.k + self.m} columns of {self!r} are missing (data columns {missing} among them): "
                f"the code rebuilds at most {self.m}",
                missing=lost,
                tolerated=self.m,
            )
        if self._rs is not None:
            return self._rs.decode(blocks, missing, block_len)
        (column,) = missing  # m == 1 and k present: exactly one data column is missing, the parity is present
        others = list(blocks.values())
        rebuilt = np.empty(block_len, np.uint8)
        xor_into(rebuilt, others, add=False)
        return {column: rebuilt}

    @staticmethod
    def _blocks(blocks: Sequence[Any], count: int, what: str) -> list[np.ndarray]:
        arrays = [as_block(b) for b in blocks]
        if len(arrays) != count:
            raise ValueError(f"expected {count} {what}, got {len(arrays)}")
        if len({len(a) for a in arrays}) > 1:
            raise ValueError(f"{what} must be of one length, got {sorted({len(a) for a in arrays})}")
        return arrays
