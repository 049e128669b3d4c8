"""The memstore.v1 wire contract: generated protobuf/gRPC code plus the hand-written rules both
sides of the wire must agree on (checksums, chunking, shard-key validation), and the conversion of
shard keys and manifests to the core's plain types (``manifests``), against which streams are verified.

``trainer_client`` depends on this package only, never on server internals.
"""
