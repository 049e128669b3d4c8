"""``torch.distributed.checkpoint`` (DCP) storage layer backed by memstore: ``MemStoreWriter`` and ``MemStoreReader``.

::

    import torch.distributed.checkpoint as dcp
    from trainer_client import Connection
    from trainer_client.dcp import MemStoreReader, MemStoreWriter

    store = Connection(address=addr)
    dcp.save(state_dict, storage_writer=MemStoreWriter("run-7", step, connection=store))
    dcp.load(state_dict, storage_reader=MemStoreReader("run-7", connection=store))  # newest complete step

The package's modules, one job each: :mod:`~trainer_client.dcp.storage_layer` (the two storage classes; the layout of a
step in the stores, how saves and loads run), :mod:`~trainer_client.dcp.plans` (checkpoint ids, the plan infos,
timelines), :mod:`~trainer_client.dcp.shard` (the shard's layout, the items a save plan writes and a load plan
reads) and :mod:`~trainer_client.dcp.metadata` (DCP's ``Metadata`` to tagged plain dicts and back, never pickled).
Their public names are importable from here.
"""

from trainer_client.dcp.metadata import MemStoreStorageInfo, decode_metadata, encode_metadata
from trainer_client.dcp.plans import MemStoreLoadPlanInfo, MemStoreSavePlanInfo, parse_checkpoint_id
from trainer_client.dcp.shard import COORDINATOR_RANK, SHARD_FORMAT
from trainer_client.dcp.storage_layer import MemStoreReader, MemStoreWriter
from trainer_client.errors import CheckpointExistsError

__all__ = [
    "COORDINATOR_RANK",
    "SHARD_FORMAT",
    "CheckpointExistsError",
    "MemStoreLoadPlanInfo",
    "MemStoreReader",
    "MemStoreSavePlanInfo",
    "MemStoreStorageInfo",
    "MemStoreWriter",
    "decode_metadata",
    "encode_metadata",
    "parse_checkpoint_id",
]
