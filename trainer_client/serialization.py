"""Safe, fast binary format for one rank's training state (a "shard").

A shard is::

    MAGIC (8 bytes) | u32 format version | u64 header length | header JSON (utf-8)
    | zero padding to a 64-byte boundary | blobs, each starting on a 64-byte boundary

All prelude integers are little-endian. The header is plain JSON (ASCII in practice,
since ``json.dumps`` escapes everything else), parsed with :func:`json.loads` only:
decoding never runs pickle, ``torch.load``, ``eval`` or any other code path that can
execute data, because shard bytes may arrive over the network.

Header keys::

    {"version": 1, "byteorder": "little", "nbytes": <total shard size>,
     "data_offset": <offset of the first blob slot>,
     "blobs": [{"kind": "tensor" | "ndarray" | "bytes" | "bytearray",
                "offset": <absolute offset in the shard>, "nbytes": ..., ...}, ...],
     "root": <encoded tree>}

Tensor blobs add ``dtype`` (torch name, e.g. ``"bfloat16"``) and ``shape``, plus, only
when they differ from the default, ``"requires_grad": true``, ``"parameter": true`` and
``"device"`` (the device the tensor lived on when saved, if not CPU; informational only).
Leaving defaults out keeps a 10k-tensor header about a third smaller. Array blobs add
``dtype`` (a numpy dtype string or ``descr`` list) and ``shape``. Bytes blobs add nothing.

The tree encodes every value either as a JSON scalar (``null``, ``true``/``false``,
a string, or an int that fits in 64 bits) or as a JSON list whose first element is a
tag:

==========  ============================================================
``f``       float; ``["f", <16 hex chars of struct '<d'>]`` (bit-exact, NaN payloads too)
``i``       int outside 64 bits; ``["i", <hex digits>]`` (JSON decimals over 4300
            digits hit Python's int-parsing limit, hex does not)
``l``/``t`` list / tuple; items follow the tag
``d``       dict; ``["d", k0, v0, k1, v1, ...]`` - key/value pairs flattened so that
            non-str keys work and the JSON nesting depth matches the state's
``o``       OrderedDict, same layout as ``d``
``om``      OrderedDict with a ``_metadata`` attribute: ``["om", <metadata>, k0, v0, ...]``
``s``/``F`` set / frozenset; items follow the tag
``S``       torch.Size; ints follow the tag
``y``/``v`` torch.dtype name / torch.device string
``nd``      numpy dtype; ``["nd", <dtype description>]``
``n``       numpy scalar; ``["n", <dtype description>, <hex of its bytes>]``
``T``/``N`` tensor (incl. Parameter) / ndarray; ``["T", <blob index>]``
``b``/``B`` bytes / bytearray; ``["b", <blob index>]``
==========  ============================================================

Dict keys and set members may be ``str``, ``int``, ``float``, ``bool``, ``None`` or
tuples of those.

What is and is not preserved:

* Tensors come back contiguous, on CPU, owning their memory, with the same dtype,
  shape, values (bit-exact) and ``requires_grad``; ``nn.Parameter`` stays a Parameter.
  A tensor that lived on another device is copied to CPU on save; its original device
  is recorded in the header but the restored tensor is on CPU (moving it back is the
  caller's job, e.g. via ``load_state_dict``). Gradients (``.grad``), autograd history
  and storage sharing between *different* tensor objects (e.g. views of one base) are
  not preserved; the *same* object appearing twice is stored once and restored as one
  object.
* Containers are copied; a container reachable twice without a cycle is restored as two
  equal copies. Reference cycles are rejected.
* Tensor bytes are stored in the writing host's byte order, which the header records;
  a reader on a host with the other byte order rejects the shard.
"""

from __future__ import annotations

import collections
import ctypes
import gc
import json
import os
import re
import struct
import sys
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, NoReturn, cast

import numpy as np
import torch

from trainer_client.errors import (
    CorruptShardError,
    InvalidArgumentError,
    SerializationError,
)

__all__ = [
    "ALIGNMENT",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_DEPTH",
    "ShardLayout",
    "decode",
    "encode",
    "peek_header",
    "plan",
]

FORMAT_VERSION: Final = 1
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


# --------------------------------------------------------------------------------------
# plan / encode
# --------------------------------------------------------------------------------------

# A path is a linked list of segments, rendered only when an error needs it.
_Path = tuple[Any, str, object] | None


def _short_repr(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _render_path(path: _Path) -> str:
    parts: list[str] = []
    while path is not None:
        parent, kind, key = path
        if kind == "key":
            parts.append(f"[{_short_repr(key)}]")
        elif kind == "index":
            parts.append(f"[{key}]")
        else:
            parts.append(str(key))
        path = parent
    return "state" + "".join(reversed(parts))


def _type_name(value: object) -> str:
    cls = type(value)
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


# A planned data slot: (kind, offset within the data area, nbytes, source, dtype, shape).
# Plain tuples because a 10k-tensor state creates 10k of them on the trainer's clock.
_Blob = tuple[str, int, int, Any, Any, tuple[int, ...]]


class _Planner:
    """Walks the state once, validating values and assigning blob slots (no data copies)."""

    def __init__(self) -> None:
        self.blobs: list[_Blob] = []
        self.records: list[dict[str, Any]] = []
        self.memo: dict[int, int] = {}  # id(blob source) -> blob index
        self.active: set[int] = set()  # ids of the containers on the current path
        self.cursor = 0

    def fail(self, message: str, path: _Path) -> NoReturn:
        raise SerializationError(message, _render_path(path))

    def unsupported(self, value: object, path: _Path, extra: str = "") -> NoReturn:
        self.fail(f"unsupported type {_type_name(value)}{extra}; {_HINT}", path)

    def add_blob(self, src: Any, nbytes: int, dtype: Any, shape: tuple[int, ...],
                 record: dict[str, Any]) -> int:
        """Reserve an aligned slot; ``record`` already holds kind/offset/nbytes placeholders."""
        index = len(self.blobs)
        offset = (self.cursor + _ALIGN_MASK) & ~_ALIGN_MASK
        self.cursor = offset + nbytes
        record["offset"] = offset
        self.blobs.append((record["kind"], offset, nbytes, src, dtype, shape))
        self.records.append(record)
        self.memo[id(src)] = index
        return index

    # -- values ----------------------------------------------------------------------

    def enc(self, v: object, path: _Path, depth: int) -> Any:
        t = type(v)
        if t is str or v is None or t is bool:
            return v
        if t is int:
            return v if _INT64_MIN <= v < _UINT64_END else ["i", format(v, "x")]  # type: ignore[operator]
        if t is torch.Tensor or t is torch.nn.Parameter:
            return ["T", self.enc_tensor(v, path)]  # type: ignore[arg-type]
        if t is dict or t is collections.OrderedDict:
            return self.enc_dict(v, path, depth)  # type: ignore[arg-type]
        if t is float:
            return ["f", _DOUBLE.pack(v).hex()]
        if t is list or t is tuple:
            return self.enc_seq("l" if t is list else "t", v, path, depth)  # type: ignore[arg-type]
        if t is torch.Size:
            return ["S", *v]  # type: ignore[misc]
        if t is torch.dtype:
            return ["y", _TORCH_DTYPE_NAMES[v]]  # type: ignore[index]
        if t is torch.device:
            return ["v", str(v)]
        if t is np.ndarray:
            return ["N", self.enc_ndarray(v, path)]  # type: ignore[arg-type]
        if t is bytes or t is bytearray:
            return ["b" if t is bytes else "B", self.enc_bytes(v)]  # type: ignore[arg-type]
        if t is set or t is frozenset:
            return self.enc_set(v, path, depth)  # type: ignore[arg-type]
        if isinstance(v, np.generic):
            return self.enc_np_scalar(v, path)
        if isinstance(v, np.dtype):
            try:
                return ["nd", _np_dtype_desc(v)]
            except ValueError as exc:
                self.fail(str(exc), path)
        if isinstance(v, torch.Tensor):
            self.unsupported(v, path, " (tensor subclass); pass a plain tensor or nn.Parameter")
        if isinstance(v, tuple) and hasattr(t, "_fields"):
            self.unsupported(v, path, " (namedtuple); convert it with ._asdict() or tuple(...)")
        self.unsupported(v, path)

    def enc_key(self, k: object, path: _Path, depth: int) -> Any:
        """Dict keys / set members: hashable scalars and tuples of them."""
        t = type(k)
        if t is str or k is None or t is bool:
            return k
        if t is int:
            return k if _INT64_MIN <= k < _UINT64_END else ["i", format(k, "x")]  # type: ignore[operator]
        if t is float:
            return ["f", _DOUBLE.pack(k).hex()]
        if t is tuple:
            if depth >= MAX_DEPTH:
                self.fail(f"nesting deeper than {MAX_DEPTH} levels", path)
            return ["t", *(self.enc_key(item, path, depth + 1) for item in k)]  # type: ignore[attr-defined]
        self.fail(
            f"unsupported dict key / set member {_short_repr(k)} of type {_type_name(k)}; "
            "keys must be str, int, float, bool, None or tuples of those",
            path,
        )

    def enter(self, v: object, path: _Path, depth: int) -> int:
        if depth >= MAX_DEPTH:
            self.fail(f"nesting deeper than {MAX_DEPTH} levels", path)
        vid = id(v)
        if vid in self.active:
            self.fail(f"reference cycle: this {_type_name(v)} contains itself", path)
        self.active.add(vid)
        return vid

    def enc_dict(self, v: dict[Any, Any], path: _Path, depth: int) -> list[Any]:
        vid = self.enter(v, path, depth)
        out: list[Any]
        if type(v) is dict:
            out = ["d"]
        else:
            attrs = v.__dict__ if hasattr(v, "__dict__") else {}
            out = ["o"]
            if "_metadata" in attrs:
                out = ["om", self.enc(attrs["_metadata"], (path, "attr", "._metadata"), depth + 1)]
        append = out.append
        for key, value in v.items():
            child: _Path = (path, "key", key)
            append(self.enc_key(key, child, depth + 1))
            append(self.enc(value, child, depth + 1))
        self.active.discard(vid)
        return out

    def enc_seq(self, tag: str, v: list[Any] | tuple[Any, ...], path: _Path, depth: int) -> list[Any]:
        vid = self.enter(v, path, depth)
        out: list[Any] = [tag]
        append = out.append
        for i, item in enumerate(v):
            append(self.enc(item, (path, "index", i), depth + 1))
        self.active.discard(vid)
        return out

    def enc_set(self, v: set[Any] | frozenset[Any], path: _Path, depth: int) -> list[Any]:
        if depth >= MAX_DEPTH:
            self.fail(f"nesting deeper than {MAX_DEPTH} levels", path)
        out: list[Any] = ["s" if type(v) is set else "F"]
        for item in v:
            out.append(self.enc_key(item, (path, "attr", f"{{{_short_repr(item)}}}"), depth + 1))
        return out

    def enc_tensor(self, v: torch.Tensor, path: _Path) -> int:
        index = self.memo.get(id(v))
        if index is not None:
            return index
        if v.layout is not torch.strided:
            self.unsupported(v, path, f" with layout {v.layout} (only dense tensors; call .to_dense())")
        if v.is_quantized:
            self.unsupported(v, path, " (quantized tensor; dequantize it or store int_repr() and scales)")
        if v.is_nested:
            self.unsupported(v, path, " (nested tensor; store its components with .unbind())")
        if v.is_meta:
            self.unsupported(v, path, " on the meta device (it has no data)")
        dtype = v.dtype
        name = _TENSOR_DTYPE_NAMES.get(dtype)
        if name is None:
            self.unsupported(v, path, f" with dtype {dtype}")
        shape = v.shape
        # Keys that hold their default (False / "cpu") are left out to keep big headers small.
        record: dict[str, Any] = {
            "kind": _BLOB_TENSOR, "offset": 0, "nbytes": v.numel() * v.element_size(),
            "dtype": name, "shape": list(shape),
        }
        if v.requires_grad:
            record["requires_grad"] = True
        if type(v) is torch.nn.Parameter:
            record["parameter"] = True
        if not v.is_cpu:
            record["device"] = str(v.device)
        return self.add_blob(v, record["nbytes"], dtype, shape, record)

    def enc_ndarray(self, v: np.ndarray[Any, Any], path: _Path) -> int:
        index = self.memo.get(id(v))
        if index is not None:
            return index
        try:
            desc = _np_dtype_desc(v.dtype)
        except ValueError as exc:
            self.fail(f"{exc}; {_HINT}", path)
        shape = tuple(v.shape)
        nbytes = v.size * v.dtype.itemsize
        record = {"kind": _BLOB_NDARRAY, "offset": 0, "nbytes": nbytes, "dtype": desc, "shape": list(shape)}
        return self.add_blob(v, nbytes, v.dtype, shape, record)

    def enc_bytes(self, v: bytes | bytearray) -> int:
        index = self.memo.get(id(v))
        if index is not None:
            return index
        kind = _BLOB_BYTES if type(v) is bytes else _BLOB_BYTEARRAY
        return self.add_blob(v, len(v), None, (len(v),), {"kind": kind, "offset": 0, "nbytes": len(v)})

    def enc_np_scalar(self, v: np.generic, path: _Path) -> list[Any]:
        # Via a 0-d array: np.str_("") has itemsize-0 dtype "<U0" yet 4 bytes of data;
        # its array form ("<U1") describes the bytes exactly and indexes back to np.str_.
        arr = np.asarray(v)
        try:
            desc = _np_dtype_desc(arr.dtype)
        except ValueError as exc:
            self.fail(f"{exc}; {_HINT}", path)
        return ["n", desc, arr.tobytes().hex()]


def _dumps(header: dict[str, Any]) -> bytes:
    return json.dumps(header, separators=(",", ":"), allow_nan=False).encode("ascii")


def _ndigits(n: int) -> int:
    return len(str(n))


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


class ShardLayout:
    """The planned encoding of one state: header bytes plus where each blob goes.

    Holds references to the state's tensors/arrays (not copies); the state must not be
    mutated between :func:`plan` and :meth:`write_into`.
    """

    __slots__ = ("_blobs", "_header", "data_offset", "nbytes", "num_tensors")

    def __init__(self, header: bytes, data_offset: int, nbytes: int, blobs: list[_Blob]) -> None:
        self._header = header
        self._blobs = blobs  # offsets relative to data_offset
        self.data_offset = data_offset
        self.nbytes = nbytes
        self.num_tensors = len(blobs)

    def __repr__(self) -> str:
        return (
            f"ShardLayout(nbytes={self.nbytes}, num_tensors={self.num_tensors}, "
            f"header_bytes={len(self._header)})"
        )

    def write_into(self, buf: Buffer) -> None:
        """Write the shard into ``buf[:nbytes]``: header, then every blob into its slot.

        ``buf`` must be a writable, C-contiguous buffer (bytearray, writable mmap,
        memoryview, ...) at least :attr:`nbytes` long. Padding is zeroed so identical
        states give identical bytes even in a reused buffer. Tensor bytes are copied with
        ``Tensor.copy_`` straight from the (possibly strided, possibly non-CPU) source
        into a view of ``buf``, which runs multi-threaded at memcpy speed and needs no
        temporary.
        """
        mv = _as_byte_view(buf)
        # Everything aliasing ``mv`` must be dropped before mv.release() in ``finally``.
        base: torch.Tensor | None = None
        base_addr = 0
        dst: torch.Tensor | None = None
        arr: np.ndarray[Any, Any] | None = None
        try:
            if mv.readonly:
                raise InvalidArgumentError("write_into needs a writable buffer; got a read-only one")
            if len(mv) < self.nbytes:
                raise InvalidArgumentError(
                    f"buffer holds {len(mv)} bytes but the shard needs {self.nbytes}"
                )
            header = self._header
            header_end = _PRELUDE_SIZE + len(header)
            _PRELUDE.pack_into(mv, 0, MAGIC, FORMAT_VERSION, len(header))
            mv[_PRELUDE_SIZE:header_end] = header
            pos = header_end
            data_offset = self.data_offset
            moves: list[tuple[int, int, int]] = []
            with torch.no_grad():
                for index, (kind, rel, n, src, dtype, shape) in enumerate(self._blobs):
                    offset = data_offset + rel
                    if offset > pos:
                        mv[pos:offset] = _ZEROS[: offset - pos]
                    pos = offset + n
                    if kind == _BLOB_TENSOR:
                        if src.dtype != dtype or src.shape != shape:
                            raise SerializationError(
                                "tensor changed dtype or shape between plan() and write_into()",
                                f"blob #{index}",
                            )
                        if n == 0:
                            continue
                        if base is None:
                            base = torch.frombuffer(mv, dtype=torch.uint8, count=self.nbytes)
                            base_addr = base.data_ptr()
                        if src.is_cpu and src.is_contiguous() and not src.is_conj() and not src.is_neg():
                            # Its n bytes are contiguous at data_ptr(); the slot lies inside
                            # buf (checked above). Small ones right away (~6x less overhead than
                            # three torch ops), large ones in parallel below.
                            if n <= _SMALL_COPY:
                                ctypes.memmove(base_addr + offset, src.data_ptr(), n)
                            else:
                                moves.append((base_addr + offset, src.data_ptr(), n))
                            continue
                        dst = base[offset:pos]
                        if _needs_raw_copy(dtype):
                            dst.view(*shape, src.element_size()).copy_(_raw_byte_view(src))
                        else:
                            dst.view(dtype).view(shape).copy_(src)
                    elif kind == _BLOB_NDARRAY:
                        if src.dtype != dtype or src.shape != shape:
                            raise SerializationError(
                                "array changed dtype or shape between plan() and write_into()",
                                f"blob #{index}",
                            )
                        if n == 0:
                            continue
                        arr = np.frombuffer(mv, dtype=np.uint8, count=n, offset=offset)
                        np.copyto(arr.view(dtype).reshape(shape), src, casting="no")
                    elif n:
                        if len(src) != n:
                            raise SerializationError(
                                "bytearray changed length between plan() and write_into()",
                                f"blob #{index}",
                            )
                        mv[offset:pos] = src
            _parallel_memmove(moves)
        finally:
            base = dst = arr = None
            mv.release()


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


def plan(state: object) -> ShardLayout:
    """Walk ``state`` once, validate every value and compute the shard layout.

    Copies no tensor data. Raises :class:`SerializationError` naming the path (e.g.
    ``state['optim']['state'][3]['exp_avg']``) of the first value that cannot be stored
    without pickling, of a reference cycle, or of nesting deeper than :data:`MAX_DEPTH`.
    """
    with _GcPaused():
        planner = _Planner()
        try:
            root = planner.enc(state, None, 0)
            records = planner.records
            data_len = planner.cursor
            header: dict[str, Any] = {
                "version": FORMAT_VERSION,
                "byteorder": _BYTEORDER,
                "nbytes": 0,
                "data_offset": 0,
                "blobs": records,
                "root": root,
            }
            # Blob offsets in the header are absolute, so the header's length depends on
            # the data offset, which depends on the header's length. Dump once with
            # relative offsets, then solve for the data offset arithmetically (only digit
            # counts change), then dump the final header.
            draft_len = len(_dumps(header))
            relative = [record["offset"] for record in records]
            rel_digits = sum(_ndigits(rel) for rel in relative)
            data_offset = _align(_PRELUDE_SIZE + draft_len)
            while True:
                final_len = (
                    draft_len
                    + sum(_ndigits(data_offset + rel) for rel in relative) - rel_digits
                    + _ndigits(data_offset) - 1
                    + _ndigits(data_offset + data_len) - 1
                )
                needed = _align(_PRELUDE_SIZE + final_len)
                if needed <= data_offset:
                    break
                data_offset = needed
            header["data_offset"] = data_offset
            header["nbytes"] = data_offset + data_len
            for record, rel in zip(records, relative, strict=True):
                record["offset"] = data_offset + rel
            encoded = _dumps(header)
        except RecursionError:
            raise SerializationError(
                "state nests too deeply for Python's recursion limit", "state"
            ) from None
    if _align(_PRELUDE_SIZE + len(encoded)) != data_offset:  # the arithmetic above is exact
        raise AssertionError("shard header length disagrees with its planned data offset")
    return ShardLayout(encoded, data_offset, data_offset + data_len, planner.blobs)


def encode(state: object) -> bytearray:
    """Plan and write ``state`` into a fresh bytearray of exactly ``layout.nbytes`` bytes."""
    layout = plan(state)
    out = bytearray(layout.nbytes)
    layout.write_into(out)
    return out


# --------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------


class _BlobSpec:
    """A validated blob record from the header."""

    __slots__ = ("dtype", "kind", "nbytes", "offset", "parameter", "requires_grad", "shape")

    def __init__(self, kind: str, offset: int, nbytes: int) -> None:
        self.kind = kind
        self.offset = offset
        self.nbytes = nbytes
        self.dtype: Any = None
        self.shape: tuple[int, ...] = ()
        self.requires_grad = False
        self.parameter = False


def _corrupt(message: str) -> NoReturn:
    raise CorruptShardError(message)


def _is_uint(value: object) -> bool:
    return type(value) is int and value >= 0  # type: ignore[operator]


def _check_shape(shape: object, where: str) -> tuple[tuple[int, ...], int]:
    if type(shape) is not list or not all(type(d) is int and 0 <= d < _MAX_DIM for d in shape):
        _corrupt(f"{where}: shape must be a list of non-negative ints, got {shape!r:.80}")
    numel = 1
    for d in shape:
        numel *= d
    return tuple(shape), numel


def _reject_constant(name: str) -> NoReturn:
    raise CorruptShardError(f"header JSON contains {name}, which the format never writes")


def _read_header(mv: memoryview) -> tuple[dict[str, Any], list[_BlobSpec]]:
    """Parse and validate the prelude, header JSON and blob table of a shard."""
    size = len(mv)
    if size < _PRELUDE_SIZE:
        _corrupt(f"buffer is {size} bytes, shorter than the {_PRELUDE_SIZE}-byte shard prelude")
    magic, version, header_len = _PRELUDE.unpack_from(mv, 0)
    if magic != MAGIC:
        _corrupt(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}: not a memstore shard")
    if version != FORMAT_VERSION:
        _corrupt(f"shard format version {version}, this reader understands only {FORMAT_VERSION}")
    if header_len > size - _PRELUDE_SIZE:
        _corrupt(
            f"header length {header_len} runs past the end of the {size}-byte buffer (truncated?)"
        )
    try:
        text = bytes(mv[_PRELUDE_SIZE : _PRELUDE_SIZE + header_len]).decode("utf-8")
        header = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError, JSONDecodeError
        raise CorruptShardError(f"header is not valid UTF-8 JSON: {exc}") from None
    if type(header) is not dict:
        _corrupt(f"header must be a JSON object, got {type(header).__name__}")
    for key in ("version", "byteorder", "nbytes", "data_offset", "blobs", "root"):
        if key not in header:
            _corrupt(f"header lacks required key {key!r}")
    if header["version"] != FORMAT_VERSION or type(header["version"]) is not int:
        _corrupt(f"header version {header['version']!r:.40} disagrees with prelude version {version}")
    if header["byteorder"] != _BYTEORDER:
        _corrupt(
            f"shard was written on a {header['byteorder']!r:.20}-endian host; this host is "
            f"{_BYTEORDER}-endian and cannot decode its tensors"
        )
    total = header["nbytes"]
    data_offset = header["data_offset"]
    expected_data_offset = _align(_PRELUDE_SIZE + header_len)
    if data_offset != expected_data_offset or type(data_offset) is not int:
        _corrupt(f"data_offset {data_offset!r:.40} should be {expected_data_offset}")
    if not _is_uint(total) or total < data_offset:
        _corrupt(f"total size {total!r:.40} is smaller than the data offset {data_offset}")
    if total > size:
        _corrupt(f"shard declares {total} bytes but the buffer holds only {size} (truncated?)")
    records = header["blobs"]
    if type(records) is not list:
        _corrupt("header 'blobs' must be a list")
    specs: list[_BlobSpec] = []
    end = data_offset
    for index, record in enumerate(records):
        where = f"blob #{index}"
        if type(record) is not dict:
            _corrupt(f"{where}: record must be an object")
        kind = record.get("kind")
        offset = record.get("offset")
        nbytes = record.get("nbytes")
        if not _is_uint(offset) or not _is_uint(nbytes):
            _corrupt(f"{where}: offset and nbytes must be non-negative ints")
        assert type(offset) is int and type(nbytes) is int
        if offset % ALIGNMENT:
            _corrupt(f"{where}: offset {offset} is not {ALIGNMENT}-byte aligned")
        if offset < end:
            _corrupt(f"{where}: offset {offset} overlaps the header or the previous blob (ends at {end})")
        if offset + nbytes > total:
            _corrupt(f"{where}: bytes [{offset}, {offset + nbytes}) run past the shard end {total}")
        end = offset + nbytes
        spec = _BlobSpec(str(kind), offset, nbytes)
        if kind == _BLOB_TENSOR:
            name = record.get("dtype")
            dtype = _TENSOR_DTYPES.get(name) if type(name) is str else None
            if dtype is None:
                _corrupt(f"{where}: unknown tensor dtype {name!r:.40}")
            shape, numel = _check_shape(record.get("shape"), where)
            if numel * dtype.itemsize != nbytes:
                _corrupt(
                    f"{where}: {nbytes} bytes do not match shape {list(shape)} of {name} "
                    f"({numel * dtype.itemsize} bytes)"
                )
            requires_grad = record.get("requires_grad", False)
            parameter = record.get("parameter", False)
            if type(requires_grad) is not bool or type(parameter) is not bool:
                _corrupt(f"{where}: requires_grad and parameter must be booleans")
            if requires_grad and not (dtype.is_floating_point or dtype.is_complex):
                _corrupt(f"{where}: a {name} tensor cannot require grad")
            if type(record.get("device", "cpu")) is not str:
                _corrupt(f"{where}: device must be a string")
            spec.dtype, spec.shape = dtype, shape
            spec.requires_grad, spec.parameter = requires_grad, parameter
        elif kind == _BLOB_NDARRAY:
            np_dtype = _np_dtype_from_desc(record.get("dtype"))
            shape, numel = _check_shape(record.get("shape"), where)
            if numel * np_dtype.itemsize != nbytes:
                _corrupt(
                    f"{where}: {nbytes} bytes do not match shape {list(shape)} of {np_dtype} "
                    f"({numel * np_dtype.itemsize} bytes)"
                )
            spec.dtype, spec.shape = np_dtype, shape
        elif kind != _BLOB_BYTES and kind != _BLOB_BYTEARRAY:
            _corrupt(f"{where}: unknown blob kind {kind!r:.40}")
        specs.append(spec)
    return header, specs


class _Decoder:
    """Rebuilds the state tree, copying each referenced blob out of the shard once."""

    def __init__(self, mv: memoryview, specs: list[_BlobSpec], share: object = None) -> None:
        self.mv = mv
        self.specs = specs
        # zero-copy decode: large tensors and arrays become views of this writable buffer object
        self.share = share
        self.share_base: torch.Tensor | None = None
        self.objects: dict[int, Any] = {}
        self.base: torch.Tensor | None = None
        self.base_addr = 0
        self.np_base: np.ndarray[Any, Any] | None = None
        self.handlers: dict[str, Callable[[list[Any], int], Any]] = {
            "f": self.dec_float,
            "i": self.dec_bigint,
            "l": self.dec_list,
            "t": self.dec_tuple,
            "d": self.dec_dict,
            "o": self.dec_odict,
            "om": self.dec_odict,
            "s": self.dec_set,
            "F": self.dec_set,
            "S": self.dec_size,
            "y": self.dec_dtype,
            "v": self.dec_device,
            "nd": self.dec_np_dtype,
            "n": self.dec_np_scalar,
            "T": self.dec_blob,
            "N": self.dec_blob,
            "b": self.dec_blob,
            "B": self.dec_blob,
        }

    def close(self) -> None:
        # Drop every alias of the shard buffer so the caller can release/close it.
        self.base = None
        self.np_base = None
        self.share_base = None

    # -- tree -------------------------------------------------------------------------

    def dec(self, node: Any, depth: int) -> Any:
        t = type(node)
        if t is str or t is int or t is bool or node is None:
            return node
        if t is not list or not node or type(node[0]) is not str:
            _corrupt(f"malformed tree node {node!r:.80}")
        if depth > MAX_DEPTH + 2:
            _corrupt(f"tree nests deeper than {MAX_DEPTH} levels")
        handler = self.handlers.get(node[0])
        if handler is None:
            _corrupt(f"unknown tag {node[0]!r:.40} in tree")
        return handler(node, depth)

    def dec_key(self, node: Any, depth: int) -> Any:
        t = type(node)
        if t is str or t is int or t is bool or node is None:
            return node
        if t is list and node and depth <= MAX_DEPTH + 2:
            tag = node[0]
            if tag == "f":
                return self.dec_float(node, depth)
            if tag == "i":
                return self.dec_bigint(node, depth)
            if tag == "t":
                return tuple([self.dec_key(item, depth + 1) for item in node[1:]])
        _corrupt(f"malformed dict key / set member {node!r:.80}")

    def dec_float(self, node: list[Any], depth: int) -> float:
        if len(node) != 2 or type(node[1]) is not str or len(node[1]) != 16 or not _HEX_BYTES.fullmatch(node[1]):
            _corrupt(f"malformed float {node!r:.80}")
        value: float = _DOUBLE.unpack(bytes.fromhex(node[1]))[0]
        return value

    def dec_bigint(self, node: list[Any], depth: int) -> int:
        if len(node) != 2 or type(node[1]) is not str or not _HEX_INT.fullmatch(node[1]):
            _corrupt(f"malformed int {node!r:.80}")
        return int(node[1], 16)

    def dec_list(self, node: list[Any], depth: int) -> list[Any]:
        return [self.dec(item, depth + 1) for item in node[1:]]

    def dec_tuple(self, node: list[Any], depth: int) -> tuple[Any, ...]:
        return tuple([self.dec(item, depth + 1) for item in node[1:]])

    def fill_pairs(self, out: dict[Any, Any], node: list[Any], start: int, depth: int) -> None:
        if (len(node) - start) % 2:
            _corrupt("dict node has a key without a value")
        dec, dec_key = self.dec, self.dec_key
        for i in range(start, len(node), 2):
            out[dec_key(node[i], depth + 1)] = dec(node[i + 1], depth + 1)

    def dec_dict(self, node: list[Any], depth: int) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        self.fill_pairs(out, node, 1, depth)
        return out

    def dec_odict(self, node: list[Any], depth: int) -> collections.OrderedDict[Any, Any]:
        out: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        if node[0] == "om":
            if len(node) < 2:
                _corrupt("OrderedDict node lacks its metadata")
            out._metadata = self.dec(node[1], depth + 1)  # type: ignore[attr-defined]
            self.fill_pairs(out, node, 2, depth)
        else:
            self.fill_pairs(out, node, 1, depth)
        return out

    def dec_set(self, node: list[Any], depth: int) -> set[Any] | frozenset[Any]:
        items = [self.dec_key(item, depth + 1) for item in node[1:]]
        return set(items) if node[0] == "s" else frozenset(items)

    def dec_size(self, node: list[Any], depth: int) -> torch.Size:
        dims = node[1:]
        if not all(type(d) is int for d in dims):
            _corrupt(f"malformed torch.Size {node!r:.80}")
        return torch.Size(dims)

    def dec_dtype(self, node: list[Any], depth: int) -> torch.dtype:
        dtype = _TORCH_DTYPES.get(node[1]) if len(node) == 2 and type(node[1]) is str else None
        if dtype is None:
            _corrupt(f"unknown torch dtype {node!r:.80}")
        return dtype

    def dec_device(self, node: list[Any], depth: int) -> torch.device:
        if len(node) != 2 or type(node[1]) is not str or len(node[1]) > 64:
            _corrupt(f"malformed torch.device {node!r:.80}")
        try:
            return torch.device(node[1])
        except RuntimeError as exc:
            raise CorruptShardError(f"invalid torch.device {node[1]!r}: {exc}") from None

    def dec_np_dtype(self, node: list[Any], depth: int) -> np.dtype[Any]:
        if len(node) != 2:
            _corrupt(f"malformed numpy dtype {node!r:.80}")
        return _np_dtype_from_desc(node[1])

    def dec_np_scalar(self, node: list[Any], depth: int) -> np.generic:
        if len(node) != 3 or type(node[2]) is not str or not _HEX_BYTES.fullmatch(node[2]):
            _corrupt(f"malformed numpy scalar {node!r:.80}")
        dtype = _np_dtype_from_desc(node[1])
        data = bytes.fromhex(node[2])
        if len(data) != dtype.itemsize:
            _corrupt(f"numpy scalar of dtype {dtype} needs {dtype.itemsize} bytes, got {len(data)}")
        holder = np.empty((), dtype=dtype)
        if data:
            holder.reshape(-1).view(np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)
        return cast(np.generic, holder[()])

    # -- blobs ------------------------------------------------------------------------

    _KINDS: Final = {"T": _BLOB_TENSOR, "N": _BLOB_NDARRAY, "b": _BLOB_BYTES, "B": _BLOB_BYTEARRAY}

    def dec_blob(self, node: list[Any], depth: int) -> Any:
        if len(node) != 2 or type(node[1]) is not int or not 0 <= node[1] < len(self.specs):
            _corrupt(f"blob reference {node!r:.80} is out of range")
        index: int = node[1]
        spec = self.specs[index]
        if spec.kind != self._KINDS[node[0]]:
            _corrupt(f"tree node {node[0]!r} refers to blob #{index} of kind {spec.kind!r}")
        obj = self.objects.get(index)
        if obj is None:
            obj = self.materialize(spec)
            self.objects[index] = obj
        return obj

    def shared_view(self, spec: _BlobSpec) -> Any:
        """A tensor/array aliasing the shared buffer, or None where a copy is needed (odd dtypes)."""
        start, end = spec.offset, spec.offset + spec.nbytes
        if spec.kind == _BLOB_NDARRAY:
            return np.frombuffer(self.share, dtype=spec.dtype, count=spec.nbytes // spec.dtype.itemsize, offset=start).reshape(spec.shape)  # type: ignore[call-overload]
        if _needs_raw_copy(spec.dtype):
            return None
        if self.share_base is None:
            self.share_base = torch.frombuffer(self.share, dtype=torch.uint8)  # type: ignore[call-overload]
        tensor = self.share_base[start:end].view(spec.dtype).view(spec.shape)
        if spec.parameter:
            return torch.nn.Parameter(tensor, requires_grad=spec.requires_grad)
        if spec.requires_grad:
            tensor.requires_grad_(True)
        return tensor

    def materialize(self, spec: _BlobSpec) -> Any:
        start, end = spec.offset, spec.offset + spec.nbytes
        if self.share is not None and spec.nbytes > _SMALL_COPY and spec.kind in (_BLOB_TENSOR, _BLOB_NDARRAY):
            shared = self.shared_view(spec)
            if shared is not None:
                return shared
        if spec.kind == _BLOB_TENSOR:
            tensor = torch.empty(spec.shape, dtype=spec.dtype)
            if spec.nbytes:
                if self.base is None:
                    with warnings.catch_warnings():
                        # torch warns that read-only buffers (bytes, read-only mmap) give
                        # tensors it cannot protect; this alias is only ever read from.
                        warnings.simplefilter("ignore", UserWarning)
                        self.base = torch.frombuffer(self.mv, dtype=torch.uint8)
                        self.base_addr = self.base.data_ptr()
                if spec.nbytes <= _SMALL_COPY:
                    # Fresh contiguous tensor of exactly nbytes; the source range was
                    # bounds-checked against the buffer by _read_header.
                    ctypes.memmove(tensor.data_ptr(), self.base_addr + start, spec.nbytes)
                else:
                    tensor.reshape(-1).view(torch.uint8).copy_(self.base[start:end])
            if spec.parameter:
                return torch.nn.Parameter(tensor, requires_grad=spec.requires_grad)
            if spec.requires_grad:
                tensor.requires_grad_(True)
            return tensor
        if spec.kind == _BLOB_NDARRAY:
            array = np.empty(spec.shape, dtype=spec.dtype)
            if spec.nbytes:
                if self.np_base is None:
                    self.np_base = np.frombuffer(self.mv, dtype=np.uint8)
                array.reshape(-1).view(np.uint8)[:] = self.np_base[start:end]
            return array
        data = self.mv[start:end]
        try:
            return bytes(data) if spec.kind == _BLOB_BYTES else bytearray(data)
        finally:
            data.release()


def decode(buf: Buffer, *, zero_copy: bool = False) -> object:
    """Rebuild the state from shard bytes without executing anything from them.

    ``buf`` may be bytes, bytearray, memoryview or mmap, read-only included, and may be
    longer than the shard. By default every tensor, array and bytes object is copied out, so
    the caller may release or overwrite ``buf`` afterwards.

    ``zero_copy=True`` (``buf`` must be writable and must never change afterwards, e.g. a
    private copy-on-write file mapping) makes large tensors and arrays views of ``buf``
    instead: no copy and no page faults for fresh memory. The views keep ``buf`` alive.
    Any inconsistency raises :class:`CorruptShardError`; a non-buffer argument raises TypeError.
    """
    mv = _as_byte_view(buf)
    if zero_copy and mv.readonly:
        mv.release()
        raise TypeError("decode(zero_copy=True) needs a writable buffer (e.g. an mmap with MAP_PRIVATE)")
    decoder: _Decoder | None = None
    try:
        try:
            with _GcPaused():
                header, specs = _read_header(mv)
                decoder = _Decoder(mv, specs, share=buf if zero_copy else None)
                return decoder.dec(header["root"], 0)
        except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError,
                RuntimeError, struct.error) as exc:
            # Validation above should catch every inconsistency explicitly; this keeps the
            # promise that corrupt input only ever raises CorruptShardError.
            raise CorruptShardError(f"malformed shard: {type(exc).__name__}: {exc}") from None
    finally:
        if decoder is not None:
            decoder.close()
        mv.release()


def peek_header(buf: Buffer) -> dict[str, Any]:
    """Parse and validate the prelude and JSON header only; blobs are not touched."""
    mv = _as_byte_view(buf)
    try:
        try:
            with _GcPaused():
                header, _ = _read_header(mv)
        except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError,
                struct.error) as exc:
            raise CorruptShardError(f"malformed shard header: {type(exc).__name__}: {exc}") from None
        return header
    finally:
        mv.release()
