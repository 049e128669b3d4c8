"""FSDP2 (fully_shard) with torch.distributed.checkpoint writing to memstore.

    torchrun --nproc-per-node 2 examples/dcp_fsdp.py --store 127.0.0.1:PORT --steps 10

DCP saves each rank's shards of the sharded (DTensor) state dict through ``MemStoreWriter`` and
loads them back through ``MemStoreReader``; resharding to another world size comes from DCP.
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from trainer_client import Connection, MemStoreReader, MemStoreWriter


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", help="HOST:PORT of the store; default: $MEMSTORE_STORE, else 127.0.0.1:7070")
    p.add_argument("--job", default="fsdp-example")
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    connection = Connection(args.store)  # how to reach the store: address, timeout, credentials (from the environment)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    step = 0
    reader = MemStoreReader(args.job, connection=connection)
    if reader.latest_step() is not None:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(0)}
        dcp.load(state, storage_reader=reader)  # DCP reshards if the world size changed
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = int(state["step"])
        print(f"rank {rank}: resumed from step {step}", flush=True)
    g = torch.Generator().manual_seed(rank)
    writer = MemStoreWriter(args.job, connection=connection)  # one writer (one store connection) for every step
    while step < args.steps:
        opt.zero_grad()
        model(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
        opt.step()
        step += 1
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)}
        dcp.save(state, storage_writer=writer, checkpoint_id=step)
    print(f"rank {rank}: done at step {step}", flush=True)
    writer.close()  # close store connections before the process group and the interpreter go
    reader.close()
    # Shut down while the interpreter is whole: gloo work objects still referenced by FSDP's state, if freed
    # during interpreter finalization, can abort the process at exit (SIGABRT after the work is done).
    dist.barrier()
    del model, opt
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
