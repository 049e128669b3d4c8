"""Shared constants and dtype tables of the safe shard format (see :mod:`trainer_client.serialization`).

Split out of ``serialization`` so that the encoder (:mod:`trainer_client._shard_encode`) and the
decoder (``serialization`` itself) share one definition of the prelude, alignment and the dtype
allowlists. Nothing here deserializes code: numpy dtypes are rebuilt from JSON descriptions only.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import re
import struct
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

import numpy as np
import torch

from trainer_client.errors import CorruptShardError, InvalidArgumentError

FORMAT_VERSION: Final = 2
"""Version written. 2 added the compact blob table (``kinds`` + one index per blob)."""
READABLE_VERSIONS: Final = (1, 2)
MAGIC: Final = b"MSTSHRD1"
ALIGNMENT: Final = 64

MAX_DEPTH: Final = 256
"""Deepest container nesting accepted.

Lower than Python's default recursion limit (1000) on purpose: the walker and the JSON
codec both recurse once per level, and the caller's own stack counts against the
same limit. Real training states nest fewer than 20 levels.
"""

_PRELUDE: Final = struct.Struct("<8sIQ")
_PRELUDE_SIZE: Final = _PRELUDE.size  # 20
_DOUBLE: Final = struct.Struct("<d")
_ZEROS: Final = bytes(ALIGNMENT)
_SMALL_COPY: Final = 64 << 10
"""Blobs up to this size are copied with one memmove; larger ones with torch's
multi-threaded ``copy_``, whose fixed overhead (~5 us) only pays off for big tensors."""
_INT64_MIN: Final = -(1 << 63)
_UINT64_END: Final = 1 << 64
_MAX_DIM: Final = 1 << 62
_HEX_INT: Final = re.compile(r"-?[0-9a-f]+")
_HEX_BYTES: Final = re.compile(r"(?:[0-9a-f]{2})*")
_BYTEORDER: Final = sys.byteorder

_BLOB_TENSOR: Final = "tensor"
_BLOB_NDARRAY: Final = "ndarray"
_BLOB_BYTES: Final = "bytes"
_BLOB_BYTEARRAY: Final = "bytearray"

_HINT: Final = "convert it to a dict/tensor, or pass it in a supported form"

# Anything exposing the buffer protocol (bytes, bytearray, memoryview, mmap, numpy array...).
# Python 3.11 has no static type for that (collections.abc.Buffer arrived in 3.12).
Buffer = Any


_ALIGN_MASK: Final = ALIGNMENT - 1


def _align(n: int) -> int:
    return (n + _ALIGN_MASK) & ~_ALIGN_MASK


# --------------------------------------------------------------------------------------
# dtype tables
# --------------------------------------------------------------------------------------

_QUANTIZED_DTYPE_NAMES: Final = frozenset({"qint8", "quint8", "qint32", "quint4x2", "quint2x4"})


def _torch_dtype_tables() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    """Map canonical names (``str(dtype)`` minus ``torch.``) to every dtype this torch has.

    Built from the module itself so new dtypes (float8 variants, uint16, ...) are
    picked up without a code change; decode looks names up here, never via getattr.
    """
    by_name: dict[str, torch.dtype] = {}
    for attr in dir(torch):
        value = getattr(torch, attr, None)
        if isinstance(value, torch.dtype):
            by_name[str(value).removeprefix("torch.")] = value
    return by_name, {dt: name for name, dt in by_name.items()}


_TORCH_DTYPES, _TORCH_DTYPE_NAMES = _torch_dtype_tables()

# Dtypes whose tensors can be stored. Quantized dtypes carry scale/zero-point outside the
# bytes, so raw bytes would not round-trip them.
_TENSOR_DTYPES: Final = {
    name: dt for name, dt in _TORCH_DTYPES.items() if name not in _QUANTIZED_DTYPE_NAMES
}
_TENSOR_DTYPE_NAMES: Final = {dt: name for name, dt in _TENSOR_DTYPES.items()}

_raw_copy_cache: dict[torch.dtype, bool] = {}


def _needs_raw_copy(dtype: torch.dtype) -> bool:
    """Whether ``copy_`` lacks a kernel for ``dtype`` (bits*, int1..7, uint1..7 today).

    Probed once per dtype instead of hard-coding names, since the set changes between
    torch releases. Such tensors are copied as raw bytes instead.
    """
    cached = _raw_copy_cache.get(dtype)
    if cached is None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                probe = torch.empty(2, dtype=dtype)
                torch.empty(2, dtype=dtype).copy_(probe)
            cached = False
        except (RuntimeError, NotImplementedError):
            cached = True
        _raw_copy_cache[dtype] = cached
    return cached


def _raw_byte_view(t: torch.Tensor) -> torch.Tensor:
    """A uint8 alias of ``t`` with shape ``t.shape + (itemsize,)``, honouring its strides."""
    k = t.element_size()
    raw = torch.empty(0, dtype=torch.uint8, device=t.device)
    raw.set_(
        t.untyped_storage(),
        t.storage_offset() * k,
        (*t.shape, k),
        (*(s * k for s in t.stride()), 1),
    )
    return raw


_np_desc_cache: dict[np.dtype[Any], str | list[Any]] = {}


def _np_dtype_desc(dt: np.dtype[Any]) -> str | list[Any]:
    """JSON description of a numpy dtype, or raise ValueError if it cannot round-trip."""
    cached = _np_desc_cache.get(dt)
    if cached is not None:
        return cached
    if dt.hasobject:
        raise ValueError(f"numpy dtype {dt} holds Python objects, which would need pickling")
    simple = dt.fields is None and dt.subdtype is None
    desc: str | list[Any] = dt.str if simple else json.loads(json.dumps(np.lib.format.dtype_to_descr(dt)))
    try:
        back = _np_dtype_from_desc(desc)
    except CorruptShardError as exc:
        raise ValueError(f"numpy dtype {dt} cannot be described portably: {exc}") from None
    if back != dt or back.itemsize != dt.itemsize:
        raise ValueError(f"numpy dtype {dt} cannot be described portably")
    _np_desc_cache[dt] = desc
    return desc


def _descr_from_json(desc: object) -> Any:
    """Turn a JSON-decoded ``descr`` (lists everywhere) back into numpy's tuple form."""
    if type(desc) is str:
        return desc
    if type(desc) is not list:
        raise CorruptShardError(f"numpy dtype description must be a string or list, got {desc!r:.80}")
    fields: list[tuple[Any, ...]] = []
    for field in desc:
        if type(field) is not list or len(field) not in (2, 3):
            raise CorruptShardError(f"bad numpy field description {field!r:.80}")
        name = field[0]
        if type(name) is list and len(name) == 2 and all(type(p) is str for p in name):
            name = tuple(name)
        elif type(name) is not str:
            raise CorruptShardError(f"bad numpy field name {name!r:.80}")
        fmt = _descr_from_json(field[1])
        if len(field) == 3:
            shape = field[2]
            if type(shape) is not list or not all(type(d) is int and 0 <= d < _MAX_DIM for d in shape):
                raise CorruptShardError(f"bad numpy field shape {shape!r:.80}")
            fields.append((name, fmt, tuple(shape)))
        else:
            fields.append((name, fmt))
    return fields


def _np_dtype_from_desc(desc: object) -> np.dtype[Any]:
    """Rebuild a numpy dtype from its header description; never yields object dtypes.

    numpy parses dtype strings and descr lists in C or with regexes; nothing is
    evaluated. Object dtypes are refused because an array of them would turn shard
    bytes into PyObject pointers.
    """
    try:
        parsed = _descr_from_json(desc)
        dt = np.dtype(parsed) if type(parsed) is str else np.lib.format.descr_to_dtype(parsed)
    except CorruptShardError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError, RecursionError) as exc:
        raise CorruptShardError(f"invalid numpy dtype {desc!r:.80}: {exc}") from None
    if dt.hasobject:
        raise CorruptShardError(f"numpy dtype {desc!r:.80} holds Python objects; refusing to decode it")
    return dt


class _GcPaused:
    """Pause the cyclic GC while building or parsing a big header.

    Plan and decode create tens of thousands of small lists and dicts in a burst; each
    allocation threshold crossing triggers a collection that walks every live object,
    which measured 2-3x slower for a 10k-tensor state. Only re-enables the GC if it was
    enabled on entry.
    """

    __slots__ = ("was_enabled",)

    def __enter__(self) -> None:
        self.was_enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self.was_enabled:
            gc.enable()


def _as_byte_view(buf: Buffer) -> memoryview:
    """A flat unsigned-byte memoryview of ``buf`` (raises TypeError/InvalidArgumentError)."""
    mv = memoryview(buf)
    if mv.format == "B" and mv.ndim == 1 and mv.c_contiguous:
        return mv
    try:
        if not mv.c_contiguous:
            raise InvalidArgumentError("shard buffers must be C-contiguous")
        return mv.cast("B")
    finally:
        mv.release()


# --------------------------------------------------------------------------------------
# large copies
# --------------------------------------------------------------------------------------

_COPY_THREADS = max(1, min(4, os.cpu_count() or 1))
_COPY_PIECE = 16 << 20
_copy_pool: ThreadPoolExecutor | None = None


def _parallel_memmove(moves: list[tuple[int, int, int]]) -> None:
    """Copy (dst, src, n) ranges with plain memmove on a few threads (ctypes drops the GIL).

    Why not ``Tensor.copy_``: its OpenMP workers spin-wait at a barrier, and when the trainer's
    cores are busy (other ranks, data-loader workers, the store) one descheduled worker stalls
    the whole copy: 10 MiB measured at 2.5 ms single-threaded took up to 335 ms that way.
    Independent memmoves of 16 MiB pieces degrade gracefully instead.
    """
    global _copy_pool
    pieces = [(d + off, s + off, min(_COPY_PIECE, n - off)) for d, s, n in moves for off in range(0, n, _COPY_PIECE)]
    if len(pieces) <= 1 or _COPY_THREADS == 1:
        for d, s, n in pieces:
            ctypes.memmove(d, s, n)
        return
    if _copy_pool is None:
        _copy_pool = ThreadPoolExecutor(max_workers=_COPY_THREADS, thread_name_prefix="memstore-copy")
    list(_copy_pool.map(lambda p: ctypes.memmove(*p), pieces))
