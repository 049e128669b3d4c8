"""Encoding side of the safe shard format: :func:`plan`, :class:`ShardLayout` and :func:`encode`.

Re-exported by :mod:`trainer_client.serialization`, which documents the format.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn

import numpy as np
import torch

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
    _needs_raw_copy,
    _np_dtype_desc,
    _raw_byte_view,
)
from trainer_client.errors import InvalidArgumentError, SerializationError

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
            _PRELUDE.pack_into(mv, 0, MAGIC, FORMAT_VERSION, len(header))
            mv[_PRELUDE_SIZE:header_end] = header
            pos = header_end
            data_offset = self.data_offset
            with torch.no_grad():
                for index, (kind, rel, n, src, dtype, shape) in enumerate(self._blobs):
                    offset = data_offset + rel
                    if offset > pos:
                        mv[pos:offset] = _ZEROS[: offset - pos]
                    pos = offset + n
                    if kind == _BLOB_TENSOR:
                        writer.tensor(index, offset, n, src, dtype, shape)
                    elif kind == _BLOB_NDARRAY:
                        writer.ndarray(index, offset, n, src, dtype, shape)
                    elif n:
                        writer.raw_bytes(index, offset, n, src)
            _parallel_memmove(writer.moves)
        finally:
            writer.close()
            mv.release()


class _BlobWriter:
    """Copies blobs into the shard buffer for :meth:`ShardLayout.write_into`.

    Holds the only long-lived alias of the buffer (``base``, a uint8 tensor made on first
    use); the methods keep no other alias in a local, so an exception leaves nothing
    behind that would stop the caller from releasing the buffer once :meth:`close` ran.
    """

    __slots__ = ("base", "base_addr", "moves", "mv", "nbytes")

    def __init__(self, mv: memoryview, nbytes: int) -> None:
        self.mv = mv
        self.nbytes = nbytes
        self.base: torch.Tensor | None = None
        self.base_addr = 0
        self.moves: list[tuple[int, int, int]] = []  # large contiguous copies, done in parallel at the end

    def close(self) -> None:
        self.base = None

    def tensor(self, index: int, offset: int, n: int, src: Any, dtype: Any, shape: tuple[int, ...]) -> None:
        if src.dtype != dtype or src.shape != shape:
            raise SerializationError(
                "tensor changed dtype or shape between plan() and write_into()",
                f"blob #{index}",
            )
        if n == 0:
            return
        if self.base is None:
            self.base = torch.frombuffer(self.mv, dtype=torch.uint8, count=self.nbytes)
            self.base_addr = self.base.data_ptr()
        if src.is_cpu and src.is_contiguous() and not src.is_conj() and not src.is_neg():
            # Its n bytes are contiguous at data_ptr(); the slot lies inside
            # buf (checked by write_into). Small ones right away (~6x less overhead than
            # three torch ops), large ones in parallel at the end.
            if n <= _SMALL_COPY:
                ctypes.memmove(self.base_addr + offset, src.data_ptr(), n)
            else:
                self.moves.append((self.base_addr + offset, src.data_ptr(), n))
            return
        if _needs_raw_copy(dtype):
            self.base[offset : offset + n].view(*shape, src.element_size()).copy_(_raw_byte_view(src))
        else:
            self.base[offset : offset + n].view(dtype).view(shape).copy_(src)

    def ndarray(self, index: int, offset: int, n: int, src: Any, dtype: Any, shape: tuple[int, ...]) -> None:
        if src.dtype != dtype or src.shape != shape:
            raise SerializationError(
                "array changed dtype or shape between plan() and write_into()",
                f"blob #{index}",
            )
        if n == 0:
            return
        np.copyto(np.frombuffer(self.mv, dtype=np.uint8, count=n, offset=offset).view(dtype).reshape(shape), src, casting="no")

    def raw_bytes(self, index: int, offset: int, n: int, src: Any) -> None:
        if len(src) != n:
            raise SerializationError(
                "bytearray changed length between plan() and write_into()",
                f"blob #{index}",
            )
        self.mv[offset : offset + n] = src


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
