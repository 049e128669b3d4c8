"""Erasure coding for ``--redundancy ec:K+M``: the code over blocks of bytes (:mod:`memstore.erasure.codec`).

Where each block goes is :mod:`memstore.core.erasure_layout` (pure logic); this package is the arithmetic, with
numpy and, for ``M >= 2``, the Reed-Solomon library of the ``erasure`` extra. No gRPC, no torch.
"""

from __future__ import annotations

from memstore.erasure.codec import MAX_COLUMNS, Codec

__all__ = ["MAX_COLUMNS", "Codec"]
