"""Data-parallel replica groups (``CheckpointClient(replica_group=...)``): D ranks holding one state save it once,
each capturing 1/D of it, and every rank (or its replacement) restores the whole state bit-exactly."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

from memstore.testing import LocalCluster
from memstore.v1 import store_pb2 as pb
from memstore.v1.channel import store_stub
from trainer_client import CheckpointClient, Connection, serialization
from trainer_client.errors import InvalidArgumentError

pytestmark = pytest.mark.integration


def model_state(seed: int = 0, layers: int = 6) -> dict[str, Any]:
    """A small transformer-like state: bf16 weights, fp32 AdamW moments, a step counter."""
    g = torch.Generator().manual_seed(seed)
    model = {f"layer{i}.{p}": torch.randn(64 + i, 96, generator=g).to(torch.bfloat16) for i in range(layers) for p in ("w", "b")}
    optim = {"state": {i: {"step": torch.tensor(7.0), "exp_avg": torch.randn(64 + i, 96, generator=g),
                           "exp_avg_sq": torch.rand(64 + i, 96, generator=g)} for i in range(layers)},
             "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": list(range(layers))}]}  # fmt: skip
    return {"model": model, "optim": optim, "step": 7}


def encoded(state: object) -> bytes:
    return bytes(serialization.encode(state))


def listing(cluster: LocalCluster, host: str, job: str) -> list[pb.ShardInfo]:
    channel, stub = store_stub(cluster.address(host))
    try:
        return list(stub.List(pb.ListRequest(job_id=job), timeout=10).shards)
    finally:
        channel.close()


def ram_bytes(cluster: LocalCluster, job: str, cached: bool = False) -> int:
    """Bytes of ``job`` the stores hold, every copy counted: the R copies of each shard, or (``cached``) the copies
    pulled ahead of a restore."""
    return sum(s.manifest.nbytes for h in cluster.members for s in listing(cluster, h, job) if s.cached == cached)


def make_clients(cluster: LocalCluster, job: str, world: int, group: Callable[[int], Any] | None, **kw: Any) -> list[CheckpointClient]:
    hosts = list(cluster.members)
    return [CheckpointClient(job, r, world, connection=Connection(cluster.address(hosts[r % len(hosts)]), **kw), run_id="run1",
                             replica_group=None if group is None else group(r)) for r in range(world)]  # fmt: skip


def save_all(clients: list[CheckpointClient], step: int, states: list[Any], **kw: Any) -> list[Any]:
    results = [h.wait(timeout=60) for h in [c.save(step, s, **kw) for c, s in zip(clients, states, strict=True)]]
    assert all(r.committed for r in results), results
    return results


def close_all(clients: list[CheckpointClient]) -> None:
    for c in clients:
        c.close()


def test_a_ddp_group_holds_its_state_r_times_and_each_rank_captures_a_quarter(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=4, replicas=2, capacity="256MiB")
    state = model_state()
    logical = serialization.plan(state).nbytes
    deduped = make_clients(cluster, "ddp", 4, lambda r: [0, 1, 2, 3])
    plain = make_clients(cluster, "plain", 4, None)
    try:
        results = save_all(deduped, 1, [state] * 4)
        assert all(0.2 < r.nbytes / logical < 0.3 for r in results), [r.nbytes for r in results]
        save_all(plain, 1, [state] * 4)
        assert 1.9 < ram_bytes(cluster, "ddp") / logical < 2.2  # R copies of one state
        assert 7.9 < ram_bytes(cluster, "plain") / logical < 8.1  # today: W x R
        for c in deduped:
            assert c.latest_step() == 1
            assert encoded(c.load(1)) == encoded(state)
            assert encoded(c.load(1, zero_copy=False)) == encoded(state)
        assert encoded(deduped[0].load(1, rank=3)) == encoded(state)  # any rank's state, from anywhere
    finally:
        close_all(deduped + plain)


def test_after_a_host_loss_every_rank_and_the_replacement_restore_the_whole_state(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=4, replicas=2, capacity="256MiB")
    states = [model_state(seed=1), model_state(seed=2)]
    clients = make_clients(cluster, "loss", 4, lambda r: [0, 1, 2, 3])
    try:
        save_all(clients, 1, [states[0]] * 4)
        save_all(clients, 2, [states[1]] * 4)
    finally:
        close_all(clients)
    cluster.kill("h1")
    cluster.restart("h1")  # the replacement: same host id and address, empty RAM
    restarted = make_clients(cluster, "loss", 4, lambda r: [0, 1, 2, 3])
    try:
        for c in restarted:  # each a fresh process's client, none holding a stripe in its own RAM for rank 1
            assert c.latest_step() == 2
            assert encoded(c.load()) == encoded(states[1])
        assert encoded(restarted[1].load(1)) == encoded(states[0])
    finally:
        close_all(restarted)


def test_hsdp_like_groups_and_a_zero1_mixed_state(make_inprocess_cluster) -> None:
    """4 ranks as 2 shard groups x 2 replicate groups: ranks r and r+2 hold the same shard; and ZeRO-1, where the
    model is replicated over all 4 and each rank's optimizer state is its own."""
    cluster = make_inprocess_cluster(hosts=4, replicas=2, capacity="256MiB")
    shards = [model_state(seed=10), model_state(seed=11)]  # shard group member r % 2 holds shards[r % 2]
    hsdp = make_clients(cluster, "hsdp", 4, lambda r: [r % 2, r % 2 + 2])
    model = model_state(seed=20)["model"]
    zero1_states = [{"model": model, "optim": model_state(seed=30 + r)["optim"], "rank": r} for r in range(4)]
    zero1 = make_clients(cluster, "zero1", 4, lambda r: range(4))
    try:
        results = save_all(hsdp, 5, [shards[r % 2] for r in range(4)])
        logical = serialization.plan(shards[0]).nbytes
        assert all(0.4 < r.nbytes / logical < 0.6 for r in results)
        save_all(zero1, 5, zero1_states, replicated=["model"])
        for r in range(4):
            assert encoded(hsdp[r].load(5)) == encoded(shards[r % 2])
            restored = zero1[r].load(5)
            assert list(restored) == ["model", "optim", "rank"]
            assert encoded(restored) == encoded(zero1_states[r])
    finally:
        close_all(hsdp + zero1)


def test_stripes_travel_without_shared_memory_too(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="256MiB")
    state = model_state(seed=4)
    clients = make_clients(cluster, "remote", 2, lambda r: [0, 1], shared_memory=False)
    try:
        save_all(clients, 1, [state] * 2)
        for c in clients:
            assert not c.stats().shared_memory
            assert encoded(c.load(1)) == encoded(state)
    finally:
        close_all(clients)


def test_bad_replica_groups_are_refused_before_anything_is_saved(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=1, replicas=1, capacity="64MiB")
    address = Connection(cluster.address("h0"))
    for group, message in [([1, 2], r"does not include this rank \(0\)"), ([0, 4], r"outside 0\.\.3: \[4\]"), ([0, 0], "twice"),
                           ([], "empty")]:  # fmt: skip
        with pytest.raises(InvalidArgumentError, match=message):
            CheckpointClient("bad", 0, 4, connection=address, replica_group=group)
    with pytest.raises(InvalidArgumentError, match=r"verify_replicas=True needs replica_group= to be a torch\.distributed"):
        CheckpointClient("bad", 0, 4, connection=address, replica_group=[0, 1], verify_replicas=True)
    with pytest.raises(InvalidArgumentError, match=r"torch\.distributed is not initialized"):
        CheckpointClient("bad", 0, 4, connection=address, replica_group=object())
    with CheckpointClient("bad", 0, 4, connection=address) as c, pytest.raises(InvalidArgumentError, match="no replica_group given"):
        c.save(1, {"a": torch.ones(1)}, replicated=["a"])
    with (
        CheckpointClient("bad", 0, 2, connection=address, replica_group=[0, 1]) as c,
        pytest.raises(InvalidArgumentError, match=r"lacks: \['b'\]"),
    ):
        c.save(1, {"a": torch.ones(1)}, replicated=["b"])
    assert ram_bytes(cluster, "bad") == 0


def test_spilled_stripes_restore_after_every_store_restarted(make_inprocess_cluster, tmp_path) -> None:
    """Spill, retention and timelines treat a stripe as any shard: a rollback (a new timeline) restores the new save,
    never a mix; a step spilled and read back from the durable tier into empty stores restores whole."""
    from memstore.testing import wait_for

    root = tmp_path / "spill"
    args = ["--spill", f"file://{root}", "--spill-every-steps", "1"]
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="256MiB", extra_args=args)
    states = {step: model_state(seed=step) for step in (1, 2, 3, 4)}
    clients = make_clients(cluster, "spilled", 2, lambda r: [0, 1])
    try:
        for step in (1, 2, 3):
            save_all(clients, step, [states[step]] * 2)
        save_all(clients, 2, [states[4]] * 2)  # a rollback to step 2 with other contents: a new timeline
        for c in clients:
            assert c.latest_step() == 2
            assert encoded(c.load()) == encoded(states[4])
        timeline = save_all(clients, 3, [states[3]] * 2)[0].timeline
    finally:
        close_all(clients)
    step3 = root / "spilled" / "step-000000000003"

    def spilled_3() -> bool:  # both ranks of the new timeline's step 3 (the old timeline's step 3 may be spilled already)
        names = []
        for p in step3.glob("rank-*.json"):
            try:
                names.append(json.loads(p.read_text())["timeline"])
            except (FileNotFoundError, ValueError):  # replaced as we read it: look again
                return False
        return names == [timeline] * 2

    wait_for(spilled_3, timeout=60, what="the new timeline's step 3 spilled")
    for h in cluster.stores:
        cluster.kill(h)
    for h in cluster.stores:
        cluster.restart(h)
    restarted = make_clients(cluster, "spilled", 2, lambda r: [0, 1])
    try:
        for c in restarted:
            assert c.latest_step() == 3
            assert encoded(c.load()) == encoded(states[3])
            assert c.stats().last_load_source in ("durable", "h0", "h1")
    finally:
        close_all(restarted)


def test_each_store_assembles_its_members_group_ahead_and_gives_the_cache_up_first(make_inprocess_cluster) -> None:
    """Once a save settles, each store pulls the group's other stripes into spare room as cached copies, so a restore
    reads every stripe locally; cached copies are not among the R, and a save that needs their room drops them first."""
    from memstore.testing import wait_for

    cluster = make_inprocess_cluster(hosts=4, replicas=2, capacity="64MiB")
    state = {f"t{i}": torch.randn(64 << 10) for i in range(8)}  # 2 MiB: each stripe 512 KiB
    logical = serialization.plan(state).nbytes
    clients = make_clients(cluster, "ahead", 4, lambda r: [0, 1, 2, 3])
    try:
        save_all(clients, 1, [state] * 4)

        def local_ranks(host: str) -> set[int]:
            return {s.manifest.key.rank for s in listing(cluster, host, "ahead") if s.manifest.key.step == 1}

        wait_for(lambda: all(local_ranks(h) == {0, 1, 2, 3} for h in cluster.members), timeout=30, what="every store holding all 4 stripes")
        assert 1.9 < ram_bytes(cluster, "ahead") / logical < 2.2  # still R copies of the state, besides the cache
        assert ram_bytes(cluster, "ahead", cached=True) > 0
        for c in clients:
            assert encoded(c.load(1)) == encoded(state)
        ranks = {host: {s.manifest.key.rank for s in listing(cluster, host, "ahead") if not s.cached} for host in cluster.members}
        assert all(len(held) == 2 for held in ranks.values())  # each store: its member's stripe and one replica (R=2)
        # A restart in place: every member's restore reads its 4 stripes from its own store, none from a peer, and opens
        # them in one call (OpenRequest.also) and releases them in one.
        copies = sum(len(listing(cluster, h, "ahead")) for h in cluster.members)
        restarted = make_clients(cluster, "ahead", 4, lambda r: [0, 1, 2, 3])
        try:
            for c in restarted:
                calls: list[str] = []
                control = c._link.control
                c._link.control = lambda name, *a, control=control, calls=calls, **k: (calls.append(name), control(name, *a, **k))[1]
                assert encoded(c.load(1)) == encoded(state) and c.stats().last_load_source == c.stats().store_host
                assert calls == ["Open", "Release"]
        finally:
            close_all(restarted)
        assert sum(len(listing(cluster, h, "ahead")) for h in cluster.members) == copies  # nothing was pulled to restore
    finally:
        close_all(clients)
