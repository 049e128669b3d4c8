"""Never a mixed step: a restore takes every rank's shard from one save, across rollbacks, restarts and group loss.

Real store processes on 127.0.0.1 (4 hosts, R=2: groups {h0,h1} and {h2,h3}); the ranks are
CheckpointClients in this process. A "restart" of the job makes new clients (a new run, so a new
timeline), as a scheduler restarting the trainer processes would.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memstore.testing import LocalCluster, wait_for
from memstore.v1 import store_pb2 as pb
from memstore.v1 import store_pb2_grpc as pb_grpc
from memstore.v1.channel import insecure_channel
from trainer_client import CheckpointClient

pytestmark = pytest.mark.integration
JOB = "timelines"
WORLD = 4


def state(step: int, rank: int, salt: int = 0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1024,), float(1000 * salt + 10 * step + rank)), "step": torch.tensor(step)}


def value(loaded: dict[str, torch.Tensor]) -> float:
    return float(loaded["w"][0])


def clients(cluster: LocalCluster, run_id: str | None = None) -> list[CheckpointClient]:
    """One client per rank, rank r on host h<r>. A start of the job in this process: a restart passes a new run id,
    as a restarted multi-process job gets one from its process group."""
    return [CheckpointClient(JOB, r, WORLD, store=cluster.address(f"h{r}"), timeout=30, run_id=run_id) for r in range(WORLD)]


def save_all(cs: list[CheckpointClient], step: int, salt: int = 0, ranks: range = range(WORLD)) -> None:
    handles = [cs[r].save(step, state(step, r, salt)) for r in ranks]
    for h in handles:
        h.wait(timeout=60)


def versions_on(cluster: LocalCluster, host: str) -> set[tuple[int, str]]:
    with insecure_channel(cluster.address(host)) as ch:
        resp = pb_grpc.StoreStub(ch).List(pb.ListRequest(job_id=JOB), timeout=10)
    return {(i.manifest.key.step, i.manifest.key.timeline) for i in resp.shards}


def test_partial_resave_after_rollback_never_mixes(make_inprocess_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_inprocess_cluster(hosts=4, replicas=2, capacity="256MiB", keep=3)
    cs = clients(cluster)
    for step in (1, 2, 3):
        save_all(cs, step)
    # A loss spike: every rank goes back to step 2; ranks 0-1 re-save step 3 with new content, ranks 2-3 die first.
    for r, c in enumerate(cs):
        assert value(c.load(step=2)) == 20 + r
    save_all(cs, 3, salt=1, ranks=range(2))
    for c in cs:
        c.close()

    restarted = clients(cluster, run_id="restart-1")
    assert restarted[0].latest_step() == 3
    point = restarted[0].restore_point()
    assert point is not None and point.step == 3
    got = [value(c.load()) for c in restarted]
    assert got == [30 + r for r in range(WORLD)], f"step 3 mixed two saves: {got}"  # the old save, whole
    assert [value(c.load(step=3)) for c in restarted] == got

    # The restarted job completes its own save of step 3: from then on that is the one, and the old one goes.
    save_all(restarted, 3, salt=2)
    assert [value(c.load()) for c in restarted] == [2030 + r for r in range(WORLD)]
    new_timeline = restarted[0].timeline
    for host in ("h0", "h1", "h2", "h3"):
        wait_for(
            lambda host=host: {t for s, t in versions_on(cluster, host) if s == 3} == {new_timeline},
            timeout=30,
            what=f"{host} to drop the superseded saves of step 3",
        )
    for c in restarted:
        c.close()


def test_group_loss_resume_from_older_step_resave_and_wait(make_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The chaos run's sequence: a whole group is lost, the job resumes from an older (durable) step, re-saves, waits.

    Store processes: the kill is the point (an in-process stop once left a load with no restorable step right
    after latest_step() had answered 4, on a loaded machine)."""
    durable = tmp_path / "durable"
    args = ["--spill", f"file://{durable}", "--spill-every-steps", "4", "--spill-keep-last", "3", "--repair-interval", "0.5"]
    cluster = make_cluster(hosts=4, replicas=2, capacity="256MiB", keep=2, extra_args=args)
    cs = clients(cluster)
    for step in range(1, 7):
        save_all(cs, step)
    wait_for(lambda: cs[0].restore_point(4) is not None and all((durable / JOB / "step-000000000004" / f"rank-{r:06d}.json").exists()
             for r in range(WORLD)), timeout=60, what="step 4 spilled by every rank")  # fmt: skip
    for c in cs:
        c.close()

    cluster.kill("h0")
    cluster.kill("h1")  # group {h0, h1} is gone: ranks 0-1 lost steps 5-6 from RAM; ranks 2-3 still hold theirs
    cluster.restart("h0")
    cluster.restart("h1")

    restarted = clients(cluster, run_id="restart-1")
    assert restarted[0].latest_step() == 4  # step 4 from the durable tier (and h2/h3's RAM)
    assert [value(c.load()) for c in restarted] == [40 + r for r in range(WORLD)]
    for step in (5, 6):
        save_all(restarted, step, salt=1)  # every rank's wait() succeeds: nothing of the old run shadows the new saves
    point = restarted[0].restore_point()
    assert point is not None and (point.step, point.timeline) == (6, restarted[0].timeline)
    assert [value(c.load()) for c in restarted] == [1060 + r for r in range(WORLD)]
    old_timeline = cs[0].timeline
    for host in ("h2", "h3"):
        wait_for(
            lambda host=host: not any(t == old_timeline and s >= 5 for s, t in versions_on(cluster, host)),
            timeout=30,
            what=f"{host} to drop the abandoned steps 5-6 of the old run",
        )
    for c in restarted:
        c.close()


def test_ranks_that_never_agree_are_told_why(make_inprocess_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="64MiB")
    cs = [CheckpointClient(JOB, r, 2, store=cluster.address(f"h{r}"), run_id=f"run-of-rank-{r}") for r in range(2)]
    for r, c in enumerate(cs):
        c.save(1, state(1, r)).wait(timeout=30)
    assert cs[0].latest_step() is None
    with pytest.raises(Exception, match="different timelines"):
        cs[0].load()
    for c in cs:
        c.close()


def steps_of_rank(cluster: LocalCluster, host: str, rank: int) -> set[int]:
    with insecure_channel(cluster.address(host)) as ch:
        resp = pb_grpc.StoreStub(ch).List(pb.ListRequest(job_id=JOB), timeout=10)
    return {i.manifest.key.step for i in resp.shards if i.manifest.key.rank == rank}


def test_resaves_after_a_group_loss_outrank_the_abandoned_higher_steps(make_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The chaos failure, pinned: group {h2,h3} lost at step 11, the job resumes from step 8 (durable), ranks re-save 9.

    Rank 1's store h1 still holds the killed run's steps 10-11 of rank 0 (rank 0 has not re-saved yet).
    Retention ordered by step number kept those and evicted rank 1's fresh step 9 right after it
    settled, so rank 1's ``wait()`` found nothing ("not held by store h1") and the job crashed.
    """
    durable = tmp_path / "durable"
    args = ["--spill", f"file://{durable}", "--spill-every-steps", "4", "--spill-keep-last", "3", "--repair-interval", "0.5"]
    cluster = make_cluster(hosts=4, replicas=2, capacity="256MiB", keep=2, extra_args=args)  # two hosts SIGKILLed at once
    cs = clients(cluster)
    for step in range(1, 12):
        save_all(cs, step)
    wait_for(lambda: all((durable / JOB / "step-000000000008" / f"rank-{r:06d}.json").exists() for r in range(WORLD)),
             timeout=60, what="step 8 spilled by every rank")  # fmt: skip
    for c in cs:
        c.close()
    cluster.kill("h2")
    cluster.kill("h3")
    cluster.restart("h2")
    cluster.restart("h3")

    restarted = clients(cluster, run_id="restart-1")
    assert restarted[0].latest_step() == 8
    assert [value(c.load(8)) for c in restarted] == [80 + r for r in range(WORLD)]
    for step in (9, 10):
        save_all(restarted, step, salt=1, ranks=range(1, WORLD))  # rank 0 lags behind
    # Let h1's retention run over what it holds (rank 0's abandoned 11-12 and rank 1's new 9-10), then look.
    wait_for(lambda: len(steps_of_rank(cluster, "h1", 0) | steps_of_rank(cluster, "h1", 1)) <= 3, timeout=30, what="h1's retention pass")
    assert {9, 10} <= steps_of_rank(cluster, "h1", 1), "the new run's fresh saves were evicted in favour of the abandoned run's"
    for step in (9, 10):
        save_all(restarted, step, salt=1, ranks=range(1))
    assert restarted[0].latest_step() == 10
    assert [value(c.load()) for c in restarted] == [1100 + r for r in range(WORLD)]  # step 10 of the new run
    for c in restarted:
        c.close()


def test_a_failed_save_retried_keeps_the_rank_on_the_job_timeline(make_inprocess_cluster) -> None:  # type: ignore[no-untyped-def]
    from trainer_client.errors import SerializationError

    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="64MiB")
    cs = [CheckpointClient(JOB, r, 2, store=cluster.address(f"h{r}"), run_id="retry") for r in range(2)]
    for r, c in enumerate(cs):
        c.save(1, state(1, r)).wait(timeout=30)
    with pytest.raises(SerializationError):
        cs[1].save(2, {"bad": object()})  # rank 1's save of step 2 fails before reaching the store ...
    for r, c in enumerate(cs):
        c.save(2, state(2, r)).wait(timeout=30)  # ... and is retried: still a save forward, not a rollback
    assert cs[0].timeline == cs[1].timeline == "retry.0"
    assert cs[0].latest_step() == 2
    for c in cs:
        c.close()
