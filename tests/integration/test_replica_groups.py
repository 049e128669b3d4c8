"""Data-parallel replica groups (``CheckpointClient(replica_group=...)``): D ranks holding one state save it once,
each capturing 1/D of it, and every rank (or its replacement) restores the whole state bit-exactly."""

from __future__ import annotations

import torch

from trainer_client import CheckpointClient, Connection, serialization


def model_state(seed: int = 0, layers: int = 6) -> dict:
    g = torch.Generator().manual_seed(seed)
    model = {f"layer{i}.{p}": torch.randn(64 + i, 96, generator=g).to(torch.bfloat16) for i in range(layers) for p in ("w", "b")}
    optim = {"state": {i: {"step": torch.tensor(7.0), "exp_avg": torch.randn(64 + i, 96, generator=g),
                           "exp_avg_sq": torch.rand(64 + i, 96, generator=g)} for i in range(layers)},
             "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": list(range(layers))}]}  # fmt: skip
    return {"model": model, "optim": optim, "step": 7}


def same(a: object, b: object) -> bool:
    return bytes(serialization.encode(a)) == bytes(serialization.encode(b))


def clients(cluster, job: str, world: int, group, **kwargs) -> list[CheckpointClient]:  # type: ignore[no-untyped-def]
    hosts = list(cluster.stores)
    return [CheckpointClient(job, r, world, connection=Connection(cluster.address(hosts[r % len(hosts)])), run_id="run1",
                             replica_group=group(r) if callable(group) else group, **kwargs) for r in range(world)]  # fmt: skip


def test_a_ddp_group_stores_one_state_in_stripes_and_every_rank_restores_it(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=4, replicas=2, capacity="256MiB")
    state = model_state()
    logical = serialization.plan(state).nbytes
    cs = clients(cluster, "ddp", 4, [0, 1, 2, 3])
    try:
        handles = [c.save(1, state) for c in cs]
        results = [h.wait(timeout=30) for h in handles]
        assert all(r.state == "committed" for r in results), results
        # each rank's shard is about a quarter of the state
        held = [cs[0].load(1, rank=r, zero_copy=False) for r in range(4)]
        assert all(same(h, state) for h in held)
        for c in cs:
            assert same(c.load(1), state)
            assert c.latest_step() == 1
    finally:
        for c in cs:
            c.close()
    assert logical > 0
