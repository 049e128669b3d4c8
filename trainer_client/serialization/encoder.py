"""Encoding side of the shard format: :func:`plan`, :class:`ShardLayout` and :func:`encode`.

:func:`plan` walks the state (:mod:`~trainer_client.serialization.walk`) and renders the header
(:mod:`~trainer_client.serialization.header`); :meth:`ShardLayout.write_into` writes it and copies every blob
(:mod:`~trainer_client.serialization.blob_writer`).
"""

from __future__ import annotations

import bisect
import ctypes
import operator
from collections.abc import Callable
from itertools import accumulate, compress
from operator import attrgetter
from typing import Any, Final

import numpy as np
import torch
from numpy.lib.stride_tricks import as_strided

from trainer_client.errors import InvalidArgumentError, SerializationError
from trainer_client.serialization.blob_writer import BlobWriter, raise_changed
from trainer_client.serialization.header import render_header
from trainer_client.serialization.memory import ChunkSums, GcPaused, as_byte_view, memmove_hashing, parallel_memmove
from trainer_client.serialization.spec import BLOB_NDARRAY, BLOB_TENSOR, FORMAT_VERSION, MAGIC, PRELUDE, PRELUDE_SIZE, ZEROS, Buffer
from trainer_client.serialization.walk import (
    DATA_PTR,
    DTYPE_OF,
    IS_COMPLEX,
    IS_CONJ,
    IS_CONTIGUOUS,
    IS_CPU,
    IS_NEG,
    SHAPE_OF,
    Kind,
    Planner,
    encode_tree,
)

__all__ = ["ShardLayout", "encode", "plan"]

_K_SLOT: Final = attrgetter("slot")
_K_GAP: Final = attrgetter("gap")
_K_NBYTES: Final = attrgetter("nbytes")
_K_DTYPE: Final = attrgetter("dtype")
_K_SHAPE: Final = attrgetter("shape")
_K_MEMMOVE: Final = attrgetter("memmove")
MARK_BYTES: Final = 64 << 20  # write_into(mark=): about this many bytes between two marks


class ShardLayout:
    """The planned encoding of one state: header bytes plus where each blob goes.

    Holds references to the state's tensors/arrays (not copies); the state must not be
    mutated between :func:`plan` and :meth:`write_into`.
    """

    __slots__ = ("_header", "_kinds", "_moved", "_moved_dtypes", "_moved_nbytes", "_moved_rels", "_moved_shapes",
                 "_offsets", "_others", "_padding", "_srcs", "cuda_blobs", "data_offset", "nbytes", "num_tensors")  # fmt: skip

    def __init__(self, header: bytes, data_offset: int, data_len: int, planner: Planner, offsets: list[int]) -> None:
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
        # The CUDA tensors, found once here (small CPU tensors take the memmove path, CUDA tensors never do): the blobs a
        # device copy fills, as a save's capture reads them (``trainer_client.capture.cuda.device_part``).
        self.cuda_blobs = [i for i in self._others if kinds[i].kind == BLOB_TENSOR and srcs[i].is_cuda]

    def __repr__(self) -> str:
        return f"ShardLayout(nbytes={self.nbytes}, num_tensors={self.num_tensors}, header_bytes={len(self._header)})"

    def device_tensors(self, is_device: Callable[[torch.Tensor], bool] | None = None) -> list[int]:
        """Indices of the blobs that are device tensors: the slots a device copy fills instead (``write_into(skip=...)``).

        ``is_device`` None: the CUDA tensors (:attr:`cuda_blobs`, found when the layout was planned). Else every tensor
        blob is asked: the CUDA seam's test stand-in counts CPU tensors it marked as device tensors
        (``trainer_client.capture.cuda.CudaRuntime.device_tensor``)."""
        srcs, kinds = self._srcs, self._kinds
        if is_device is None:
            return list(self.cuda_blobs)
        return [i for i in range(len(srcs)) if kinds[i].kind == BLOB_TENSOR and is_device(srcs[i])]

    def slot(self, index: int) -> tuple[Any, int, int]:
        """Blob ``index``'s source, its slot's offset in the shard and its length; raises SerializationError if a
        tensor changed dtype or shape since :func:`plan`."""
        src, kind = self._srcs[index], self._kinds[index]
        if kind.kind == BLOB_TENSOR and (src.dtype != kind.dtype or src.shape != kind.shape):
            raise_changed("tensor", index)
        return src, self.data_offset + self._offsets[index], kind.nbytes

    def blob_starts(self) -> list[int]:
        """Where each blob's slot starts in the shard, in order."""
        data = self.data_offset
        return [data + offset for offset in self._offsets[: self.num_tensors]]

    def blobs_between(self, start: int, end: int) -> range:
        """The indices of the blobs whose slots may overlap ``[start, end)`` of the shard (found by bisection)."""
        data = self.data_offset
        first = max(0, bisect.bisect_right(self._offsets, start - data, 0, self.num_tensors) - 1)
        return range(first, bisect.bisect_left(self._offsets, end - data, 0, self.num_tensors))

    def head(self) -> bytes:
        """The shard's first :attr:`data_offset` bytes as :meth:`write_into` writes them: prelude, header, zero padding."""
        out = bytearray(self.data_offset)
        PRELUDE.pack_into(out, 0, MAGIC, FORMAT_VERSION, len(self._header))
        out[PRELUDE_SIZE : PRELUDE_SIZE + len(self._header)] = self._header
        return bytes(out)

    def write_into(
        self, buf: Buffer, skip: frozenset[int] = frozenset(), mark: Callable[[int], None] | None = None, sums: ChunkSums | None = None
    ) -> None:
        """Write the shard into ``buf[:nbytes]``: header, then every blob into its slot.

        ``buf`` must be a writable, C-contiguous buffer (bytearray, writable mmap,
        memoryview, ...) at least :attr:`nbytes` long. Padding is zeroed so identical
        states give identical bytes even in a reused buffer. Contiguous CPU tensors are
        copied with memmove (big ones in pieces on a few threads); others with
        ``Tensor.copy_`` straight from the (possibly strided, possibly non-CPU) source
        into a view of ``buf``, which needs no temporary. The slots of the blobs in ``skip`` are left as they
        are (``device_tensors()``: asynchronous device copies fill them).

        ``mark``: called as the shard's bytes become final front to back, with how many are (every
        ``MARK_BYTES`` or so, not after the last blob): the store pushes them to its peers meanwhile.

        ``sums``: hash every chunk of the shard as it is copied (``memmove_hashing``) into ``sums.values``; left None
        with ``skip`` or ``mark`` (bytes still to come when the copy ends).
        """
        mv = as_byte_view(buf)
        # Everything aliasing ``mv`` (the writer's uint8 tensor) must be dropped before
        # mv.release() in ``finally``.
        writer = BlobWriter(mv, self.nbytes)
        try:
            if mv.readonly:
                raise InvalidArgumentError("write_into needs a writable buffer; got a read-only one")
            if len(mv) < self.nbytes:
                raise InvalidArgumentError(f"buffer holds {len(mv)} bytes but the shard needs {self.nbytes}")
            header = self._header
            header_end = PRELUDE_SIZE + len(header)
            data_offset = self.data_offset
            PRELUDE.pack_into(mv, 0, MAGIC, FORMAT_VERSION, len(header))
            mv[PRELUDE_SIZE:header_end] = header
            mv[header_end:data_offset] = ZEROS[: data_offset - header_end]
            if self._srcs and mark is not None:
                self._zero_padding(mv, data_offset)
                with torch.no_grad(), GcPaused():
                    self._write_marked(writer, data_offset, skip, mark)
                return
            if self._srcs:
                with torch.no_grad(), GcPaused():  # the checks make lists of 10k Size objects
                    if not self._write_moved(writer, data_offset):
                        self._write_each(writer, data_offset, [i for i in range(len(self._srcs)) if i not in skip])
                    elif self._others:
                        self._write_each(writer, data_offset, [i for i in self._others if i not in skip] if skip else self._others)
                self._zero_padding(mv, data_offset)
            if sums is not None and not skip:
                sums.values = memmove_hashing(writer.moves, writer.base_address(), self.nbytes, sums.chunk_size)
            else:
                parallel_memmove(writer.moves)
        finally:
            writer.close()
            mv.release()

    def _zero_padding(self, mv: memoryview, data_offset: int) -> None:
        size = self.nbytes - data_offset
        for length, starts in self._padding:
            # Rows of `length` bytes starting at every byte of the data area; the
            # runs' rows are set to zero (all inside it: each run ends at a blob).
            # No name holds the view: nothing may keep `mv` exported after an error.
            as_strided(np.frombuffer(mv, np.uint8, size, data_offset), (size - length + 1, length), (1, 1))[starts] = 0

    def _write_marked(self, writer: BlobWriter, data_offset: int, skip: frozenset[int], mark: Callable[[int], None]) -> None:
        """The blobs in order, in groups of about ``MARK_BYTES``; after each group but the last, ``mark`` of the bytes
        final so far (every blob before the next group's first slot: the header, the padding and the group's blobs)."""
        offsets, count = self._offsets, len(self._srcs)
        first = 0
        while first < count:
            end = first + 1
            while end < count and offsets[end] - offsets[first] < MARK_BYTES:
                end += 1
            self._write_each(writer, data_offset, [i for i in range(first, end) if i not in skip])
            parallel_memmove(writer.moves)
            writer.moves.clear()
            if end < count:
                mark(data_offset + offsets[end])
            first = end

    def _write_moved(self, writer: BlobWriter, data_offset: int) -> bool:
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
            list(map(DTYPE_OF, moved)) != self._moved_dtypes
            or list(map(SHAPE_OF, moved)) != self._moved_shapes
            or list(map(IS_CPU, moved)).count(True) != count
            or list(map(IS_CONTIGUOUS, moved)).count(True) != count
            or True in map(IS_NEG, moved)
            or (any(map(IS_COMPLEX, self._moved_dtypes)) and True in map(IS_CONJ, moved))
        ):
            return False
        data = writer.base_address() + data_offset  # the slots lie inside buf (checked by write_into)
        list(map(ctypes.memmove, map(data.__add__, self._moved_rels), map(DATA_PTR, moved), self._moved_nbytes))
        return True

    def _write_each(self, writer: BlobWriter, data_offset: int, indices: Any) -> None:
        """Copy the given blobs one by one, each checked on its own (the general path)."""
        srcs, kinds, offsets = self._srcs, self._kinds, self._offsets
        for index in indices:
            src, kind, offset = srcs[index], kinds[index], data_offset + offsets[index]
            if kind.kind == BLOB_TENSOR:
                writer.tensor(index, offset, kind.nbytes, src, kind.dtype, kind.shape)
            elif kind.kind == BLOB_NDARRAY:
                writer.ndarray(index, offset, kind.nbytes, src, kind.dtype, kind.shape)
            elif kind.nbytes:
                writer.raw_bytes(index, offset, kind.nbytes, src)


def _padding(kinds: list[Kind], offsets: list[int]) -> list[tuple[int, np.ndarray[Any, Any]]]:
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
    with GcPaused():
        planner = Planner()
        try:
            try:
                root = planner.enc(state, None, 0)
            except (SerializationError, RecursionError):
                # Tensors are checked after the walk; one met before the walk failed
                # comes first.
                planner.finish_tensors()
                raise
            planner.finish_tensors()
            root_json = encode_tree(root)
        except RecursionError:
            raise SerializationError("state nests too deeply for Python's recursion limit", "state") from None
        kinds = planner.kinds
        offsets = list(accumulate(map(_K_SLOT, kinds), initial=0))  # blob i's slot starts at offsets[i]
        data_len = offsets[-2] + kinds[-1].nbytes if kinds else 0  # no padding after the last blob
        header, data_offset = render_header(kinds, data_len, root_json)
        return ShardLayout(header, data_offset, data_len, planner, offsets)


def encode(state: object) -> bytearray:
    """Plan and write ``state`` into a fresh bytearray of exactly ``layout.nbytes`` bytes."""
    layout = plan(state)
    out = bytearray(layout.nbytes)
    layout.write_into(out)
    return out
