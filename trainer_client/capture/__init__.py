"""How a save's bytes reach the store's memory and a restore's reach a device; internal to :class:`~trainer_client.CheckpointClient`.

Nothing here is public API: users import from ``trainer_client``. The modules, by job:

- ``cuda``: the one seam for CUDA runtime calls (host-memory registration), which tests replace with a fake; which blobs
  of a planned shard are device tensors (``device_part``);
- ``ring``: the client's capture ring, store segments mapped and registered once, the next save's reserved ahead; each
  save's lease, taken, then committed or given back;
- ``device_save``: one save's capture, CUDA tensors copied straight into the store's memory, then commit or send (the
  callables its ``Destination`` holds);
- ``device_restore``: restores onto a device, through registered memory or the bounce ring.
"""
