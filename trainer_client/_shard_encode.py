"""Encoding side of the safe shard format: :func:`plan`, :class:`ShardLayout` and :func:`encode`.

Re-exported by :mod:`trainer_client.serialization`, which documents the format.

Built for states of tens of thousands of small tensors (optimizer states of MoE models),
where per-tensor Python work, not bytes, used to dominate a save:

* the walk only collects tensors; their metadata is then read for all of them at once
  with ``map`` over C-level getters, checked with list counts, and looked up in a table
  of the distinct (dtype, shape, flags) seen, so a state of 10k alike tensors validates
  and describes a handful of :class:`_Kind` objects, not 10k records;
* the header lists each distinct blob record once plus one small int per blob (format
  version 2), rendered with one ``str.join``;
* the writer re-checks every source and copies the small CPU tensors with one
  ``map(ctypes.memmove, ...)``, again without Python bytecode per tensor.
"""

from __future__ import annotations

import collections
import ctypes
import json
import operator
from itertools import accumulate, compress, repeat
from operator import attrgetter
from typing import Any, Final, NoReturn, cast

import numpy as np
import torch
from numpy.lib.stride_tricks import as_strided

from trainer_client._blob_writer import _BlobWriter, _changed
from trainer_client._shard_format import (
    _ALIGN_MASK,
    _BLOB_BYTEARRAY,
    _BLOB_BYTES,
    _BLOB_NDARRAY,
    _BLOB_TENSOR,
    _BYTEORDER,
    _DOUBLE,
    _HINT,
    _INT64_MIN,
    _PRELUDE,
    _PRELUDE_SIZE,
    _SMALL_COPY,
    _TENSOR_DTYPE_NAMES,
    _TORCH_DTYPE_NAMES,
    _UINT64_END,
    _ZEROS,
    FORMAT_VERSION,
    MAGIC,
    MAX_DEPTH,
    Buffer,
    _align,
    _as_byte_view,
    _GcPaused,
    _np_dtype_desc,
    _parallel_memmove,
)
from trainer_client.errors import InvalidArgumentError, SerializationError

# A path is a linked list of segments, rendered only when an error needs it.
_Path = tuple[Any, str, object] | None

_STRIDED: Final = torch.strided
_PARAMETER: Final = torch.nn.Parameter
_TENSOR: Final = torch.Tensor

# C-level getters, mapped over all tensors of a state at once. Methods as their
# descriptors: about twice as fast as operator.methodcaller.
_LAYOUT: Final = attrgetter("layout")
_IS_NESTED: Final = attrgetter("is_nested")
_IS_CPU: Final = attrgetter("is_cpu")
_DTYPE: Final = attrgetter("dtype")
_SHAPE: Final = attrgetter("shape")
_REQUIRES_GRAD: Final = attrgetter("requires_grad")
_IS_NEG: Final = torch.Tensor.is_neg
_IS_CONJ: Final = torch.Tensor.is_conj
_IS_COMPLEX: Final = attrgetter("is_complex")
_IS_CONTIGUOUS: Final = torch.Tensor.is_contiguous
_DATA_PTR: Final = torch.Tensor.data_ptr


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


def _json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


# The tree the walk builds has no cycles (the walk refuses them), so the encoder need not
# track the containers it is in: ~15% faster on a 10k-tensor tree.
_encode_tree: Final = json.JSONEncoder(separators=(",", ":"), allow_nan=False, check_circular=False).encode


class _Kind:
    """What the header and the writer need to know about a blob, shared by alike blobs.

    One per distinct tensor (dtype, shape, requires_grad, Parameter, device) of a state,
    one per array or bytes object. Hashed by identity. ``record`` is the blob's entry in
    the header's ``kinds`` table; ``slot`` its size rounded up to :data:`ALIGNMENT` and
    ``gap`` the zero padding after it. ``memmove``: the blob is a non-empty CPU tensor of
    at most ``_SMALL_COPY`` bytes, copied with one memmove; a conj/neg view of such a
    tensor takes ``slow`` instead (same record, torch's ``copy_`` resolves the bit).
    """

    __slots__ = ("dtype", "gap", "is_complex", "kind", "memmove", "nbytes", "record", "shape", "slot", "slow")

    def __init__(self, kind: str, nbytes: int, dtype: Any, shape: tuple[int, ...], record: dict[str, Any],
                 memmove: bool = False) -> None:
        self.kind = kind
        self.nbytes = nbytes
        self.dtype = dtype
        self.shape = shape
        self.slot = (nbytes + _ALIGN_MASK) & ~_ALIGN_MASK
        self.gap = self.slot - nbytes
        self.record = _json(record)
        self.memmove = memmove
        self.is_complex = kind == _BLOB_TENSOR and dtype.is_complex
        self.slow = self
        if memmove:
            self.slow = _Kind(kind, nbytes, dtype, shape, record)


_K_SLOT: Final = attrgetter("slot")
_K_GAP: Final = attrgetter("gap")
_K_NBYTES: Final = attrgetter("nbytes")
_K_DTYPE: Final = attrgetter("dtype")
_K_SHAPE: Final = attrgetter("shape")
_K_MEMMOVE: Final = attrgetter("memmove")


class _Planner:
    """Walks the state once, validating values and listing blobs (no data copies).

    Per blob, in blob-index order: its source object (``srcs``) and where the walk met it
    (``paths``, for error messages). Arrays and bytes get their :class:`_Kind` right away
    (``other_kinds``); tensors are described all at once by :meth:`finish_tensors`, which
    fills in ``kinds`` (and, for the common case, ``dtypes`` and ``shapes`` of the tensors).
    """

    def __init__(self) -> None:
        self.srcs: list[Any] = []
        self.paths: list[_Path] = []
        self.other_kinds: dict[int, _Kind] = {}  # blob index -> kind, for blobs that are no tensors
        self.kinds: list[_Kind] = []
        self.dtypes: list[torch.dtype] | None = None
        self.shapes: list[torch.Size] | None = None
        self.memo: dict[int, int] = {}  # id(blob source) -> blob index
        self.active: set[int] = set()  # ids of the containers on the current path
        # (dtype, shape, requires_grad, type[, device if not CPU]) -> _Kind
        self.tensor_kinds: dict[tuple[Any, ...], _Kind] = {}
        self.shape_kinds: dict[Any, dict[Any, _Kind]] = {}  # dtype -> shape -> _Kind of plain CPU tensors

    def fail(self, message: str, path: _Path) -> NoReturn:
        raise SerializationError(message, _render_path(path))

    def unsupported(self, value: object, path: _Path, extra: str = "") -> NoReturn:
        self.fail(f"unsupported type {_type_name(value)}{extra}; {_HINT}", path)

    def add_blob(self, src: Any, path: _Path) -> int:
        srcs = self.srcs
        index = self.memo[id(src)] = len(srcs)
        srcs.append(src)
        self.paths.append(path)
        return index

    def add_tensor(self, v: torch.Tensor, path: _Path) -> int:
        index = self.memo.get(id(v))
        return self.add_blob(v, path) if index is None else index

    # -- values ----------------------------------------------------------------------

    def enc(self, v: object, path: _Path, depth: int) -> Any:
        t = type(v)
        if t is str or v is None or t is bool:
            return v
        if t is int:
            return v if _INT64_MIN <= v < _UINT64_END else ["i", format(v, "x")]  # type: ignore[operator]
        if t is _TENSOR or t is _PARAMETER:
            return ["T", self.add_tensor(v, path)]  # type: ignore[arg-type]
        if t is dict or t is collections.OrderedDict:
            return self.enc_dict(v, path, depth)  # type: ignore[arg-type]
        if t is float:
            return ["f", _DOUBLE.pack(v).hex()]
        if t is list or t is tuple:
            return self.enc_seq("l" if t is list else "t", v, path, depth)  # type: ignore[arg-type]
        return self.enc_rare(v, t, path, depth)

    def enc_rare(self, v: object, t: type, path: _Path, depth: int) -> Any:
        """The value types less common than those :meth:`enc` checks first (same order as before)."""
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
        return self.enc_subclassed(v, t, path)

    def enc_subclassed(self, v: object, t: type, path: _Path) -> Any:
        """numpy scalars and dtypes (checked with isinstance), else a precise unsupported-type error."""
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
        # self.enter(), inlined
        if depth >= MAX_DEPTH:
            self.fail(f"nesting deeper than {MAX_DEPTH} levels", path)
        vid = id(v)
        active = self.active
        if vid in active:
            self.fail(f"reference cycle: this {_type_name(v)} contains itself", path)
        active.add(vid)
        out: list[Any]
        if type(v) is dict:
            out = ["d"]
        else:
            attrs = v.__dict__ if hasattr(v, "__dict__") else {}
            out = ["o"]
            if "_metadata" in attrs:
                out = ["om", self.enc(attrs["_metadata"], (path, "attr", "._metadata"), depth + 1)]
        append = out.append
        enc, enc_key, enc_dict = self.enc, self.enc_key, self.enc_dict
        memo, srcs, paths = self.memo, self.srcs, self.paths
        child_depth = depth + 1
        # The common cases (str / 64-bit int keys; plain tensor and dict values) inline, with
        # exactly the outcome of enc_key / enc (and add_tensor).
        for key, value in v.items():
            child: _Path = (path, "key", key)
            tk = type(key)
            if tk is str or (tk is int and _INT64_MIN <= key < _UINT64_END):
                append(key)
            else:
                append(enc_key(key, child, child_depth))
            tv = type(value)
            if tv is _TENSOR:
                tid = id(value)
                index = memo.get(tid)
                if index is None:
                    index = memo[tid] = len(srcs)
                    srcs.append(value)
                    paths.append(child)
                append(["T", index])
            elif tv is dict:
                append(enc_dict(value, child, child_depth))
            else:
                append(enc(value, child, child_depth))
        active.discard(vid)
        return out

    def enc_seq(self, tag: str, v: list[Any] | tuple[Any, ...], path: _Path, depth: int) -> list[Any]:
        vid = self.enter(v, path, depth)
        out: list[Any] = [tag]
        append = out.append
        enc, add_tensor = self.enc, self.add_tensor
        child_depth = depth + 1
        for i, item in enumerate(v):
            if type(item) is _TENSOR:
                append(["T", add_tensor(item, (path, "index", i))])
            else:
                append(enc(item, (path, "index", i), child_depth))
        self.active.discard(vid)
        return out

    def enc_set(self, v: set[Any] | frozenset[Any], path: _Path, depth: int) -> list[Any]:
        if depth >= MAX_DEPTH:
            self.fail(f"nesting deeper than {MAX_DEPTH} levels", path)
        out: list[Any] = ["s" if type(v) is set else "F"]
        for item in v:
            out.append(self.enc_key(item, (path, "attr", f"{{{_short_repr(item)}}}"), depth + 1))
        return out

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
        record = {"kind": _BLOB_NDARRAY, "nbytes": nbytes, "dtype": desc, "shape": list(shape)}
        index = self.add_blob(v, path)
        self.other_kinds[index] = _Kind(_BLOB_NDARRAY, nbytes, v.dtype, shape, record)
        return index

    def enc_bytes(self, v: bytes | bytearray) -> int:
        index = self.memo.get(id(v))
        if index is not None:
            return index
        kind = _BLOB_BYTES if type(v) is bytes else _BLOB_BYTEARRAY
        index = self.add_blob(v, None)
        self.other_kinds[index] = _Kind(kind, len(v), None, (len(v),), {"kind": kind, "nbytes": len(v)})
        return index

    def enc_np_scalar(self, v: np.generic, path: _Path) -> list[Any]:
        # Via a 0-d array: np.str_("") has itemsize-0 dtype "<U0" yet 4 bytes of data;
        # its array form ("<U1") describes the bytes exactly and indexes back to np.str_.
        arr = np.asarray(v)
        try:
            desc = _np_dtype_desc(arr.dtype)
        except ValueError as exc:
            self.fail(f"{exc}; {_HINT}", path)
        return ["n", desc, arr.tobytes().hex()]

    # -- tensors, all at once ---------------------------------------------------------------

    def finish_tensors(self) -> None:
        """Fill in ``kinds``: describe every tensor; raise for the first one that cannot be stored."""
        srcs, paths, others = self.srcs, self.paths, self.other_kinds
        if others:
            is_tensor = [index not in others for index in range(len(srcs))]
            tensors, paths = list(compress(srcs, is_tensor)), list(compress(paths, is_tensor))
        else:
            tensors = srcs
        kinds = self.plain_tensor_kinds(tensors, paths) if tensors else []
        if kinds is None:
            kinds = list(map(self.tensor_kind, tensors, paths))
        if others:
            made = iter(kinds)
            kinds = [others[index] if index in others else next(made) for index in range(len(srcs))]
        self.kinds = kinds

    def plain_tensor_kinds(self, tensors: list[torch.Tensor], paths: list[_Path]) -> list[_Kind] | None:
        """Kinds of ``tensors`` if all are dense CPU tensors, found with C-level maps; else None.

        Getters mapped over the list, checked by counting: no Python bytecode runs per tensor.
        """
        n = len(tensors)
        if (
            list(map(_LAYOUT, tensors)).count(_STRIDED) != n
            or list(map(_IS_NESTED, tensors)).count(False) != n
            or list(map(_IS_CPU, tensors)).count(True) != n  # CPU: not meta either
        ):
            return None
        dtypes = list(map(_DTYPE, tensors))
        shapes = list(map(_SHAPE, tensors))
        dtype = dtypes[0]
        # One dtype and no flags (the common case): the shape alone is the key.
        plain = (
            dtypes.count(dtype) == n
            and list(map(_REQUIRES_GRAD, tensors)).count(False) == n
            and list(map(type, tensors)).count(_TENSOR) == n
        )
        keys: list[Any]
        if plain:
            keys, known = shapes, self.shape_kinds.setdefault(dtype, {})
        else:
            keys = list(zip(dtypes, shapes, map(_REQUIRES_GRAD, tensors), map(type, tensors), strict=True))
            known = self.tensor_kinds
        found = list(map(known.get, keys))
        if None in found:
            # New keys, each in order of its first tensor: the first one that fails raises for
            # the first tensor that cannot be stored.
            for key in dict.fromkeys(compress(keys, map(operator.is_, found, repeat(None)))):
                first = keys.index(key)
                full_key = (dtype, key, False, _TENSOR) if plain else key
                known[key] = self.tensor_kinds.get(full_key) or self.new_tensor_kind(tensors[first], full_key, paths[first])
            found = list(map(known.get, keys))
        kinds = cast(list[_Kind], found)
        self.dtypes, self.shapes = dtypes, shapes
        negs = list(map(_IS_NEG, tensors))
        if True in negs:
            kinds = [kind.slow if neg else kind for kind, neg in zip(kinds, negs, strict=True)]
        if any(kind.is_complex for kind in known.values()):
            kinds = [
                kind.slow if kind.is_complex and t.is_conj() else kind for kind, t in zip(kinds, tensors, strict=True)
            ]
        return kinds

    def reject_tensor(self, v: torch.Tensor, path: _Path) -> NoReturn:
        """Raise the error for a tensor that cannot be stored (checks in their documented order)."""
        if v.layout is not torch.strided:
            self.unsupported(v, path, f" with layout {v.layout} (only dense tensors; call .to_dense())")
        if v.is_quantized:
            self.unsupported(v, path, " (quantized tensor; dequantize it or store int_repr() and scales)")
        if v.is_nested:
            self.unsupported(v, path, " (nested tensor; store its components with .unbind())")
        if v.is_meta:
            self.unsupported(v, path, " on the meta device (it has no data)")
        self.unsupported(v, path, f" with dtype {v.dtype}")

    def tensor_kind(self, v: torch.Tensor, path: _Path) -> _Kind:
        """The kind of one tensor, any device (the careful path of :meth:`finish_tensors`)."""
        if v.layout is not _STRIDED or v.is_nested:
            self.reject_tensor(v, path)
        is_cpu = v.is_cpu
        if not is_cpu and v.is_meta:
            self.reject_tensor(v, path)
        key: tuple[Any, ...] = (v.dtype, v.shape, v.requires_grad, type(v))
        if not is_cpu:
            key += (str(v.device),)
        kind = self.tensor_kinds.get(key)
        if kind is None:
            kind = self.new_tensor_kind(v, key, path)
        if v.is_neg() or (kind.is_complex and v.is_conj()):
            return kind.slow
        return kind

    def new_tensor_kind(self, v: torch.Tensor, key: tuple[Any, ...], path: _Path) -> _Kind:
        """The kind shared by every tensor with this ``key`` (first met: ``v`` at ``path``)."""
        dtype, shape, requires_grad, cls = key[:4]
        device = key[4] if len(key) > 4 else None
        name = _TENSOR_DTYPE_NAMES.get(dtype)
        if name is None:  # quantized dtypes are left out of the table
            self.reject_tensor(v, path)
        nbytes = v.numel() * v.element_size()
        # Keys that hold their default (False / "cpu") are left out to keep headers small.
        record: dict[str, Any] = {"kind": _BLOB_TENSOR, "nbytes": nbytes, "dtype": name, "shape": list(shape)}
        if requires_grad:
            record["requires_grad"] = True
        if cls is _PARAMETER:
            record["parameter"] = True
        if device is not None:
            record["device"] = device
        kind = _Kind(_BLOB_TENSOR, nbytes, dtype, shape, record, memmove=device is None and 0 < nbytes <= _SMALL_COPY)
        self.tensor_kinds[key] = kind
        return kind


# --------------------------------------------------------------------------------------
# header
# --------------------------------------------------------------------------------------


def _ndigits(n: int) -> int:
    return len(str(n))


def _render_header(kinds: list[_Kind], data_len: int, root_json: str) -> tuple[bytes, int]:
    """The header JSON and the data offset it implies.

    What ``json.dumps(header, separators=(",", ":"))`` gives for ``{"version", "byteorder",
    "nbytes", "data_offset", "kinds": [distinct records], "blobs": [kind index per blob],
    "root"}``, assembled in one join (every megabyte-sized temporary string costs its page
    faults again). Its length depends on the digits of the data offset, which depends on
    its length: the fixed point is found first.
    """
    table: dict[str, str] = {}  # distinct records in order of first use -> their index in "kinds"
    index_of = {kind: table.setdefault(kind.record, str(len(table))) for kind in dict.fromkeys(kinds)}
    parts = [
        '{"version":' + _json(FORMAT_VERSION) + ',"byteorder":' + _json(_BYTEORDER) + ',"nbytes":',
        "",  # nbytes
        ',"data_offset":',
        "",  # data_offset
        ',"kinds":[',
        ",".join(table),
        '],"blobs":[',
        ",".join(map(index_of.__getitem__, kinds)),
        '],"root":',
        root_json,
        "}",
    ]
    fixed = sum(map(len, parts))
    data_offset = _align(_PRELUDE_SIZE + fixed)
    while True:
        length = fixed + _ndigits(data_offset + data_len) + _ndigits(data_offset)
        needed = _align(_PRELUDE_SIZE + length)
        if needed <= data_offset:  # length grows with data_offset: this is the fixed point
            break
        data_offset = needed
    parts[1], parts[3] = str(data_offset + data_len), str(data_offset)
    text = "".join(parts)
    if len(text) != length:  # the arithmetic above is exact
        raise AssertionError("shard header length disagrees with its planned data offset")
    return text.encode("ascii"), data_offset


# --------------------------------------------------------------------------------------
# layout and writer
# --------------------------------------------------------------------------------------


class ShardLayout:
    """The planned encoding of one state: header bytes plus where each blob goes.

    Holds references to the state's tensors/arrays (not copies); the state must not be
    mutated between :func:`plan` and :meth:`write_into`.
    """

    __slots__ = ("_header", "_kinds", "_moved", "_moved_dtypes", "_moved_nbytes", "_moved_rels", "_moved_shapes",
                 "_offsets", "_others", "_padding", "_srcs", "data_offset", "nbytes", "num_tensors")  # fmt: skip

    def __init__(self, header: bytes, data_offset: int, data_len: int, planner: _Planner, offsets: list[int]) -> None:
        srcs, kinds = planner.srcs, planner.kinds
        self._header = header
        self._srcs = srcs
        self._kinds = kinds
        self._offsets = offsets  # relative to data_offset; one more than blobs
        self.data_offset = data_offset
        self.nbytes = data_offset + data_len
        self.num_tensors = len(srcs)
        # The memmove path: small CPU tensors, with what write_into re-checks them against.
        count = len(srcs)
        flags = list(map(_K_MEMMOVE, kinds))
        if flags.count(True) == count:
            moved, moved_kinds, rels, self._others = srcs, kinds, offsets[:count], []
        else:
            moved = list(compress(srcs, flags))
            moved_kinds = list(compress(kinds, flags))
            rels = list(compress(offsets, flags))
            self._others = list(compress(range(count), map(operator.not_, flags)))
        self._moved = moved
        self._moved_rels = rels
        self._moved_nbytes = list(map(_K_NBYTES, moved_kinds))
        if moved is srcs and planner.dtypes is not None and planner.shapes is not None:
            self._moved_dtypes, self._moved_shapes = planner.dtypes, planner.shapes  # read by plan()
        else:
            self._moved_dtypes = list(map(_K_DTYPE, moved_kinds))
            self._moved_shapes = list(map(_K_SHAPE, moved_kinds))
        self._padding = _padding(kinds, offsets)

    def __repr__(self) -> str:
        return (
            f"ShardLayout(nbytes={self.nbytes}, num_tensors={self.num_tensors}, "
            f"header_bytes={len(self._header)})"
        )

    def device_tensors(self) -> list[int]:
        """Indices of the blobs that are CUDA tensors: the slots a device copy fills instead (``write_into(skip=...)``).
        Found without looking at every tensor: small CPU tensors take the memmove path, CUDA tensors never do."""
        srcs, kinds = self._srcs, self._kinds
        return [i for i in self._others if kinds[i].kind == _BLOB_TENSOR and srcs[i].is_cuda]

    def slot(self, index: int) -> tuple[Any, int, int]:
        """Blob ``index``'s source, its slot's offset in the shard and its length; raises SerializationError if a
        tensor changed dtype or shape since :func:`plan`."""
        src, kind = self._srcs[index], self._kinds[index]
        if kind.kind == _BLOB_TENSOR and (src.dtype != kind.dtype or src.shape != kind.shape):
            _changed("tensor", index)
        return src, self.data_offset + self._offsets[index], kind.nbytes

    def write_into(self, buf: Buffer, skip: frozenset[int] = frozenset()) -> None:
        """Write the shard into ``buf[:nbytes]``: header, then every blob into its slot.

        ``buf`` must be a writable, C-contiguous buffer (bytearray, writable mmap,
        memoryview, ...) at least :attr:`nbytes` long. Padding is zeroed so identical
        states give identical bytes even in a reused buffer. Contiguous CPU tensors are
        copied with memmove (big ones in pieces on a few threads); others with
        ``Tensor.copy_`` straight from the (possibly strided, possibly non-CPU) source
        into a view of ``buf``, which needs no temporary. The slots of the blobs in ``skip`` are left as they
        are (``device_tensors()``: asynchronous device copies fill them).
        """
        mv = _as_byte_view(buf)
        # Everything aliasing ``mv`` (the writer's uint8 tensor) must be dropped before
        # mv.release() in ``finally``.
        writer = _BlobWriter(mv, self.nbytes)
        try:
            if mv.readonly:
                raise InvalidArgumentError("write_into needs a writable buffer; got a read-only one")
            if len(mv) < self.nbytes:
                raise InvalidArgumentError(
                    f"buffer holds {len(mv)} bytes but the shard needs {self.nbytes}"
                )
            header = self._header
            header_end = _PRELUDE_SIZE + len(header)
            data_offset = self.data_offset
            _PRELUDE.pack_into(mv, 0, MAGIC, FORMAT_VERSION, len(header))
            mv[_PRELUDE_SIZE:header_end] = header
            mv[header_end:data_offset] = _ZEROS[: data_offset - header_end]
            if self._srcs:
                with torch.no_grad(), _GcPaused():  # the checks make lists of 10k Size objects
                    if not self._write_moved(writer, data_offset):
                        self._write_each(writer, data_offset, [i for i in range(len(self._srcs)) if i not in skip])
                    elif self._others:
                        self._write_each(writer, data_offset, [i for i in self._others if i not in skip] if skip else self._others)
                size = self.nbytes - data_offset
                for length, starts in self._padding:
                    # Rows of `length` bytes starting at every byte of the data area; the
                    # runs' rows are set to zero (all inside it: each run ends at a blob).
                    # No name holds the view: nothing may keep `mv` exported after an error.
                    as_strided(np.frombuffer(mv, np.uint8, size, data_offset), (size - length + 1, length), (1, 1))[starts] = 0
            _parallel_memmove(writer.moves)
        finally:
            writer.close()
            mv.release()

    def _write_moved(self, writer: _BlobWriter, data_offset: int) -> bool:
        """Copy the memmove-path tensors, unless one changed since plan(): then False, nothing written.

        Re-checked here, not trusted from plan(): dtype and shape must be unchanged, and a
        tensor moved, re-strided or given a neg/conj bit since then must not be read as n
        bytes at its data pointer. All with C-level maps, like the copies.
        """
        moved = self._moved
        if not moved:
            return True
        count = len(moved)
        if (
            list(map(_DTYPE, moved)) != self._moved_dtypes
            or list(map(_SHAPE, moved)) != self._moved_shapes
            or list(map(_IS_CPU, moved)).count(True) != count
            or list(map(_IS_CONTIGUOUS, moved)).count(True) != count
            or True in map(_IS_NEG, moved)
            or (any(map(_IS_COMPLEX, self._moved_dtypes)) and True in map(_IS_CONJ, moved))
        ):
            return False
        data = writer.base_address() + data_offset  # the slots lie inside buf (checked by write_into)
        list(map(ctypes.memmove, map(data.__add__, self._moved_rels), map(_DATA_PTR, moved), self._moved_nbytes))
        return True

    def _write_each(self, writer: _BlobWriter, data_offset: int, indices: Any) -> None:
        """Copy the given blobs one by one, each checked on its own (the general path)."""
        srcs, kinds, offsets = self._srcs, self._kinds, self._offsets
        for index in indices:
            src, kind, offset = srcs[index], kinds[index], data_offset + offsets[index]
            if kind.kind == _BLOB_TENSOR:
                writer.tensor(index, offset, kind.nbytes, src, kind.dtype, kind.shape)
            elif kind.kind == _BLOB_NDARRAY:
                writer.ndarray(index, offset, kind.nbytes, src, kind.dtype, kind.shape)
            elif kind.nbytes:
                writer.raw_bytes(index, offset, kind.nbytes, src)


def _padding(kinds: list[_Kind], offsets: list[int]) -> list[tuple[int, np.ndarray[Any, Any]]]:
    """The padding between blobs, as (length, where each run of that length starts) pairs.

    Positions are relative to the data offset. write_into zeroes each length's runs with
    one numpy assignment (rows of a strided view of the buffer), not one call per run.
    """
    gaps = list(map(_K_GAP, kinds))[:-1]  # the last blob has no padding after it
    if gaps.count(0) == len(gaps):
        return []
    present = list(map(bool, gaps))
    lengths = list(compress(gaps, present))
    starts = np.array(list(compress(map(operator.sub, offsets[1:], gaps), present)), dtype=np.int64)
    if lengths.count(lengths[0]) == len(lengths):
        return [(lengths[0], starts)]
    by_length = np.array(lengths, dtype=np.int64)
    return [(int(length), starts[by_length == length]) for length in np.unique(by_length)]


def plan(state: object) -> ShardLayout:
    """Walk ``state`` once, validate every value and compute the shard layout.

    Copies no tensor data. Raises :class:`SerializationError` naming the path (e.g.
    ``state['optim']['state'][3]['exp_avg']``) of the first value that cannot be stored
    without pickling, of a reference cycle, or of nesting deeper than :data:`MAX_DEPTH`.
    """
    with _GcPaused():
        planner = _Planner()
        try:
            try:
                root = planner.enc(state, None, 0)
            except (SerializationError, RecursionError):
                # Tensors are checked after the walk; one met before the walk failed
                # comes first.
                planner.finish_tensors()
                raise
            planner.finish_tensors()
            root_json = _encode_tree(root)
        except RecursionError:
            raise SerializationError(
                "state nests too deeply for Python's recursion limit", "state"
            ) from None
        kinds = planner.kinds
        offsets = list(accumulate(map(_K_SLOT, kinds), initial=0))  # blob i's slot starts at offsets[i]
        data_len = offsets[-2] + kinds[-1].nbytes if kinds else 0  # no padding after the last blob
        header, data_offset = _render_header(kinds, data_len, root_json)
        return ShardLayout(header, data_offset, data_len, planner, offsets)


def encode(state: object) -> bytearray:
    """Plan and write ``state`` into a fresh bytearray of exactly ``layout.nbytes`` bytes."""
    layout = plan(state)
    out = bytearray(layout.nbytes)
    layout.write_into(out)
    return out
