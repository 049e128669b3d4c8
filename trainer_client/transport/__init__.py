"""How the client reaches its store besides the gRPC stub; internal to :class:`~trainer_client.CheckpointClient`.

Nothing here is public API: users import from ``trainer_client``. The modules, by job:

- ``local_control``: the client end of the same-host control channel (the save path's unary calls over a Unix socket);
- ``remote``: the path without shared memory, shard bytes over the store's bulk data channel.
"""
