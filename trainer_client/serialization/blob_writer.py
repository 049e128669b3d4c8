"""Copies the blobs of a planned shard into its buffer (:meth:`~trainer_client.serialization.encoder.ShardLayout.write_into`)."""

from __future__ import annotations

import ctypes
from typing import Any, NoReturn

import numpy as np
import torch

from trainer_client.errors import SerializationError
from trainer_client.serialization.dtypes import needs_raw_copy, raw_byte_view
from trainer_client.serialization.spec import SMALL_COPY

__all__ = ["BlobWriter", "raise_changed"]


def raise_changed(what: str, index: int) -> NoReturn:
    raise SerializationError(f"{what} changed dtype or shape between plan() and write_into()", f"blob #{index}")


class BlobWriter:
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

    def base_address(self) -> int:
        """The buffer's address (makes the uint8 alias on first use)."""
        if self.base is None:
            self.base = torch.frombuffer(self.mv, dtype=torch.uint8, count=self.nbytes)
            self.base_addr = self.base.data_ptr()
        return self.base_addr

    def tensor(self, index: int, offset: int, n: int, src: Any, dtype: Any, shape: tuple[int, ...]) -> None:
        if src.dtype != dtype or src.shape != shape:
            raise_changed("tensor", index)
        if n == 0:
            return
        base_addr = self.base_address()
        if src.is_cpu and src.is_contiguous() and not src.is_conj() and not src.is_neg():
            # Its n bytes are contiguous at data_ptr(); the slot lies inside
            # buf (checked by write_into). Small ones right away (~6x less overhead than
            # three torch ops), large ones in parallel at the end.
            if n <= SMALL_COPY:
                ctypes.memmove(base_addr + offset, src.data_ptr(), n)
            else:
                self.moves.append((base_addr + offset, src.data_ptr(), n))
            return
        assert self.base is not None
        if needs_raw_copy(dtype):
            self.base[offset : offset + n].view(*shape, src.element_size()).copy_(raw_byte_view(src))
        else:
            self.base[offset : offset + n].view(dtype).view(shape).copy_(src)

    def ndarray(self, index: int, offset: int, n: int, src: Any, dtype: Any, shape: tuple[int, ...]) -> None:
        if src.dtype != dtype or src.shape != shape:
            raise_changed("array", index)
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
