"""Reed-Solomon over GF(2^8) for ``m >= 2`` parity columns, from pyeclib (the ``erasure`` extra).

pyeclib's wheels bundle liberasurecode and Intel's ISA-L (SIMD Galois-field arithmetic) for Linux x86_64 and
aarch64, one abi3 wheel for every Python from 3.10; the backend is ISA-L's Cauchy matrix (``isa_l_rs_cauchy``),
which is MDS for every ``k + m`` (any ``k`` columns rebuild the rest; ISA-L's plain Vandermonde matrix is not for
some shapes, e.g. 16+6). Measured against zfec and the other backends in ``docs/erasure.md``.

pyeclib codes whole objects: ``encode(bytes)`` cuts them into ``k`` fragments and returns ``k + m`` fragments,
each behind an 80-byte header. This adapter works on blocks instead:

- Encoding joins the ``k`` blocks (each padded to the library's alignment) into one object; the fragments after
  the first ``k`` are the parity, read past their headers and cut back to the block length (the padding's parity is
  zeros, as the code is linear).
- Decoding needs the headers back. Without checksums (``chksum_type`` none) a header depends only on the column and
  the fragment length, never on the bytes, so one encoding of zeros per block length gives every column's header;
  the present blocks are put behind them and the library rebuilds the missing columns (``reconstruct``).
- A column's contribution is the parity of a stripe whose other columns are zeros: the library offers no
  multiply-by-constant, so this costs a whole stripe's encode (about ``k`` times one column's bytes).

pyeclib holds the GIL while it computes (its C extension never releases it; zfec's does): calls from several threads
are safe but take turns, so callers keep each call to a block or a few (about a millisecond per MiB of stripe), and
other threads run between them.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from memstore.errors import ErasureUnavailable

#: liberasurecode's backend: ISA-L, Cauchy matrix (MDS for every shape; SIMD on x86_64 and aarch64).
BACKEND = "isa_l_rs_cauchy"

#: Each block is padded to a multiple of this before encoding, so the library cuts the stripe at block bounds.
ALIGN = 64


def _driver(k: int, m: int) -> Any:
    try:
        from pyeclib.ec_iface import ECDriver
    except ImportError as exc:
        raise ErasureUnavailable(
            f"erasure coding with {m} parity fragments (ec:{k}+{m}) needs the Reed-Solomon library pyeclib: "
            "pip install 'memstore[erasure]' (ec:K+1 is XOR and needs nothing)"
        ) from exc
    return ECDriver(k=k, m=m, ec_type=BACKEND)


class ReedSolomon:
    """``k`` data and ``m`` parity columns of pyeclib's ISA-L Cauchy code, on blocks (1-D ``uint8`` arrays).

    Results are read-only views into the library's fragments (copy one to change it): the caller copies them
    where they live anyway, and each copy here would cost as much as the code's arithmetic.
    """

    def __init__(self, k: int, m: int) -> None:
        self.k = k
        self.m = m
        self._driver = _driver(k, m)
        self._shapes: dict[int, _Shape] = {}  # padded block length -> its headers and zeros
        self._lock = threading.Lock()

    def _shape(self, length: int) -> _Shape:
        stride = -(-length // ALIGN) * ALIGN
        with self._lock:
            shape = self._shapes.get(stride)
            if shape is None:
                zeros = bytes(self.k * stride)
                fragments = self._driver.encode(zeros)
                size = self._driver.get_metadata(fragments[0], formatted=True)["size"]
                if size != stride or len({len(f) for f in fragments}) != 1:  # pragma: no cover: a library change
                    raise RuntimeError(f"{BACKEND} cut a stripe of {self.k} x {stride} bytes into fragments of {size}")
                shape = _Shape(stride, [f[: len(f) - stride] for f in fragments], memoryview(zeros)[:stride])
                self._shapes[stride] = shape
            return shape

    def _encode(self, columns: Sequence[np.ndarray | None], length: int) -> list[np.ndarray]:
        """The parity views of a stripe of ``k`` blocks (None: zeros), joined and padded in one copy."""
        shape = self._shape(length)
        pad = shape.zeros[: shape.stride - length]
        pieces: list[memoryview] = []
        for block in columns:
            pieces += [shape.zeros] if block is None else [block.data, pad]
        fragments = self._driver.encode(b"".join(pieces))
        return [np.frombuffer(f, np.uint8, count=length, offset=shape.head) for f in fragments[self.k :]]

    def encode(self, blocks: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The ``m`` parity blocks of ``k`` data blocks of one length."""
        return self._encode(blocks, len(blocks[0]))

    def contribution(self, index: int, block: np.ndarray) -> list[np.ndarray]:
        """What data column ``index`` adds to each parity: the parity of a stripe with only that column."""
        return self._encode([block if c == index else None for c in range(self.k)], len(block))

    def decode(self, present: Mapping[int, np.ndarray], missing: Sequence[int], length: int) -> dict[int, np.ndarray]:
        """The ``missing`` data columns from ``present`` (at least ``k`` columns; the lowest ``k`` are read)."""
        shape = self._shape(length)
        pad = shape.zeros[: shape.stride - length]
        fragments = [b"".join((shape.headers[c], present[c].data, pad)) for c in sorted(present)[: self.k]]
        rebuilt = self._driver.reconstruct(fragments, list(missing))
        return {c: np.frombuffer(f, np.uint8, count=length, offset=shape.head) for c, f in zip(missing, rebuilt, strict=True)}


class _Shape:
    """What one padded block length needs: each column's fragment header (data-independent without checksums)
    and a stripe's worth of zeros to pad and to stand in for absent columns."""

    def __init__(self, stride: int, headers: list[bytes], zeros: memoryview) -> None:
        self.stride = stride
        self.headers = headers
        self.head = len(headers[0])
        self.zeros = zeros
