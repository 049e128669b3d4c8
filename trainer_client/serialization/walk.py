"""The walk of a state that plans its shard: every value validated, every blob listed, alike tensors described once.

Built for states of tens of thousands of small tensors (optimizer states of MoE models),
where per-tensor Python work, not bytes, used to dominate a save:

* the walk only collects tensors; their metadata is then read for all of them at once
  with ``map`` over C-level getters, checked with list counts, and looked up in a table
  of the distinct (dtype, shape, flags) seen, so a state of 10k alike tensors validates
  and describes a handful of :class:`Kind` objects, not 10k records;
* the header lists each distinct blob record once plus one small int per blob (format
  version 2), rendered with one ``str.join``;
* the writer re-checks every source and copies the small CPU tensors with one
  ``map(ctypes.memmove, ...)``, again without Python bytecode per tensor.

Used by :func:`trainer_client.serialization.encoder.plan`.
"""

from __future__ import annotations

import collections
import json
import operator
from itertools import compress, repeat
from operator import attrgetter
from typing import Any, Final, NoReturn, cast

import numpy as np
import torch

from trainer_client.errors import SerializationError
from trainer_client.serialization.dtypes import TENSOR_DTYPE_NAMES, TORCH_DTYPE_NAMES, np_dtype_desc
from trainer_client.serialization.header import compact_json
from trainer_client.serialization.spec import (
    ALIGN_MASK,
    BLOB_BYTEARRAY,
    BLOB_BYTES,
    BLOB_NDARRAY,
    BLOB_TENSOR,
    DOUBLE,
    INT64_MIN,
    MAX_DEPTH,
    SMALL_COPY,
    UINT64_END,
    UNSUPPORTED_HINT,
)

__all__ = [
    "DATA_PTR",
    "DTYPE_OF",
    "IS_COMPLEX",
    "IS_CONJ",
    "IS_CONTIGUOUS",
    "IS_CPU",
    "IS_NEG",
    "SHAPE_OF",
    "Kind",
    "Planner",
    "encode_tree",
]

# A path is a linked list of segments, rendered only when an error needs it.
WalkPath = tuple[Any, str, object] | None

_STRIDED: Final = torch.strided
_PARAMETER: Final = torch.nn.Parameter
_TENSOR: Final = torch.Tensor

# C-level getters, mapped over all tensors of a state at once. Methods as their
# descriptors: about twice as fast as operator.methodcaller.
_LAYOUT: Final = attrgetter("layout")
_IS_NESTED: Final = attrgetter("is_nested")
IS_CPU: Final = attrgetter("is_cpu")
DTYPE_OF: Final = attrgetter("dtype")
SHAPE_OF: Final = attrgetter("shape")
_REQUIRES_GRAD: Final = attrgetter("requires_grad")
IS_NEG: Final = torch.Tensor.is_neg
IS_CONJ: Final = torch.Tensor.is_conj
IS_COMPLEX: Final = attrgetter("is_complex")
IS_CONTIGUOUS: Final = torch.Tensor.is_contiguous
DATA_PTR: Final = torch.Tensor.data_ptr


def _short_repr(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _render_path(path: WalkPath) -> str:
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


# The tree the walk builds has no cycles (the walk refuses them), so the encoder need not
# track the containers it is in: ~15% faster on a 10k-tensor tree.
encode_tree: Final = json.JSONEncoder(separators=(",", ":"), allow_nan=False, check_circular=False).encode


class Kind:
    """What the header and the writer need to know about a blob, shared by alike blobs.

    One per distinct tensor (dtype, shape, requires_grad, Parameter, device) of a state,
    one per array or bytes object. Hashed by identity. ``record`` is the blob's entry in
    the header's ``kinds`` table; ``slot`` its size rounded up to :data:`ALIGNMENT` and
    ``gap`` the zero padding after it. ``memmove``: the blob is a non-empty CPU tensor of
    at most ``SMALL_COPY`` bytes, copied with one memmove; a conj/neg view of such a
    tensor takes ``slow`` instead (same record, torch's ``copy_`` resolves the bit).
    """

    __slots__ = ("dtype", "gap", "is_complex", "kind", "memmove", "nbytes", "record", "shape", "slot", "slow")

    def __init__(self, kind: str, nbytes: int, dtype: Any, shape: tuple[int, ...], record: dict[str, Any], memmove: bool = False) -> None:
        self.kind = kind
        self.nbytes = nbytes
        self.dtype = dtype
        self.shape = shape
        self.slot = (nbytes + ALIGN_MASK) & ~ALIGN_MASK
        self.gap = self.slot - nbytes
        self.record = compact_json(record)
        self.memmove = memmove
        self.is_complex = kind == BLOB_TENSOR and dtype.is_complex
        self.slow = self
        if memmove:
            self.slow = Kind(kind, nbytes, dtype, shape, record)


class Planner:
    """Walks the state once, validating values and listing blobs (no data copies).

    Per blob, in blob-index order: its source object (``srcs``) and where the walk met it
    (``paths``, for error messages). Arrays and bytes get their :class:`Kind` right away
    (``other_kinds``); tensors are described all at once by :meth:`finish_tensors`, which
    fills in ``kinds`` (and, for the common case, ``dtypes`` and ``shapes`` of the tensors).
    """

    def __init__(self) -> None:
        self.srcs: list[Any] = []
        self.paths: list[WalkPath] = []
        self.other_kinds: dict[int, Kind] = {}  # blob index -> kind, for blobs that are no tensors
        self.kinds: list[Kind] = []
        self.dtypes: list[torch.dtype] | None = None
        self.shapes: list[torch.Size] | None = None
        self.memo: dict[int, int] = {}  # id(blob source) -> blob index
        self.active: set[int] = set()  # ids of the containers on the current path
        # (dtype, shape, requires_grad, type[, device if not CPU]) -> Kind
        self.tensor_kinds: dict[tuple[Any, ...], Kind] = {}
        self.shape_kinds: dict[Any, dict[Any, Kind]] = {}  # dtype -> shape -> Kind of plain CPU tensors

    def fail(self, message: str, path: WalkPath) -> NoReturn:
        raise SerializationError(message, _render_path(path))

    def unsupported(self, value: object, path: WalkPath, extra: str = "") -> NoReturn:
        self.fail(f"unsupported type {_type_name(value)}{extra}; {UNSUPPORTED_HINT}", path)

    def add_blob(self, src: Any, path: WalkPath) -> int:
        srcs = self.srcs
        index = self.memo[id(src)] = len(srcs)
        srcs.append(src)
        self.paths.append(path)
        return index

    def add_tensor(self, v: torch.Tensor, path: WalkPath) -> int:
        index = self.memo.get(id(v))
        return self.add_blob(v, path) if index is None else index

    # -- values ----------------------------------------------------------------------

    def enc(self, v: object, path: WalkPath, depth: int) -> Any:
        t = type(v)
        if t is str or v is None or t is bool:
            return v
        if t is int:
            return v if INT64_MIN <= v < UINT64_END else ["i", format(v, "x")]  # type: ignore[operator]
        if t is _TENSOR or t is _PARAMETER:
            return ["T", self.add_tensor(v, path)]  # type: ignore[arg-type]
        if t is dict or t is collections.OrderedDict:
            return self.enc_dict(v, path, depth)  # type: ignore[arg-type]
        if t is float:
            return ["f", DOUBLE.pack(v).hex()]
        if t is list or t is tuple:
            return self.enc_seq("l" if t is list else "t", v, path, depth)  # type: ignore[arg-type]
        return self.enc_rare(v, t, path, depth)

    def enc_rare(self, v: object, t: type, path: WalkPath, depth: int) -> Any:
        """The value types less common than those :meth:`enc` checks first (same order as before)."""
        if t is torch.Size:
            return ["S", *v]  # type: ignore[misc]
        if t is torch.dtype:
            return ["y", TORCH_DTYPE_NAMES[v]]  # type: ignore[index]
        if t is torch.device:
            return ["v", str(v)]
        if t is np.ndarray:
            return ["N", self.enc_ndarray(v, path)]  # type: ignore[arg-type]
        if t is bytes or t is bytearray:
            return ["b" if t is bytes else "B", self.enc_bytes(v)]  # type: ignore[arg-type]
        if t is set or t is frozenset:
            return self.enc_set(v, path, depth)  # type: ignore[arg-type]
        return self.enc_subclassed(v, t, path)

    def enc_subclassed(self, v: object, t: type, path: WalkPath) -> Any:
        """numpy scalars and dtypes (checked with isinstance), else a precise unsupported-type error."""
        if isinstance(v, np.generic):
            return self.enc_np_scalar(v, path)
        if isinstance(v, np.dtype):
            try:
                return ["nd", np_dtype_desc(v)]
            except ValueError as exc:
                self.fail(str(exc), path)
        if isinstance(v, torch.Tensor):
            self.unsupported(v, path, " (tensor subclass); pass a plain tensor or nn.Parameter")
        if isinstance(v, tuple) and hasattr(t, "_fields"):
            self.unsupported(v, path, " (namedtuple); convert it with ._asdict() or tuple(...)")
        self.unsupported(v, path)

    def enc_key(self, k: object, path: WalkPath, depth: int) -> Any:
        """Dict keys / set members: hashable scalars and tuples of them."""
        t = type(k)
        if t is str or k is None or t is bool:
            return k
        if t is int:
            return k if INT64_MIN <= k < UINT64_END else ["i", format(k, "x")]  # type: ignore[operator]
        if t is float:
            return ["f", DOUBLE.pack(k).hex()]
        if t is tuple:
            if depth >= MAX_DEPTH:
                self.fail(f"nesting deeper than {MAX_DEPTH} levels", path)
            return ["t", *(self.enc_key(item, path, depth + 1) for item in k)]  # type: ignore[attr-defined]
        self.fail(
            f"unsupported dict key / set member {_short_repr(k)} of type {_type_name(k)}; "
            "keys must be str, int, float, bool, None or tuples of those",
            path,
        )

    def enter(self, v: object, path: WalkPath, depth: int) -> int:
        if depth >= MAX_DEPTH:
            self.fail(f"nesting deeper than {MAX_DEPTH} levels", path)
        vid = id(v)
        if vid in self.active:
            self.fail(f"reference cycle: this {_type_name(v)} contains itself", path)
        self.active.add(vid)
        return vid

    def enc_dict(self, v: dict[Any, Any], path: WalkPath, depth: int) -> list[Any]:
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
            child: WalkPath = (path, "key", key)
            tk = type(key)
            if tk is str or (tk is int and INT64_MIN <= key < UINT64_END):
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

    def enc_seq(self, tag: str, v: list[Any] | tuple[Any, ...], path: WalkPath, depth: int) -> list[Any]:
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

    def enc_set(self, v: set[Any] | frozenset[Any], path: WalkPath, depth: int) -> list[Any]:
        if depth >= MAX_DEPTH:
            self.fail(f"nesting deeper than {MAX_DEPTH} levels", path)
        out: list[Any] = ["s" if type(v) is set else "F"]
        for item in v:
            out.append(self.enc_key(item, (path, "attr", f"{{{_short_repr(item)}}}"), depth + 1))
        return out

    def enc_ndarray(self, v: np.ndarray[Any, Any], path: WalkPath) -> int:
        index = self.memo.get(id(v))
        if index is not None:
            return index
        try:
            desc = np_dtype_desc(v.dtype)
        except ValueError as exc:
            self.fail(f"{exc}; {UNSUPPORTED_HINT}", path)
        shape = tuple(v.shape)
        nbytes = v.size * v.dtype.itemsize
        record = {"kind": BLOB_NDARRAY, "nbytes": nbytes, "dtype": desc, "shape": list(shape)}
        index = self.add_blob(v, path)
        self.other_kinds[index] = Kind(BLOB_NDARRAY, nbytes, v.dtype, shape, record)
        return index

    def enc_bytes(self, v: bytes | bytearray) -> int:
        index = self.memo.get(id(v))
        if index is not None:
            return index
        kind = BLOB_BYTES if type(v) is bytes else BLOB_BYTEARRAY
        index = self.add_blob(v, None)
        self.other_kinds[index] = Kind(kind, len(v), None, (len(v),), {"kind": kind, "nbytes": len(v)})
        return index

    def enc_np_scalar(self, v: np.generic, path: WalkPath) -> list[Any]:
        # Via a 0-d array: np.str_("") has itemsize-0 dtype "<U0" yet 4 bytes of data;
        # its array form ("<U1") describes the bytes exactly and indexes back to np.str_.
        arr = np.asarray(v)
        try:
            desc = np_dtype_desc(arr.dtype)
        except ValueError as exc:
            self.fail(f"{exc}; {UNSUPPORTED_HINT}", path)
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

    def plain_tensor_kinds(self, tensors: list[torch.Tensor], paths: list[WalkPath]) -> list[Kind] | None:
        """Kinds of ``tensors`` if all are dense CPU tensors, found with C-level maps; else None.

        Getters mapped over the list, checked by counting: no Python bytecode runs per tensor.
        """
        n = len(tensors)
        if (
            list(map(_LAYOUT, tensors)).count(_STRIDED) != n
            or list(map(_IS_NESTED, tensors)).count(False) != n
            or list(map(IS_CPU, tensors)).count(True) != n  # CPU: not meta either
        ):
            return None
        dtypes = list(map(DTYPE_OF, tensors))
        shapes = list(map(SHAPE_OF, tensors))
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
        kinds = cast(list[Kind], found)
        self.dtypes, self.shapes = dtypes, shapes
        negs = list(map(IS_NEG, tensors))
        if True in negs:
            kinds = [kind.slow if neg else kind for kind, neg in zip(kinds, negs, strict=True)]
        if any(kind.is_complex for kind in known.values()):
            kinds = [kind.slow if kind.is_complex and t.is_conj() else kind for kind, t in zip(kinds, tensors, strict=True)]
        return kinds

    def reject_tensor(self, v: torch.Tensor, path: WalkPath) -> NoReturn:
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

    def tensor_kind(self, v: torch.Tensor, path: WalkPath) -> Kind:
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

    def new_tensor_kind(self, v: torch.Tensor, key: tuple[Any, ...], path: WalkPath) -> Kind:
        """The kind shared by every tensor with this ``key`` (first met: ``v`` at ``path``)."""
        dtype, shape, requires_grad, cls = key[:4]
        device = key[4] if len(key) > 4 else None
        name = TENSOR_DTYPE_NAMES.get(dtype)
        if name is None:  # quantized dtypes are left out of the table
            self.reject_tensor(v, path)
        nbytes = v.numel() * v.element_size()
        # Keys that hold their default (False / "cpu") are left out to keep headers small.
        record: dict[str, Any] = {"kind": BLOB_TENSOR, "nbytes": nbytes, "dtype": name, "shape": list(shape)}
        if requires_grad:
            record["requires_grad"] = True
        if cls is _PARAMETER:
            record["parameter"] = True
        if device is not None:
            record["device"] = device
        kind = Kind(BLOB_TENSOR, nbytes, dtype, shape, record, memmove=device is None and 0 < nbytes <= SMALL_COPY)
        self.tensor_kinds[key] = kind
        return kind
