"""DDP under torchrun, one memstore shard per rank, restored automatically after a restart.

    torchrun --nproc-per-node 2 examples/ddp_torchrun.py --store 127.0.0.1:PORT --steps 20

Each rank talks to the store on its own host (here all ranks share one machine, so one address). The client finds
the job's process group by itself (torchrun's default group: ``group=`` need not be passed): ``latest_step()`` is the
newest step every rank can restore, agreed over it (each rank asks only its own store), so all ranks resume from the
same step, and each save's small async all-reduce tells the stores which step every rank saved (retention asks nobody).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer_client import CheckpointClient, Connection, ResumableDataLoader, TrainingState


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", help="HOST:PORT of the store; default: $MEMSTORE_STORE, else 127.0.0.1:7070")
    p.add_argument("--job", default="ddp-example")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    connection = Connection(args.store)  # how to reach the store: address, timeout, credentials (from the environment)

    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    data = [(torch.randn(16), torch.randint(0, 4, ()).item()) for _ in range(512)]
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = ResumableDataLoader(data, batch_size=16, shuffle=True, seed=0, rank=rank, world_size=world)  # type: ignore[arg-type]
    ts = TrainingState(model=model, optimizer=opt, loader=loader)

    with CheckpointClient(args.job, rank=rank, world_size=world, connection=connection) as client:  # agrees over the default group
        step = 0
        latest = client.latest_step()  # a collective: every rank calls it; each asks only its own store
        if latest is not None:
            step = ts.restore(client.load(latest))["step"]
            print(f"rank {rank}: resumed from step {step}", flush=True)
        pending = None
        while step < args.steps:
            for x, y in loader:
                opt.zero_grad()
                nn.functional.cross_entropy(ddp(x), y).backward()
                opt.step()
                step += 1
                if pending is not None:
                    pending.wait(timeout=60)
                pending = client.save(step, ts.capture(step=step, epoch=loader.epoch))
                if step >= args.steps:
                    break
        if pending is not None:
            pending.wait(timeout=60)
    print(f"rank {rank}: done at step {step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
