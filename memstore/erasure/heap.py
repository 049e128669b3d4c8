"""glibc's heap kept for reuse in a store that codes with ``m >= 2`` parities (``--redundancy ec:K+M``, M >= 2).

pyeclib (:mod:`memstore.erasure.reed_solomon`) allocates every fragment afresh, several MiB per stripe of 1 MiB
blocks. With glibc's default thresholds such blocks are mapped for each call and unmapped when freed, so every call
faults its output in again: 15 ms instead of 1.6 ms per 4+2 stripe, measured in ``docs/erasure.md``. Raising
``M_MMAP_THRESHOLD`` (256 MiB) and ``M_TRIM_THRESHOLD`` (1 GiB) through ``mallopt`` keeps freed blocks in the heap,
where the next call reuses them. XOR (``m = 1``) allocates nothing per block, so the store leaves the heap alone then.

:func:`tune_heap` is the one place that decides; ``memstore.server.store.Store`` calls it once at start. Setting
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` in the environment does the same before the process starts.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

from memstore.core.redundancy import Redundancy

log = logging.getLogger(__name__)

MiB = 1 << 20
MMAP_THRESHOLD = 256 * MiB  # blocks below this come from the heap, not a mapping of their own
TRIM_THRESHOLD = 1024 * MiB  # free memory at the heap's top kept up to this, not handed back to the kernel

# glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

Mallopt = Callable[[int, int], int]  # glibc's mallopt(param, value): 1 on success


def glibc_mallopt() -> Mallopt | None:
    """This process's ``mallopt`` (None: not glibc)."""
    try:
        return ctypes.CDLL("libc.so.6").mallopt  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


def tune_heap(redundancy: Redundancy, mallopt: Mallopt | None = None) -> bool:
    """Keep freed blocks in the heap if ``redundancy`` codes with ``m >= 2`` parities; whether it was set.

    ``mallopt`` defaults to glibc's; without glibc, or if it refuses, the store runs on (slower) and says so."""
    if not redundancy.erasure_coded or redundancy.m < 2:
        return False
    mallopt = mallopt or glibc_mallopt()
    if mallopt is None or not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        log.warning(
            "%s: could not raise the C heap's mmap/trim thresholds (not glibc?): Reed-Solomon coding pays page faults per call", redundancy
        )
        return False
    log.info(
        "%s: freed blocks stay in the C heap (mmap threshold %d MiB, trim threshold %d MiB)",
        redundancy,
        MMAP_THRESHOLD // MiB,
        TRIM_THRESHOLD // MiB,
    )
    return True
