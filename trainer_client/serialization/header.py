"""A shard's header both ways: rendered for the encoder, parsed and validated for the decoder.

Validation is strict because shard bytes may arrive over the network: every inconsistency raises
:class:`~trainer_client.errors.CorruptShardError`, and offsets and sizes are bounds-checked here once so
that the decoder copies without further checks.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from itertools import accumulate
from typing import Any, NoReturn, Protocol

import torch

from trainer_client.errors import CorruptShardError
from trainer_client.serialization.dtypes import TENSOR_DTYPES, np_dtype_from_desc
from trainer_client.serialization.spec import (
    ALIGN_MASK,
    ALIGNMENT,
    BLOB_BYTEARRAY,
    BLOB_BYTES,
    BLOB_NDARRAY,
    BLOB_TENSOR,
    BYTEORDER,
    FORMAT_VERSION,
    MAGIC,
    MAX_DIM,
    PRELUDE,
    PRELUDE_SIZE,
    READABLE_VERSIONS,
    SMALL_COPY,
    align,
)

__all__ = ["BlobSpec", "compact_json", "corrupt", "expand_blob_table", "read_header", "render_header"]


# --------------------------------------------------------------------------------------
# encode: rendering
# --------------------------------------------------------------------------------------


def _ndigits(n: int) -> int:
    return len(str(n))


def compact_json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


class _Described(Protocol):
    """A blob's description (:class:`trainer_client.serialization.walk.Kind`): its record in the header, as JSON."""

    record: str


def render_header(kinds: Sequence[_Described], data_len: int, root_json: str) -> tuple[bytes, int]:
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
        '{"version":' + compact_json(FORMAT_VERSION) + ',"byteorder":' + compact_json(BYTEORDER) + ',"nbytes":',
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
    data_offset = align(PRELUDE_SIZE + fixed)
    while True:
        length = fixed + _ndigits(data_offset + data_len) + _ndigits(data_offset)
        needed = align(PRELUDE_SIZE + length)
        if needed <= data_offset:  # length grows with data_offset: this is the fixed point
            break
        data_offset = needed
    parts[1], parts[3] = str(data_offset + data_len), str(data_offset)
    text = "".join(parts)
    if len(text) != length:  # the arithmetic above is exact
        raise AssertionError("shard header length disagrees with its planned data offset")
    return text.encode("ascii"), data_offset


# --------------------------------------------------------------------------------------
# decode: parsing and validation
# --------------------------------------------------------------------------------------


class BlobSpec:
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


def corrupt(message: str) -> NoReturn:
    raise CorruptShardError(message)


def _is_uint(value: object) -> bool:
    return type(value) is int and value >= 0  # type: ignore[operator]


def _check_shape(shape: object, where: str) -> tuple[tuple[int, ...], int]:
    if type(shape) is not list or not all(type(d) is int and 0 <= d < MAX_DIM for d in shape):
        corrupt(f"{where}: shape must be a list of non-negative ints, got {shape!r:.80}")
    numel = 1
    for d in shape:
        numel *= d
    return tuple(shape), numel


def _reject_constant(name: str) -> NoReturn:
    raise CorruptShardError(f"header JSON contains {name}, which the format never writes")


def read_header(mv: memoryview) -> tuple[dict[str, Any], list[int], list[BlobSpec]]:
    """Parse and validate the prelude, header JSON and blob table of a shard.

    Returns the header, and per blob its offset and its (shared) :class:`BlobSpec`.
    """
    size = len(mv)
    version, header_len = _read_prelude(mv, size)
    header = _parse_header_json(mv, header_len)
    data_offset, total = _check_header_fields(header, version, header_len, size)
    records = header["blobs"]
    if type(records) is not list:
        corrupt("header 'blobs' must be a list")
    if version >= 2 and "kinds" in header:
        offsets, specs = _check_blob_table(header["kinds"], records, data_offset, total)
    else:
        offsets, specs = _check_blob_records(records, data_offset, total)
    return header, offsets, specs


def _check_blob_table(table: object, indices: list[Any], data_offset: int, total: int) -> tuple[list[int], list[BlobSpec]]:
    """Validate the compact blob table of format version 2.

    ``table`` lists each distinct record once (a version-1 record less its offset);
    ``indices`` holds each blob's index into it. Blobs are packed: each starts at the
    first ALIGNMENT boundary at or after the end of the one before, the first at
    ``data_offset``, and the last must end exactly at ``total``. Checked with C-level
    maps, nothing per blob in Python.
    """
    if type(table) is not list:
        corrupt("header 'kinds' must be a list")
    kinds = [_check_kind_record(record, f"kind #{index}") for index, record in enumerate(table)]
    if indices and (set(map(type, indices)) != {int} or min(indices) < 0 or max(indices) >= len(kinds)):
        corrupt(f"header 'blobs' must hold indices into the {len(kinds)} 'kinds'")
    specs = list(map(kinds.__getitem__, indices))
    slots = [align(kind.nbytes) for kind in kinds]
    offsets = list(accumulate(map(slots.__getitem__, indices), initial=data_offset))  # one more than blobs
    end = offsets[-2] + specs[-1].nbytes if specs else data_offset
    if end != total:
        corrupt(f"blobs end at byte {end}, the shard at {total}")
    return offsets, specs


def _checked_spec(record: dict[str, Any], kind: object, nbytes: int, where: str) -> BlobSpec:
    """The spec of a blob record of ``kind`` and ``nbytes``, its kind-specific fields checked."""
    spec = BlobSpec(str(kind), nbytes)
    if kind == BLOB_TENSOR:
        _check_tensor_record(record, spec, where)
    elif kind == BLOB_NDARRAY:
        _check_ndarray_record(record, spec, where)
    elif kind != BLOB_BYTES and kind != BLOB_BYTEARRAY:
        corrupt(f"{where}: unknown blob kind {kind!r:.40}")
    return spec


def _check_kind_record(record: object, where: str) -> BlobSpec:
    """Validate one record of the compact table: a version-1 blob record without the offset."""
    if type(record) is not dict:
        corrupt(f"{where}: record must be an object")
    kind = record.get("kind")
    nbytes = record.get("nbytes")
    if not _is_uint(nbytes):
        corrupt(f"{where}: nbytes must be a non-negative int")
    assert type(nbytes) is int
    spec = _checked_spec(record, kind, nbytes, where)
    return spec


def _check_blob_records(records: list[Any], data_offset: int, total: int) -> tuple[list[int], list[BlobSpec]]:
    """Validate every blob record (:func:`_check_blob_record`), each distinct one only once.

    The fast path takes records whose fields have the types the writer gives them; it
    checks the offset itself and looks the rest up among the records validated before,
    keyed by every field that validation reads (with types pinned: ``1 == 1.0 == True``
    would otherwise share a key). Anything else, and the first record of each key, goes
    through :func:`_check_blob_record`, so the outcome and the first error are the same.
    """
    offsets: list[int] = []
    specs: list[BlobSpec] = []
    add_offset, add_spec = offsets.append, specs.append
    known: dict[tuple[Any, ...], BlobSpec] = {}
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
                and not offset & ALIGN_MASK
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
        if type(record) is dict and spec.kind in (BLOB_TENSOR, BLOB_NDARRAY):
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
    if size < PRELUDE_SIZE:
        corrupt(f"buffer is {size} bytes, shorter than the {PRELUDE_SIZE}-byte shard prelude")
    magic, version, header_len = PRELUDE.unpack_from(mv, 0)
    if magic != MAGIC:
        corrupt(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}: not a memstore shard")
    if version not in READABLE_VERSIONS:
        corrupt(f"shard format version {version}, this reader understands versions {list(READABLE_VERSIONS)}")
    if header_len > size - PRELUDE_SIZE:
        corrupt(f"header length {header_len} runs past the end of the {size}-byte buffer (truncated?)")
    return version, header_len


def _parse_header_json(mv: memoryview, header_len: int) -> dict[str, Any]:
    """The header as a JSON object holding every required key (values not checked yet)."""
    try:
        text = bytes(mv[PRELUDE_SIZE : PRELUDE_SIZE + header_len]).decode("utf-8")
        header = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError, JSONDecodeError
        raise CorruptShardError(f"header is not valid UTF-8 JSON: {exc}") from None
    if type(header) is not dict:
        corrupt(f"header must be a JSON object, got {type(header).__name__}")
    for key in ("version", "byteorder", "nbytes", "data_offset", "blobs", "root"):
        if key not in header:
            corrupt(f"header lacks required key {key!r}")
    return header


def _check_header_fields(header: dict[str, Any], version: int, header_len: int, size: int) -> tuple[int, int]:
    """Check version, byte order and sizes against the prelude; returns (data_offset, total)."""
    if header["version"] != version or type(header["version"]) is not int:
        corrupt(f"header version {header['version']!r:.40} disagrees with prelude version {version}")
    if header["byteorder"] != BYTEORDER:
        corrupt(
            f"shard was written on a {header['byteorder']!r:.20}-endian host; this host is {BYTEORDER}-endian and cannot decode its tensors"
        )
    total = header["nbytes"]
    data_offset = header["data_offset"]
    expected_data_offset = align(PRELUDE_SIZE + header_len)
    if data_offset != expected_data_offset or type(data_offset) is not int:
        corrupt(f"data_offset {data_offset!r:.40} should be {expected_data_offset}")
    if not _is_uint(total) or total < data_offset:
        corrupt(f"total size {total!r:.40} is smaller than the data offset {data_offset}")
    if total > size:
        corrupt(f"shard declares {total} bytes but the buffer holds only {size} (truncated?)")
    return data_offset, total


def _check_blob_record(record: object, where: str, end: int, total: int) -> tuple[int, BlobSpec]:
    """Validate one blob record: its slot must follow ``end`` (the previous blob's end) within ``total``."""
    if type(record) is not dict:
        corrupt(f"{where}: record must be an object")
    kind = record.get("kind")
    offset = record.get("offset")
    nbytes = record.get("nbytes")
    if not _is_uint(offset) or not _is_uint(nbytes):
        corrupt(f"{where}: offset and nbytes must be non-negative ints")
    assert type(offset) is int and type(nbytes) is int
    if offset % ALIGNMENT:
        corrupt(f"{where}: offset {offset} is not {ALIGNMENT}-byte aligned")
    if offset < end:
        corrupt(f"{where}: offset {offset} overlaps the header or the previous blob (ends at {end})")
    if offset + nbytes > total:
        corrupt(f"{where}: bytes [{offset}, {offset + nbytes}) run past the shard end {total}")
    spec = _checked_spec(record, kind, nbytes, where)
    return offset, spec


def _check_tensor_record(record: dict[str, Any], spec: BlobSpec, where: str) -> None:
    """Validate a tensor record's dtype, shape and flags; fills them into ``spec``."""
    nbytes = spec.nbytes
    name = record.get("dtype")
    dtype = TENSOR_DTYPES.get(name) if type(name) is str else None
    if dtype is None:
        corrupt(f"{where}: unknown tensor dtype {name!r:.40}")
    shape, numel = _check_shape(record.get("shape"), where)
    if numel * dtype.itemsize != nbytes:
        corrupt(f"{where}: {nbytes} bytes do not match shape {list(shape)} of {name} ({numel * dtype.itemsize} bytes)")
    requires_grad = record.get("requires_grad", False)
    parameter = record.get("parameter", False)
    if type(requires_grad) is not bool or type(parameter) is not bool:
        corrupt(f"{where}: requires_grad and parameter must be booleans")
    if requires_grad and not (dtype.is_floating_point or dtype.is_complex):
        corrupt(f"{where}: a {name} tensor cannot require grad")
    if type(record.get("device", "cpu")) is not str:
        corrupt(f"{where}: device must be a string")
    spec.dtype, spec.shape = dtype, shape
    spec.requires_grad, spec.parameter = requires_grad, parameter
    if not requires_grad and not parameter and 0 < nbytes <= SMALL_COPY:
        scalar = torch.empty((), dtype=dtype)
        template = scalar.expand(shape) if numel > 1 else scalar.reshape(shape)
        if not torch.empty_like(template).is_contiguous():  # not so far; a real one would do
            template = torch.empty(size=shape, dtype=dtype)
        spec.template = template


def _check_ndarray_record(record: dict[str, Any], spec: BlobSpec, where: str) -> None:
    """Validate an array record's dtype and shape; fills them into ``spec``."""
    nbytes = spec.nbytes
    np_dtype = np_dtype_from_desc(record.get("dtype"))
    shape, numel = _check_shape(record.get("shape"), where)
    if numel * np_dtype.itemsize != nbytes:
        corrupt(f"{where}: {nbytes} bytes do not match shape {list(shape)} of {np_dtype} ({numel * np_dtype.itemsize} bytes)")
    spec.dtype, spec.shape = np_dtype, shape


def expand_blob_table(header: dict[str, Any], offsets: list[int]) -> dict[str, Any]:
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
