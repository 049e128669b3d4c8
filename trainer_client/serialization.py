"""Safe, fast binary format for one rank's training state (a "shard").

A shard is::

    MAGIC (8 bytes) | u32 format version | u64 header length | header JSON (utf-8)
    | zero padding to a 64-byte boundary | blobs, each starting on a 64-byte boundary

All prelude integers are little-endian. The header is plain JSON (ASCII in practice,
since ``json.dumps`` escapes everything else), parsed with :func:`json.loads` only:
decoding never runs pickle, ``torch.load``, ``eval`` or any other code path that can
execute data, because shard bytes may arrive over the network.

Header keys (format version 2, written since the compact blob table below)::

    {"version": 2, "byteorder": "little", "nbytes": <total shard size>,
     "data_offset": <offset of the first blob slot>,
     "kinds": [{"kind": "tensor" | "ndarray" | "bytes" | "bytearray", "nbytes": ..., ...}, ...],
     "blobs": [<index into "kinds">, ...],
     "root": <encoded tree>}

``kinds`` lists each distinct blob record once; ``blobs`` gives each blob (blob index =
position in the list) the index of its record. Blobs are packed in blob order: the first
at ``data_offset``, each next one at the first 64-byte boundary at or after the end of
the one before, and the last one ends exactly at ``nbytes``. A state of 10k alike
tensors thus has a header of a few records and 10k small ints, which decode validates
without a Python loop per blob (a full record per blob cost more than the tensor itself).

Format version 1, still read, has no ``kinds``: ``blobs`` lists one full record per blob,
each with its ``"offset"`` (absolute, 64-byte aligned, after the end of the blob before,
within ``nbytes``). A version-2 header may use that form too (:func:`peek_header`
returns it so).

Tensor records add ``dtype`` (torch name, e.g. ``"bfloat16"``) and ``shape``, plus, only
when they differ from the default, ``"requires_grad": true``, ``"parameter": true`` and
``"device"`` (the device the tensor lived on when saved, if not CPU; informational only).
Array records add ``dtype`` (a numpy dtype string or ``descr`` list) and ``shape``.
Bytes records add nothing.

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

import collections
import copy
import ctypes
import json
import operator
import struct
import warnings
from collections.abc import Callable
from itertools import accumulate, compress, repeat
from operator import attrgetter
from typing import Any, Final, NoReturn, cast

import numpy as np
import torch

from trainer_client._shard_encode import ShardLayout, encode, plan
from trainer_client._shard_format import (
    _ALIGN_MASK,
    _BLOB_BYTEARRAY,
    _BLOB_BYTES,
    _BLOB_NDARRAY,
    _BLOB_TENSOR,
    _BYTEORDER,
    _DOUBLE,
    _HEX_BYTES,
    _HEX_INT,
    _MAX_DIM,
    _PRELUDE,
    _PRELUDE_SIZE,
    _SMALL_COPY,
    _TENSOR_DTYPES,
    _TORCH_DTYPES,
    ALIGNMENT,
    FORMAT_VERSION,
    MAGIC,
    MAX_DEPTH,
    READABLE_VERSIONS,
    Buffer,
    _align,
    _as_byte_view,
    _GcPaused,
    _needs_raw_copy,
    _np_dtype_from_desc,
)
from trainer_client.errors import CorruptShardError

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

# --------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------


class _BlobSpec:
    """A validated blob record from the header, less its offset.

    Shared by every blob whose record differs only in the offset (a 10k-tensor optimizer
    state has a handful of distinct ones), so decode validates each distinct record once.
    """

    __slots__ = ("dtype", "kind", "nbytes", "parameter", "requires_grad", "shape", "template")

    def __init__(self, kind: str, nbytes: int) -> None:
        self.kind = kind
        self.nbytes = nbytes
        self.dtype: Any = None
        self.shape: tuple[int, ...] = ()
        self.requires_grad = False
        self.parameter = False
        # For a small non-empty tensor that is neither a Parameter nor requires grad: a
        # tensor of its dtype and shape, which torch.empty_like copies in decode's hot loop
        # (an expanded scalar, holding one element whatever the shape, where that gives
        # empty_like's result the contiguous strides of torch.empty).
        self.template: torch.Tensor | None = None


_TEMPLATE: Final = attrgetter("template")
_KIND: Final = attrgetter("kind")
_NBYTES: Final = attrgetter("nbytes")
_DATA_PTR: Final = torch.Tensor.data_ptr


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


def _read_header(mv: memoryview) -> tuple[dict[str, Any], list[int], list[_BlobSpec]]:
    """Parse and validate the prelude, header JSON and blob table of a shard.

    Returns the header, and per blob its offset and its (shared) :class:`_BlobSpec`.
    """
    size = len(mv)
    version, header_len = _read_prelude(mv, size)
    header = _parse_header_json(mv, header_len)
    data_offset, total = _check_header_fields(header, version, header_len, size)
    records = header["blobs"]
    if type(records) is not list:
        _corrupt("header 'blobs' must be a list")
    if version >= 2 and "kinds" in header:
        offsets, specs = _check_blob_table(header["kinds"], records, data_offset, total)
    else:
        offsets, specs = _check_blob_records(records, data_offset, total)
    return header, offsets, specs


def _check_blob_table(table: object, indices: list[Any], data_offset: int, total: int) -> tuple[list[int], list[_BlobSpec]]:
    """Validate the compact blob table of format version 2.

    ``table`` lists each distinct record once (a version-1 record less its offset);
    ``indices`` holds each blob's index into it. Blobs are packed: each starts at the
    first ALIGNMENT boundary at or after the end of the one before, the first at
    ``data_offset``, and the last must end exactly at ``total``. Checked with C-level
    maps, nothing per blob in Python.
    """
    if type(table) is not list:
        _corrupt("header 'kinds' must be a list")
    kinds = [_check_kind_record(record, f"kind #{index}") for index, record in enumerate(table)]
    if indices and (set(map(type, indices)) != {int} or min(indices) < 0 or max(indices) >= len(kinds)):
        _corrupt(f"header 'blobs' must hold indices into the {len(kinds)} 'kinds'")
    specs = list(map(kinds.__getitem__, indices))
    slots = [_align(kind.nbytes) for kind in kinds]
    offsets = list(accumulate(map(slots.__getitem__, indices), initial=data_offset))  # one more than blobs
    end = offsets[-2] + specs[-1].nbytes if specs else data_offset
    if end != total:
        _corrupt(f"blobs end at byte {end}, the shard at {total}")
    return offsets, specs


def _checked_spec(record: dict[str, Any], kind: object, nbytes: int, where: str) -> _BlobSpec:
    """The spec of a blob record of ``kind`` and ``nbytes``, its kind-specific fields checked."""
    spec = _BlobSpec(str(kind), nbytes)
    if kind == _BLOB_TENSOR:
        _check_tensor_record(record, spec, where)
    elif kind == _BLOB_NDARRAY:
        _check_ndarray_record(record, spec, where)
    elif kind != _BLOB_BYTES and kind != _BLOB_BYTEARRAY:
        _corrupt(f"{where}: unknown blob kind {kind!r:.40}")
    return spec


def _check_kind_record(record: object, where: str) -> _BlobSpec:
    """Validate one record of the compact table: a version-1 blob record without the offset."""
    if type(record) is not dict:
        _corrupt(f"{where}: record must be an object")
    kind = record.get("kind")
    nbytes = record.get("nbytes")
    if not _is_uint(nbytes):
        _corrupt(f"{where}: nbytes must be a non-negative int")
    assert type(nbytes) is int
    spec = _checked_spec(record, kind, nbytes, where)
    return spec


def _check_blob_records(records: list[Any], data_offset: int, total: int) -> tuple[list[int], list[_BlobSpec]]:
    """Validate every blob record (:func:`_check_blob_record`), each distinct one only once.

    The fast path takes records whose fields have the types the writer gives them; it
    checks the offset itself and looks the rest up among the records validated before,
    keyed by every field that validation reads (with types pinned: ``1 == 1.0 == True``
    would otherwise share a key). Anything else, and the first record of each key, goes
    through :func:`_check_blob_record`, so the outcome and the first error are the same.
    """
    offsets: list[int] = []
    specs: list[_BlobSpec] = []
    add_offset, add_spec = offsets.append, specs.append
    known: dict[tuple[Any, ...], _BlobSpec] = {}
    end = data_offset
    for record in records:
        if type(record) is dict:
            get = record.get
            offset = get("offset")
            nbytes = get("nbytes")
            kind = get("kind")
            name = get("dtype")
            shape = get("shape")
            if len(record) == 5:  # kind, offset, nbytes, dtype, shape: no flags
                requires_grad = parameter = False
            else:
                requires_grad = get("requires_grad", False)
                parameter = get("parameter", False)
                if type(requires_grad) is not bool or type(parameter) is not bool or type(get("device", "cpu")) is not str:
                    requires_grad = None  # off the fast path
            if (
                type(offset) is int
                and type(nbytes) is int
                and type(kind) is str
                and type(name) is str
                and type(shape) is list
                and requires_grad is not None
                and end <= offset
                and not offset & _ALIGN_MASK
                and 0 <= nbytes <= total - offset
            ):
                for d in shape:
                    if type(d) is not int:
                        break
                else:
                    key = (kind, name, nbytes, requires_grad, parameter, *shape)
                    spec = known.get(key)
                    if spec is not None:
                        add_offset(offset)
                        add_spec(spec)
                        end = offset + nbytes
                        continue
        offset, spec = _check_blob_record(record, f"blob #{len(specs)}", end, total)
        if type(record) is dict and spec.kind in (_BLOB_TENSOR, _BLOB_NDARRAY):
            get = record.get
            name = get("dtype")
            requires_grad, parameter = get("requires_grad", False), get("parameter", False)
            if type(name) is str and type(requires_grad) is bool and type(parameter) is bool:
                known.setdefault((spec.kind, name, spec.nbytes, requires_grad, parameter, *spec.shape), spec)
        add_offset(offset)
        add_spec(spec)
        end = offset + spec.nbytes
    return offsets, specs


def _read_prelude(mv: memoryview, size: int) -> tuple[int, int]:
    """Check the fixed-size prelude; returns (format version, header length)."""
    if size < _PRELUDE_SIZE:
        _corrupt(f"buffer is {size} bytes, shorter than the {_PRELUDE_SIZE}-byte shard prelude")
    magic, version, header_len = _PRELUDE.unpack_from(mv, 0)
    if magic != MAGIC:
        _corrupt(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}: not a memstore shard")
    if version not in READABLE_VERSIONS:
        _corrupt(f"shard format version {version}, this reader understands versions {list(READABLE_VERSIONS)}")
    if header_len > size - _PRELUDE_SIZE:
        _corrupt(
            f"header length {header_len} runs past the end of the {size}-byte buffer (truncated?)"
        )
    return version, header_len


def _parse_header_json(mv: memoryview, header_len: int) -> dict[str, Any]:
    """The header as a JSON object holding every required key (values not checked yet)."""
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
    return header


def _check_header_fields(header: dict[str, Any], version: int, header_len: int, size: int) -> tuple[int, int]:
    """Check version, byte order and sizes against the prelude; returns (data_offset, total)."""
    if header["version"] != version or type(header["version"]) is not int:
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
    return data_offset, total


def _check_blob_record(record: object, where: str, end: int, total: int) -> tuple[int, _BlobSpec]:
    """Validate one blob record: its slot must follow ``end`` (the previous blob's end) within ``total``."""
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
    spec = _checked_spec(record, kind, nbytes, where)
    return offset, spec


def _check_tensor_record(record: dict[str, Any], spec: _BlobSpec, where: str) -> None:
    """Validate a tensor record's dtype, shape and flags; fills them into ``spec``."""
    nbytes = spec.nbytes
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
    if not requires_grad and not parameter and 0 < nbytes <= _SMALL_COPY:
        scalar = torch.empty((), dtype=dtype)
        template = scalar.expand(shape) if numel > 1 else scalar.reshape(shape)
        if not torch.empty_like(template).is_contiguous():  # not so far; a real one would do
            template = torch.empty(size=shape, dtype=dtype)
        spec.template = template


def _check_ndarray_record(record: dict[str, Any], spec: _BlobSpec, where: str) -> None:
    """Validate an array record's dtype and shape; fills them into ``spec``."""
    nbytes = spec.nbytes
    np_dtype = _np_dtype_from_desc(record.get("dtype"))
    shape, numel = _check_shape(record.get("shape"), where)
    if numel * np_dtype.itemsize != nbytes:
        _corrupt(
            f"{where}: {nbytes} bytes do not match shape {list(shape)} of {np_dtype} "
            f"({numel * np_dtype.itemsize} bytes)"
        )
    spec.dtype, spec.shape = np_dtype, shape


class _Decoder:
    """Rebuilds the state tree, copying each referenced blob out of the shard once."""

    def __init__(self, mv: memoryview, offsets: list[int], specs: list[_BlobSpec], share: object = None) -> None:
        self.mv = mv
        self.offsets = offsets
        self.specs = specs
        # zero-copy decode: large tensors and arrays become views of this writable buffer object
        self.share = share
        self.share_base: torch.Tensor | None = None
        self.objects: list[Any] = []  # blob index -> its object (materialize_all)
        # blob index -> whether it is a tensor, what a ["T", index] node may refer to
        self.tensor_blobs: list[bool] = list(map(_BLOB_TENSOR.__eq__, map(_KIND, specs)))
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
        dec, dec_key, fill_pairs = self.dec, self.dec_key, self.fill_pairs
        objects, tensor_blobs, count = self.objects, self.tensor_blobs, len(self.objects)
        child = depth + 1
        # str / int keys, ["T", index] and ["d", ...] values inline; everything else (and
        # anything malformed) through dec_key / dec, which check it.
        for i in range(start, len(node), 2):
            key = node[i]
            tk = type(key)
            if tk is not str and tk is not int:
                key = dec_key(key, child)
            value = node[i + 1]
            if type(value) is list and value:
                tag = value[0]
                if tag == "T" and len(value) == 2:
                    index = value[1]
                    if type(index) is int and 0 <= index < count and tensor_blobs[index]:
                        out[key] = objects[index]
                        continue
                elif tag == "d" and child <= MAX_DEPTH + 2:  # dec()'s depth check
                    inner: dict[Any, Any] = {}
                    out[key] = inner
                    fill_pairs(inner, value, 1, child)
                    continue
            out[key] = dec(value, child)

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
        return self.objects[index]

    def materialize_all(self) -> None:
        """Make every blob's object, in blob order (a blob referenced twice is one object).

        The hot path of a restore: small plain tensors (those with a template), each one
        ``torch.empty_like`` and one memmove from the shard, both mapped over all of them
        at once. Offsets and sizes were bounds-checked by :func:`_read_header`.
        """
        specs, offsets = self.specs, self.offsets
        templates = list(map(_TEMPLATE, specs))
        count = len(specs)
        flags = list(map(operator.is_not, templates, repeat(None)))  # (not templates.count: Tensor.__eq__)
        plain = flags.count(True)
        if plain == count:
            picked, picked_specs, picked_offsets = templates, specs, offsets
        else:
            picked = list(compress(templates, flags))
            picked_specs, picked_offsets = list(compress(specs, flags)), list(compress(offsets, flags))
        tensors = list(map(torch.empty_like, picked))
        if tensors:
            base_addr = self.base_address()
            # Each a fresh contiguous tensor of exactly spec.nbytes bytes.
            list(map(ctypes.memmove, map(_DATA_PTR, tensors), map(base_addr.__add__, picked_offsets), map(_NBYTES, picked_specs)))
        if plain == count:
            self.objects = tensors
            return
        made = iter(tensors)
        share, materialize, share_or_copy = self.share, self.materialize, self.share_or_copy
        self.objects = [
            next(made) if template is not None
            else materialize(offset, spec) if share is None or spec.nbytes <= _SMALL_COPY
            else share_or_copy(offset, spec)
            for template, offset, spec in zip(templates, offsets, specs, strict=False)  # offsets: one more
        ]

    def base_address(self) -> int:
        """Address of the shard buffer (via a read-only uint8 alias made on first use)."""
        if self.base is None:
            with warnings.catch_warnings():
                # torch warns that read-only buffers (bytes, read-only mmap) give
                # tensors it cannot protect; this alias is only ever read from.
                warnings.simplefilter("ignore", UserWarning)
                self.base = torch.frombuffer(self.mv, dtype=torch.uint8)
                self.base_addr = self.base.data_ptr()
        return self.base_addr

    def share_or_copy(self, offset: int, spec: _BlobSpec) -> Any:
        """zero_copy: a large tensor or array as a view of the shared buffer where it can be."""
        if spec.kind in (_BLOB_TENSOR, _BLOB_NDARRAY):
            shared = self.shared_view(offset, spec)
            if shared is not None:
                return shared
        return self.materialize(offset, spec)

    def shared_view(self, offset: int, spec: _BlobSpec) -> Any:
        """A tensor/array aliasing the shared buffer, or None where a copy is needed (odd dtypes)."""
        start, end = offset, offset + spec.nbytes
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

    def materialize(self, offset: int, spec: _BlobSpec) -> Any:
        """A fresh object owning a copy of the blob's bytes."""
        start, end = offset, offset + spec.nbytes
        if spec.kind == _BLOB_TENSOR:
            tensor = torch.empty(size=spec.shape, dtype=spec.dtype)
            if spec.nbytes:
                base_addr = self.base_address()
                if spec.nbytes <= _SMALL_COPY:
                    # Fresh contiguous tensor of exactly nbytes; the source range was
                    # bounds-checked against the buffer by _read_header.
                    ctypes.memmove(tensor.data_ptr(), base_addr + start, spec.nbytes)
                else:
                    assert self.base is not None
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
                header, offsets, specs = _read_header(mv)
                decoder = _Decoder(mv, offsets, specs, share=buf if zero_copy else None)
                decoder.materialize_all()
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
    """Parse and validate the prelude and JSON header only; blobs are not touched.

    The blob table comes back in its full form whatever the shard stores: ``blobs`` holds
    one record per blob with its absolute ``offset`` (as in format version 1) and there is
    no ``kinds`` key. Serialized again, that header describes the same shard.
    """
    mv = _as_byte_view(buf)
    try:
        try:
            with _GcPaused():
                header, offsets, _ = _read_header(mv)
        except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError,
                struct.error) as exc:
            raise CorruptShardError(f"malformed shard header: {type(exc).__name__}: {exc}") from None
        if header["version"] >= 2 and "kinds" in header:
            header = _expand_blob_table(header, offsets)
        return header
    finally:
        mv.release()


def _expand_blob_table(header: dict[str, Any], offsets: list[int]) -> dict[str, Any]:
    """``header`` (validated, with a compact blob table) with one full record per blob instead."""
    kinds = header["kinds"]
    expanded = {key: value for key, value in header.items() if key != "kinds"}
    blobs = []
    for index, offset in zip(header["blobs"], offsets, strict=False):  # offsets: one more
        record = kinds[index]
        full = {"kind": record["kind"], "offset": offset}
        full.update((key, copy.deepcopy(value)) for key, value in record.items() if key not in full)
        blobs.append(full)
    expanded["blobs"] = blobs
    return expanded
