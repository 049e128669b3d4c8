"""The dtypes the shard format stores: torch dtype tables, numpy dtype descriptions, raw-byte views.

Shared by the encoder and the decoder, so that both use one allowlist. Nothing here deserializes code:
numpy dtypes are rebuilt from JSON descriptions only.
"""

from __future__ import annotations

import json
import warnings
from typing import Any, Final

import numpy as np
import torch

from trainer_client.errors import CorruptShardError
from trainer_client.serialization.spec import MAX_DIM

__all__ = [
    "TENSOR_DTYPES",
    "TENSOR_DTYPE_NAMES",
    "TORCH_DTYPES",
    "TORCH_DTYPE_NAMES",
    "needs_raw_copy",
    "np_dtype_desc",
    "np_dtype_from_desc",
    "raw_byte_view",
]

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


TORCH_DTYPES, TORCH_DTYPE_NAMES = _torch_dtype_tables()

# Dtypes whose tensors can be stored. Quantized dtypes carry scale/zero-point outside the
# bytes, so raw bytes would not round-trip them.
TENSOR_DTYPES: Final = {name: dt for name, dt in TORCH_DTYPES.items() if name not in _QUANTIZED_DTYPE_NAMES}
TENSOR_DTYPE_NAMES: Final = {dt: name for name, dt in TENSOR_DTYPES.items()}

_raw_copy_cache: dict[torch.dtype, bool] = {}


def needs_raw_copy(dtype: torch.dtype) -> bool:
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


def raw_byte_view(t: torch.Tensor) -> torch.Tensor:
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


def np_dtype_desc(dt: np.dtype[Any]) -> str | list[Any]:
    """JSON description of a numpy dtype, or raise ValueError if it cannot round-trip."""
    cached = _np_desc_cache.get(dt)
    if cached is not None:
        return cached
    if dt.hasobject:
        raise ValueError(f"numpy dtype {dt} holds Python objects, which would need pickling")
    simple = dt.fields is None and dt.subdtype is None
    desc: str | list[Any] = dt.str if simple else json.loads(json.dumps(np.lib.format.dtype_to_descr(dt)))
    try:
        back = np_dtype_from_desc(desc)
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
            if type(shape) is not list or not all(type(d) is int and 0 <= d < MAX_DIM for d in shape):
                raise CorruptShardError(f"bad numpy field shape {shape!r:.80}")
            fields.append((name, fmt, tuple(shape)))
        else:
            fields.append((name, fmt))
    return fields


def np_dtype_from_desc(desc: object) -> np.dtype[Any]:
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
