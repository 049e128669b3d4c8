"""The smallest memstore integration: a single-process training loop that checkpoints every step.

    memstore local-cluster --hosts 2 --replicas 2 --endpoints-file /tmp/ep.json &   # or any store
    python examples/plain_loop.py --store 127.0.0.1:PORT --steps 20
    python examples/plain_loop.py --store 127.0.0.1:PORT --steps 40     # resumes at step 20

On start it restores the newest restorable step, if any; every step it saves the whole training
state (model, optimizer, scheduler, RNGs, data position) and waits for the previous save's
replication only when the next save is due.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from trainer_client import CheckpointClient, Connection, ResumableDataLoader, TrainingState


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", help="HOST:PORT of the store; default: $MEMSTORE_STORE, else 127.0.0.1:7070")
    p.add_argument("--job", default="plain-loop")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    connection = Connection(args.store)  # how to reach the store: address, timeout, credentials (from the environment)

    torch.manual_seed(0)
    data = [(torch.randn(16), torch.randint(0, 4, ()).item()) for _ in range(256)]
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    loader = ResumableDataLoader(data, batch_size=32, shuffle=True, seed=0)  # type: ignore[arg-type]
    ts = TrainingState(model=model, optimizer=opt, scheduler=sched, loader=loader)

    with CheckpointClient(args.job, rank=0, world_size=1, connection=connection) as client:
        step = 0
        latest = client.latest_step()
        if latest is not None:
            step = ts.restore(client.load(latest))["step"]
            print(f"resumed from step {step}")
        pending = None
        while step < args.steps:
            for x, y in loader:
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                sched.step()
                step += 1
                if pending is not None:
                    pending.wait(timeout=60)
                pending = client.save(step, ts.capture(step=step, epoch=loader.epoch))
                if step >= args.steps:
                    break
        if pending is not None:
            pending.wait(timeout=60)
        print(f"done at step {step}, loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
