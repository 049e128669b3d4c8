"""Decoding side of the shard format: :func:`decode` and :func:`peek_header`; never runs code from the bytes."""

from __future__ import annotations

import collections
import ctypes
import operator
import struct
import warnings
from collections.abc import Callable, Mapping
from itertools import compress, repeat
from operator import attrgetter
from typing import Any, Final, NamedTuple, cast

import numpy as np
import torch

from trainer_client.errors import CorruptShardError
from trainer_client.serialization.dtypes import TORCH_DTYPES, needs_raw_copy, np_dtype_from_desc
from trainer_client.serialization.header import BlobSpec, corrupt, expand_blob_table, read_header
from trainer_client.serialization.memory import GcPaused, as_byte_view
from trainer_client.serialization.spec import (
    BLOB_BYTEARRAY,
    BLOB_BYTES,
    BLOB_NDARRAY,
    BLOB_TENSOR,
    DOUBLE,
    HEX_BYTES,
    HEX_INT,
    MAX_DEPTH,
    SMALL_COPY,
    Buffer,
)

__all__ = ["Span", "decode", "peek_header"]

_TEMPLATE: Final = attrgetter("template")
_KIND: Final = attrgetter("kind")
_NBYTES: Final = attrgetter("nbytes")
_DATA_PTR: Final = torch.Tensor.data_ptr


class Span(NamedTuple):
    """Where a blob's bytes lie: ``nbytes`` bytes at ``offset`` of ``buffer`` (see :func:`decode`'s ``spans``, ``views``)."""

    buffer: Any
    offset: int
    nbytes: int


class _Decoder:
    """Rebuilds the state tree, copying each referenced blob out of the shard once."""

    def __init__(
        self, mv: memoryview, offsets: list[int], specs: list[BlobSpec], share: object = None, views: Mapping[int, Span] | None = None,
        spans: list[Span] | None = None,
    ) -> None:  # fmt: skip
        self.mv = mv
        self.views = views  # zero-copy decode: large tensors whose bytes lie outside ``mv`` (stripes), by offset; else None
        self.spans = spans  # zero-copy decode: large byte tensors are left as Spans of ``share`` and listed here; else None
        self.offsets = offsets
        self.specs = specs
        # zero-copy decode: large tensors and arrays become views of this writable buffer object
        self.share = share
        self.objects: list[Any] = []  # blob index -> its object (materialize_all)
        # blob index -> whether it is a tensor, what a ["T", index] node may refer to
        self.tensor_blobs: list[bool] = list(map(BLOB_TENSOR.__eq__, map(_KIND, specs)))
        self.base: torch.Tensor | None = None
        self.base_addr = 0
        self.np_base: np.ndarray[Any, Any] | None = None

    def close(self) -> None:
        # Drop every alias of the shard buffer so the caller can release/close it.
        self.base = None
        self.np_base = None

    # -- tree -------------------------------------------------------------------------

    def dec(self, node: Any, depth: int) -> Any:
        t = type(node)
        if t is str or t is int or t is bool or node is None:
            return node
        if t is not list or not node or type(node[0]) is not str:
            corrupt(f"malformed tree node {node!r:.80}")
        if depth > MAX_DEPTH + 2:
            corrupt(f"tree nests deeper than {MAX_DEPTH} levels")
        handler = _HANDLERS.get(node[0])
        if handler is None:
            corrupt(f"unknown tag {node[0]!r:.40} in tree")
        return handler(self, node, depth)

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
        corrupt(f"malformed dict key / set member {node!r:.80}")

    def dec_float(self, node: list[Any], depth: int) -> float:
        if len(node) != 2 or type(node[1]) is not str or len(node[1]) != 16 or not HEX_BYTES.fullmatch(node[1]):
            corrupt(f"malformed float {node!r:.80}")
        value: float = DOUBLE.unpack(bytes.fromhex(node[1]))[0]
        return value

    def dec_bigint(self, node: list[Any], depth: int) -> int:
        if len(node) != 2 or type(node[1]) is not str or not HEX_INT.fullmatch(node[1]):
            corrupt(f"malformed int {node!r:.80}")
        return int(node[1], 16)

    def dec_list(self, node: list[Any], depth: int) -> list[Any]:
        return [self.dec(item, depth + 1) for item in node[1:]]

    def dec_tuple(self, node: list[Any], depth: int) -> tuple[Any, ...]:
        return tuple([self.dec(item, depth + 1) for item in node[1:]])

    def fill_pairs(self, out: dict[Any, Any], node: list[Any], start: int, depth: int) -> None:
        if (len(node) - start) % 2:
            corrupt("dict node has a key without a value")
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
                corrupt("OrderedDict node lacks its metadata")
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
            corrupt(f"malformed torch.Size {node!r:.80}")
        return torch.Size(dims)

    def dec_dtype(self, node: list[Any], depth: int) -> torch.dtype:
        dtype = TORCH_DTYPES.get(node[1]) if len(node) == 2 and type(node[1]) is str else None
        if dtype is None:
            corrupt(f"unknown torch dtype {node!r:.80}")
        return dtype

    def dec_device(self, node: list[Any], depth: int) -> torch.device:
        if len(node) != 2 or type(node[1]) is not str or len(node[1]) > 64:
            corrupt(f"malformed torch.device {node!r:.80}")
        try:
            return torch.device(node[1])
        except RuntimeError as exc:
            raise CorruptShardError(f"invalid torch.device {node[1]!r}: {exc}") from None

    def dec_np_dtype(self, node: list[Any], depth: int) -> np.dtype[Any]:
        if len(node) != 2:
            corrupt(f"malformed numpy dtype {node!r:.80}")
        return np_dtype_from_desc(node[1])

    def dec_np_scalar(self, node: list[Any], depth: int) -> np.generic:
        if len(node) != 3 or type(node[2]) is not str or not HEX_BYTES.fullmatch(node[2]):
            corrupt(f"malformed numpy scalar {node!r:.80}")
        dtype = np_dtype_from_desc(node[1])
        data = bytes.fromhex(node[2])
        if len(data) != dtype.itemsize:
            corrupt(f"numpy scalar of dtype {dtype} needs {dtype.itemsize} bytes, got {len(data)}")
        holder = np.empty((), dtype=dtype)
        if data:
            holder.reshape(-1).view(np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)
        return cast(np.generic, holder[()])

    # -- blobs ------------------------------------------------------------------------

    _KINDS: Final = {"T": BLOB_TENSOR, "N": BLOB_NDARRAY, "b": BLOB_BYTES, "B": BLOB_BYTEARRAY}

    def dec_blob(self, node: list[Any], depth: int) -> Any:
        if len(node) != 2 or type(node[1]) is not int or not 0 <= node[1] < len(self.specs):
            corrupt(f"blob reference {node!r:.80} is out of range")
        index: int = node[1]
        spec = self.specs[index]
        if spec.kind != self._KINDS[node[0]]:
            corrupt(f"tree node {node[0]!r} refers to blob #{index} of kind {spec.kind!r}")
        return self.objects[index]

    def materialize_all(self) -> None:
        """Make every blob's object, in blob order (a blob referenced twice is one object).

        The hot path of a restore: small plain tensors (those with a template), each one
        ``torch.empty_like`` and one memmove from the shard, both mapped over all of them
        at once. Offsets and sizes were bounds-checked by :func:`read_header`.
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
        share, materialize = self.share, self.materialize
        share_or_copy = self.share_or_copy if self.spans is None else self.span_or_share
        self.objects = [
            next(made)
            if template is not None
            else materialize(offset, spec)
            if share is None or spec.nbytes <= SMALL_COPY
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

    def share_or_copy(self, offset: int, spec: BlobSpec) -> Any:
        """zero_copy: a large tensor or array as a view of the shared buffer where it can be."""
        if spec.kind in (BLOB_TENSOR, BLOB_NDARRAY):
            shared = self.shared_view(offset, spec)
            if shared is not None:
                return shared
        return self.materialize(offset, spec)

    def span_or_share(self, offset: int, spec: BlobSpec) -> Any:
        """zero_copy with ``spans``: a large 1-D byte tensor (not a Parameter, no grad) as a :class:`Span` of the
        shared buffer; anything else as :meth:`share_or_copy` makes it."""
        plain_bytes = spec.dtype is torch.uint8 and len(spec.shape) == 1 and not spec.parameter and not spec.requires_grad
        if spec.kind == BLOB_TENSOR and plain_bytes:
            span = Span(self.share, offset, spec.nbytes)
            self.spans.append(span)  # type: ignore[union-attr]
            return span
        return self.share_or_copy(offset, spec)

    def shared_view(self, offset: int, spec: BlobSpec) -> Any:
        """A tensor/array aliasing the shared buffer, or None where a copy is needed (odd dtypes)."""
        if spec.kind == BLOB_NDARRAY:
            return np.frombuffer(self.share, dtype=spec.dtype, count=spec.nbytes // spec.dtype.itemsize, offset=offset).reshape(spec.shape)  # type: ignore[call-overload]
        if needs_raw_copy(spec.dtype):
            return None
        buffer = self.share
        at = None if self.views is None else self.views.get(offset)
        if at is not None:  # its bytes lie elsewhere
            buffer, offset = at.buffer, at.offset
        # One call per step a tensor needs (each costs microseconds, and a restore makes hundreds): the tensor is made
        # of its dtype straight over the buffer (2.5x faster than a slice of a byte alias, then a view), and a 1-D
        # tensor needs no reshape. Each tensor owns a storage of exactly its bytes, so saving one saves only those.
        tensor = torch.frombuffer(buffer, dtype=spec.dtype, count=spec.nbytes // spec.dtype.itemsize, offset=offset)  # type: ignore[call-overload]
        if len(spec.shape) != 1:
            tensor = tensor.view(spec.shape)
        if spec.parameter:
            return torch.nn.Parameter(tensor, requires_grad=spec.requires_grad)
        if spec.requires_grad:
            tensor.requires_grad_(True)
        return tensor

    def materialize(self, offset: int, spec: BlobSpec) -> Any:
        """A fresh object owning a copy of the blob's bytes."""
        start, end = offset, offset + spec.nbytes
        if spec.kind == BLOB_TENSOR:
            tensor = torch.empty(size=spec.shape, dtype=spec.dtype)
            if spec.nbytes:
                base_addr = self.base_address()
                if spec.nbytes <= SMALL_COPY:
                    # Fresh contiguous tensor of exactly nbytes; the source range was
                    # bounds-checked against the buffer by read_header.
                    ctypes.memmove(tensor.data_ptr(), base_addr + start, spec.nbytes)
                else:
                    assert self.base is not None
                    tensor.reshape(-1).view(torch.uint8).copy_(self.base[start:end])
            if spec.parameter:
                return torch.nn.Parameter(tensor, requires_grad=spec.requires_grad)
            if spec.requires_grad:
                tensor.requires_grad_(True)
            return tensor
        if spec.kind == BLOB_NDARRAY:
            array = np.empty(spec.shape, dtype=spec.dtype)
            if spec.nbytes:
                if self.np_base is None:
                    self.np_base = np.frombuffer(self.mv, dtype=np.uint8)
                array.reshape(-1).view(np.uint8)[:] = self.np_base[start:end]
            return array
        data = self.mv[start:end]
        try:
            return bytes(data) if spec.kind == BLOB_BYTES else bytearray(data)
        finally:
            data.release()


# A tree node's tag -> its decoding method. Held by the class, not by each decoder as bound methods: those would make
# every decoder a reference cycle, which kept the tensors it made (and the mappings they view) alive until the next
# cyclic collection, not just as long as the state.
_HANDLERS: Final[dict[str, Callable[[_Decoder, list[Any], int], Any]]] = {
    "f": _Decoder.dec_float,
    "i": _Decoder.dec_bigint,
    "l": _Decoder.dec_list,
    "t": _Decoder.dec_tuple,
    "d": _Decoder.dec_dict,
    "o": _Decoder.dec_odict,
    "om": _Decoder.dec_odict,
    "s": _Decoder.dec_set,
    "F": _Decoder.dec_set,
    "S": _Decoder.dec_size,
    "y": _Decoder.dec_dtype,
    "v": _Decoder.dec_device,
    "nd": _Decoder.dec_np_dtype,
    "n": _Decoder.dec_np_scalar,
    "T": _Decoder.dec_blob,
    "N": _Decoder.dec_blob,
    "b": _Decoder.dec_blob,
    "B": _Decoder.dec_blob,
}

Parsed = tuple[dict[str, Any], list[int], list[BlobSpec]]  # what read_header returns


def decode(
    buf: Buffer, *, zero_copy: bool = False, views: Mapping[int, Span] | None = None, parsed: Parsed | None = None,
    spans: list[Span] | None = None,
) -> object:  # fmt: skip
    """Rebuild the state from shard bytes without executing anything from them.

    ``buf`` may be bytes, bytearray, memoryview or mmap, read-only included, and may be
    longer than the shard. By default every tensor, array and bytes object is copied out, so
    the caller may release or overwrite ``buf`` afterwards.

    ``zero_copy=True`` (``buf`` must be writable and must never change afterwards, e.g. a
    private copy-on-write file mapping) makes large tensors and arrays views of ``buf``
    instead: no copy and no page faults for fresh memory. The views keep ``buf`` alive.
    Any inconsistency raises :class:`CorruptShardError`; a non-buffer argument raises TypeError.

    ``views`` (with ``zero_copy``): large tensors whose bytes lie somewhere else, by their offset in the shard: each
    a :class:`Span` of exactly the tensor's bytes. Such a tensor views its span's buffer instead of ``buf``, whose
    bytes there are never read (a replica group's stripes: :mod:`trainer_client.stripes`).

    ``spans`` (with ``zero_copy``): each large 1-D uint8 tensor that is no Parameter and needs no grad comes back as
    a :class:`Span` of ``buf`` instead (no tensor is made), also appended to this list: a stripe's slices, which are
    read back only as bytes (:func:`trainer_client.stripes.decode_stripe`).

    ``parsed``: what :func:`~trainer_client.serialization.header.read_header` returned for ``buf``, when the caller
    parsed it already (it is not parsed twice).
    """
    mv = as_byte_view(buf)
    if zero_copy and mv.readonly:
        mv.release()
        raise TypeError("decode(zero_copy=True) needs a writable buffer (e.g. an mmap with MAP_PRIVATE)")
    decoder: _Decoder | None = None
    try:
        try:
            with GcPaused():
                header, offsets, specs = parsed if parsed is not None else read_header(mv)
                decoder = _Decoder(
                    mv, offsets, specs, share=buf if zero_copy else None, views=views if zero_copy else None,
                    spans=spans if zero_copy else None,
                )  # fmt: skip
                decoder.materialize_all()
                return decoder.dec(header["root"], 0)
        except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError, RuntimeError, struct.error) as exc:
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
    mv = as_byte_view(buf)
    try:
        try:
            with GcPaused():
                header, offsets, _ = read_header(mv)
        except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError, struct.error) as exc:
            raise CorruptShardError(f"malformed shard header: {type(exc).__name__}: {exc}") from None
        if header["version"] >= 2 and "kinds" in header:
            header = expand_blob_table(header, offsets)
        return header
    finally:
        mv.release()
