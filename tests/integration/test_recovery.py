"""Host loss, replacement, repair and whole-group loss against real store processes on 127.0.0.1."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import pytest

from memstore.testing import LocalCluster, wait_for
from memstore.v1 import store_pb2 as pb
from tests.states import assert_same, rank_state
from trainer_client import CheckpointClient
from trainer_client.errors import NoCheckpointError

pytestmark = pytest.mark.integration

JOB = "recovery-job"
HOSTS, R, WORLD = 4, 2, 8


def host_of(rank: int) -> str:
    return f"h{rank // (WORLD // HOSTS)}"


def clients(cluster: LocalCluster, ranks: range | list[int], host: str | None = None) -> list[CheckpointClient]:
    return [CheckpointClient(JOB, r, WORLD, store=cluster.address(host or host_of(r)), timeout=20) for r in ranks]


def save_steps(cluster: LocalCluster, steps: range, ranks: range | list[int] = range(WORLD)) -> None:
    cs = clients(cluster, ranks)
    try:
        for step in steps:
            handles = [c.save(step, rank_state(c.rank, step)) for c in cs]
            for h in handles:
                info = h.wait(timeout=30)
                assert info.copies == R
    finally:
        for c in cs:
            c.close()


def held_keys(cluster: LocalCluster, host: str) -> set[tuple[int, int]]:
    from memstore.v1 import store_pb2_grpc as pb_grpc
    from memstore.v1.channel import insecure_channel

    with insecure_channel(cluster.address(host)) as ch:
        resp = pb_grpc.StoreStub(ch).List(pb.ListRequest(job_id=JOB), timeout=5)
    return {(s.manifest.key.step, s.manifest.key.rank) for s in resp.shards if s.verified}


# gRPC streams (the opt-in data plane) in the slow stage: ~18 s of the default suite, which keeps TCP, the default
@pytest.mark.parametrize("data_plane", ["tcp", pytest.param("grpc", marks=pytest.mark.slow)])
def test_host_loss_replacement_and_repair(make_cluster, data_plane: str) -> None:
    cluster = make_cluster(hosts=HOSTS, replicas=R, capacity="256MiB", keep=3, extra_args=["--data-plane", data_plane])
    save_steps(cluster, range(1, 4))

    # Placement check: every rank's shards live on both members of its group (h0,h1) / (h2,h3).
    assert {(3, r) for r in range(4)} <= held_keys(cluster, "h0") and {(3, r) for r in range(4)} <= held_keys(cluster, "h1")

    cluster.kill("h1")
    survivors = [r for r in range(WORLD) if host_of(r) != "h1"]
    cs = clients(cluster, survivors)
    try:
        assert {c.latest_step() for c in cs} == {3}
        for c in cs:
            assert_same(c.load(), rank_state(c.rank, 3))
    finally:
        for c in cs:
            c.close()

    # The replacement (same id and address, empty RAM) serves its ranks step 3 ...
    cluster.restart("h1")
    cs = clients(cluster, [2, 3])
    try:
        for c in cs:
            assert_same(c.load(3), rank_state(c.rank, 3))
    finally:
        for c in cs:
            c.close()

    # ... and repairs itself back to R copies of its group's newest steps without any client action.
    wanted = {(step, r) for step in (2, 3) for r in range(4)}
    wait_for(lambda: wanted <= held_keys(cluster, "h1"), timeout=30, what="h1 to repair its group's shards")

    # Now losing the other member of the group loses nothing.
    cluster.kill("h0")
    cs = clients(cluster, range(WORLD), host="h1")
    try:
        assert cs[0].latest_step() == 3
        for c in cs:
            assert_same(c.load(3), rank_state(c.rank, 3))
    finally:
        for c in cs:
            c.close()


def test_whole_group_loss_never_reports_a_partial_step(make_cluster) -> None:
    cluster = make_cluster(hosts=HOSTS, replicas=R, capacity="256MiB", keep=3)
    save_steps(cluster, range(1, 3))
    save_steps(cluster, range(3, 4), ranks=range(0, 4))  # step 3 is partial: ranks 4..7 never saved it

    cs = clients(cluster, range(WORLD))
    try:
        with ThreadPoolExecutor(WORLD) as pool:
            answers = list(pool.map(lambda c: c.latest_step(), cs))
        assert answers == [2] * WORLD  # all ranks agree, and the partial step 3 is never reported
    finally:
        for c in cs:
            c.close()

    # Both hosts of group (h2, h3) die; there is no durable tier, so no step is complete any more.
    cluster.kill("h2")
    cluster.kill("h3")
    c = CheckpointClient(JOB, 0, WORLD, store=cluster.address("h0"), timeout=20)
    try:
        assert c.latest_step() is None
        with pytest.raises(NoCheckpointError):
            c.load()
    finally:
        c.close()


def test_all_ranks_agree_while_a_host_dies(make_cluster) -> None:
    cluster = make_cluster(hosts=HOSTS, replicas=R, capacity="256MiB", keep=3)
    save_steps(cluster, range(1, 3))
    cs = clients(cluster, [r for r in range(WORLD) if host_of(r) != "h3"])
    try:
        with ThreadPoolExecutor(len(cs) + 1) as pool:
            futures = [pool.submit(c.latest_step) for c in cs]
            pool.submit(cluster.kill, "h3").result()
            answers = [f.result() for f in futures]
        assert set(answers) == {2}
    finally:
        for c in cs:
            c.close()


def test_two_failures_in_different_groups_lose_nothing(make_cluster) -> None:
    cluster = make_cluster(hosts=HOSTS, replicas=R, capacity="256MiB", keep=3)
    save_steps(cluster, range(1, 3))
    cluster.kill("h1")  # group (h0, h1)
    cluster.kill("h2")  # group (h2, h3)
    cs = clients(cluster, range(WORLD), host="h3")
    try:
        assert cs[0].latest_step() == 2
        for c in cs:
            assert_same(c.load(2), rank_state(c.rank, 2))
    finally:
        for c in cs:
            c.close()


def test_a_restore_after_replacement_goes_before_repair(make_cluster) -> None:
    """While a trainer waits for a shard, the replacement's repair starts no pull of its own (restores first).

    The replacement's first repair pass is held back a second; the trainer's restore of step 1 is in flight by
    then (held 3 s before its pull). Repair may pull step 2 only after that restore's pull is done.
    """
    cluster = make_cluster(hosts=2, replicas=2, capacity="128MiB")
    with CheckpointClient("first", 0, 1, store=cluster.address("h0"), run_id="r", timeout=20) as c:
        for step in (1, 2):
            c.save(step, rank_state(0, step, scale=8)).wait(timeout=30)
    cluster.restart("h0", env={"MEMSTORE_FAULTS": "repair.before_pass=stall:1.5,fetch.before_pull=stall:3"}, wait=False)
    cluster.wait_healthy("h0", timeout=30)
    with CheckpointClient("first", 0, 1, store=cluster.address("h0"), run_id="r", timeout=20) as c:
        assert_same(c.load(1), rank_state(0, 1, scale=8))
        wait_for(lambda: c.latest_step() == 2 and (2, 0) in held_keys_of(cluster, "h0", "first"), timeout=30, what="repair of step 2")

    # the copy is listed before its pull is logged (the store registers it, then logs it): wait for the line too
    def logged_repair() -> str:
        tail = cluster.log_tail("h0", 400)
        return tail if "repair: pulled" in tail else ""

    log = wait_for(logged_repair, timeout=10, what="the repair's log line")
    fetched = log.find("fetch: pulled")
    repaired = log.find("repair: pulled")
    assert fetched != -1 and repaired != -1, log
    assert fetched < repaired, f"repair pulled before the waiting restore:\n{log}"


def held_keys_of(cluster: LocalCluster, host: str, job: str) -> set[tuple[int, int]]:
    from memstore.v1 import store_pb2_grpc as pb_grpc
    from memstore.v1.channel import insecure_channel

    with insecure_channel(cluster.address(host)) as ch:
        resp = pb_grpc.StoreStub(ch).List(pb.ListRequest(job_id=job), timeout=5)
    return {(s.manifest.key.step, s.manifest.key.rank) for s in resp.shards if s.verified}


def test_a_replacement_pulls_from_every_holder_at_once(make_cluster) -> None:
    # One group of three (R=3): a replaced h2 can pull from h0 and h1. Each source stalls the first shard it
    # serves for 5 s (after its first 1 MiB piece: the shards are 2 MiB). Pulls one at a time land one shard,
    # wait 5 s for the other source's stalled one, then the rest; pulls at once land most shards meanwhile.
    cluster = make_cluster(hosts=3, replicas=3, capacity="256MiB", keep=2, env={"MEMSTORE_FAULTS": "serve.after_chunk:1=stall:5"})
    cs = [CheckpointClient(JOB, r, 6, store=cluster.address(f"h{r // 2}"), timeout=20) for r in range(6)]
    try:
        for step in (1, 2):
            for h in [c.save(step, rank_state(c.rank, step, scale=128)) for c in cs]:
                assert h.wait(timeout=30).copies == 3
    finally:
        for c in cs:
            c.close()
    cluster.kill("h2")
    cluster.restart("h2")
    wait_for(lambda: len(held_keys(cluster, "h2")) == 12, timeout=60, what="h2 repaired")
    lines = [line for line in (cluster.workdir / "h2.log").read_text().splitlines() if "repair: pulled" in line]
    assert len(lines) == 12 and {line.rsplit(" from ", 1)[1].strip() for line in lines} == {"h0", "h1"}
    landed = sorted(datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp() for line in lines)
    early = sum(1 for t in landed if t - landed[0] < 2.5)
    assert early >= 6, f"only {early} of 12 shards landed within 2.5 s of the first: {[round(t - landed[0], 2) for t in landed]}"
    assert landed[-1] - landed[0] >= 2.5  # and the stalls did happen
