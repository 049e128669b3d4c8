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

The library calls release the GIL while they compute; a :class:`ReedSolomon` may be used from several threads.
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
    """``k`` data and ``m`` parity columns of pyeclib's ISA-L Cauchy code, on blocks (1-D ``uint8`` arrays)."""

    def __init__(self, k: int, m: int) -> None:
        self.k = k
        self.m = m
        self._driver = _driver(k, m)
        self._headers: dict[int, list[bytes]] = {}  # padded block length -> each column's fragment header
        self._lock = threading.Lock()

    def _stripe(self, blocks: Sequence[np.ndarray | None], length: int) -> tuple[bytes, int]:
        """The ``k`` blocks (None: zeros) as one object for the library, each padded to the stride it returns."""
        stride = -(-length // ALIGN) * ALIGN
        if stride == length and all(b is not None for b in blocks):
            return b"".join(blocks), stride  # type: ignore[arg-type]
        stripe = np.zeros((self.k, stride), np.uint8)
        for column, block in enumerate(blocks):
            if block is not None:
                stripe[column, :length] = block
        return stripe.tobytes(), stride

    def _parity(self, stripe: bytes, stride: int, length: int) -> list[np.ndarray]:
        head = len(self._headers_for(stride)[0])
        fragments = self._driver.encode(stripe)
        return [np.frombuffer(f, np.uint8, count=length, offset=head) for f in fragments[self.k :]]

    def encode(self, blocks: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The ``m`` parity blocks (new, writable arrays) of ``k`` data blocks of one length."""
        length = len(blocks[0])
        stripe, stride = self._stripe(blocks, length)
        return [p.copy() for p in self._parity(stripe, stride, length)]

    def contribution(self, index: int, block: np.ndarray) -> list[np.ndarray]:
        """What data column ``index`` adds to each parity: the parity of a stripe with only that column (read-only)."""
        stripe, stride = self._stripe([block if c == index else None for c in range(self.k)], len(block))
        return self._parity(stripe, stride, len(block))

    def _headers_for(self, stride: int) -> list[bytes]:
        with self._lock:
            headers = self._headers.get(stride)
            if headers is None:
                fragments = self._driver.encode(bytes(self.k * stride))
                size = self._driver.get_metadata(fragments[0], formatted=True)["size"]
                if size != stride or len({len(f) for f in fragments}) != 1:  # pragma: no cover: a library change
                    raise RuntimeError(f"{BACKEND} cut a stripe of {self.k} x {stride} bytes into fragments of {size}")
                headers = [f[: len(f) - stride] for f in fragments]
                self._headers[stride] = headers
            return headers

    def decode(self, present: Mapping[int, np.ndarray], missing: Sequence[int], length: int) -> dict[int, np.ndarray]:
        """The ``missing`` data columns (new arrays) from ``present`` (at least ``k`` columns, data first used)."""
        stride = -(-length // ALIGN) * ALIGN
        headers = self._headers_for(stride)
        pad = bytes(stride - length)
        chosen = sorted(present)[: self.k]
        fragments = [b"".join((headers[c], present[c].data, pad)) for c in chosen]
        rebuilt = self._driver.reconstruct(fragments, list(missing))
        head = len(headers[0])
        return {c: np.frombuffer(f, np.uint8, count=length, offset=head).copy() for c, f in zip(missing, rebuilt, strict=True)}
