"""The safe shard format: one rank's training state as bytes, never pickled (the format: :mod:`.spec`).

Public surface (what ``__all__`` lists): :func:`plan` a state into a :class:`ShardLayout` and
``write_into`` a buffer, or :func:`encode` it into a fresh bytearray; :func:`decode` it back;
:func:`peek_header` reads the header alone; the constants name the format. The modules, by job:

==================  ================================================================
``spec``            the format: layout, header keys, tree tags, and its constants
``dtypes``          which torch and numpy dtypes it stores, and how they are named
``walk``            the walk of a state: validation, blob list, alike tensors described once
``header``          the header: rendered for the encoder, parsed and validated for the decoder
``encoder``         :func:`plan`, :class:`ShardLayout` (``write_into``), :func:`encode`
``blob_writer``     the copies of blobs into a shard buffer
``decoder``         :func:`decode` (:class:`Span`: where a blob's bytes lie), :func:`peek_header`
``memory``          byte views, parallel memmove (hashing chunks as it copies), the GC pause
==================  ================================================================
"""

from trainer_client.serialization.decoder import Span, decode, peek_header
from trainer_client.serialization.encoder import ShardLayout, encode, plan
from trainer_client.serialization.memory import ChunkSums
from trainer_client.serialization.spec import ALIGNMENT, FORMAT_VERSION, MAGIC, MAX_DEPTH, READABLE_VERSIONS

__all__ = [
    "ALIGNMENT",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_DEPTH",
    "READABLE_VERSIONS",
    "ChunkSums",
    "ShardLayout",
    "Span",
    "decode",
    "encode",
    "peek_header",
    "plan",
]
