"""The shard format: one rank's training state (a "shard") as safe, fast bytes.

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

from __future__ import annotations

import re
import struct
import sys
from typing import Any, Final

__all__ = [
    "ALIGNMENT",
    "ALIGN_MASK",
    "BLOB_BYTEARRAY",
    "BLOB_BYTES",
    "BLOB_NDARRAY",
    "BLOB_TENSOR",
    "BYTEORDER",
    "DOUBLE",
    "FORMAT_VERSION",
    "HEX_BYTES",
    "HEX_INT",
    "INT64_MIN",
    "MAGIC",
    "MAX_DEPTH",
    "MAX_DIM",
    "PRELUDE",
    "PRELUDE_SIZE",
    "READABLE_VERSIONS",
    "SMALL_COPY",
    "UINT64_END",
    "UNSUPPORTED_HINT",
    "ZEROS",
    "Buffer",
    "align",
]

FORMAT_VERSION: Final = 2
"""Version written. 2 added the compact blob table (``kinds`` + one index per blob)."""
READABLE_VERSIONS: Final = (1, 2)
MAGIC: Final = b"MSTSHRD1"
ALIGNMENT: Final = 64

MAX_DEPTH: Final = 256
"""Deepest container nesting accepted.

Lower than Python's default recursion limit (1000) on purpose: the walker and the JSON
codec both recurse once per level, and the caller's own stack counts against the
same limit. Real training states nest fewer than 20 levels.
"""

PRELUDE: Final = struct.Struct("<8sIQ")
PRELUDE_SIZE: Final = PRELUDE.size  # 20
DOUBLE: Final = struct.Struct("<d")
ZEROS: Final = bytes(ALIGNMENT)
SMALL_COPY: Final = 64 << 10
"""Blobs up to this size are copied with one memmove; larger ones with torch's
multi-threaded ``copy_``, whose fixed overhead (~5 us) only pays off for big tensors."""
INT64_MIN: Final = -(1 << 63)
UINT64_END: Final = 1 << 64
MAX_DIM: Final = 1 << 62
HEX_INT: Final = re.compile(r"-?[0-9a-f]+")
HEX_BYTES: Final = re.compile(r"(?:[0-9a-f]{2})*")
BYTEORDER: Final = sys.byteorder

BLOB_TENSOR: Final = "tensor"
BLOB_NDARRAY: Final = "ndarray"
BLOB_BYTES: Final = "bytes"
BLOB_BYTEARRAY: Final = "bytearray"

UNSUPPORTED_HINT: Final = "convert it to a dict/tensor, or pass it in a supported form"

# Anything exposing the buffer protocol (bytes, bytearray, memoryview, mmap, numpy array...).
# Python 3.11 has no static type for that (collections.abc.Buffer arrived in 3.12).
Buffer = Any


ALIGN_MASK: Final = ALIGNMENT - 1


def align(n: int) -> int:
    return (n + ALIGN_MASK) & ~ALIGN_MASK
