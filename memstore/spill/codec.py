"""Per-chunk encodings of spilled shards.

``none`` writes the bytes as they are (zero copies). ``zstd`` compresses each chunk; the
``-shuffle2`` / ``-shuffle4`` variants first transpose the chunk's bytes by element size (all first
bytes, then all second bytes, ...), which groups the sign/exponent bytes of bf16/fp16 (2) or fp32
(4) values so zstd finds far more repetition in real weights. Checksums always cover the original
bytes: a decoded chunk is verified exactly like a chunk from RAM.
"""

from __future__ import annotations

import numpy as np
import zstandard

from memstore.errors import CodecError
from memstore.v1.integrity import SPILL_CODECS

CODECS = SPILL_CODECS
ZSTD_LEVEL = 3


def _shuffle_width(codec: str) -> int:
    return int(codec.rsplit("shuffle", 1)[1]) if "shuffle" in codec else 1


def check(codec: str) -> str:
    if codec not in CODECS:
        raise CodecError(f"spill codec {codec!r} is unknown: expected one of {', '.join(CODECS)}")
    return codec


def encode(codec: str, data: memoryview) -> memoryview | bytes:
    if codec == "none":
        return data
    width = _shuffle_width(codec)
    if width > 1 and len(data) and len(data) % width == 0:
        arr = np.frombuffer(data, dtype=np.uint8).reshape(-1, width)
        data = np.ascontiguousarray(arr.T).data.cast("B")
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)


def decode(codec: str, data: bytes | memoryview, raw_len: int) -> bytes | memoryview:
    check(codec)
    if raw_len < 0:
        raise CodecError(f"chunk length {raw_len} is negative")
    if codec == "none":
        if len(data) != raw_len:
            raise CodecError(f"stored chunk has {len(data)} bytes, expected {raw_len}")
        return data
    try:
        # A frame that records its content size is decompressed into a buffer of that size whatever
        # max_output_size says: refuse one that claims more than the chunk before anything is allocated.
        declared = zstandard.frame_content_size(data)
        if declared > raw_len:
            raise CodecError(f"chunk's frame declares {declared} decompressed bytes, expected {raw_len}")
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=raw_len)
    except zstandard.ZstdError as exc:
        raise CodecError(f"chunk does not decompress: {exc}") from None
    if len(out) != raw_len:
        raise CodecError(f"chunk decompressed to {len(out)} bytes, expected {raw_len}")
    width = _shuffle_width(codec)
    if width > 1 and raw_len and raw_len % width == 0:
        arr = np.frombuffer(out, dtype=np.uint8).reshape(width, -1)
        return np.ascontiguousarray(arr.T).data.cast("B")
    return out
