"""The durable tier against real stores (in process where no SIGKILL is needed): file:// and S3 (moto server on 127.0.0.1)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from memstore.testing import LocalCluster, wait_for
from tests.states import assert_same, rank_state
from trainer_client import CheckpointClient

pytestmark = pytest.mark.integration
WORLD = 4  # 2 ranks on each of 2 hosts


def host_of(rank: int) -> str:
    return f"h{rank // 2}"


def save_steps(cluster: LocalCluster, job: str, steps: range, metrics: dict[int, float] | None = None, scale: int = 1) -> None:
    clients = [CheckpointClient(job, r, WORLD, store=cluster.address(host_of(r))) for r in range(WORLD)]
    try:
        for step in steps:
            m = {"loss": metrics[step]} if metrics else None
            for h in [c.save(step, rank_state(c.rank, step, scale=scale), metrics=m) for c in clients]:
                h.wait(timeout=30)
    finally:
        for c in clients:
            c.close()


def published(root: Path, job: str) -> dict[int, set[int]]:
    """The ranks' manifests published per step. Retention deletes step directories as this lists them: a listing a
    deletion cut short is taken again."""
    while True:
        out: dict[int, set[int]] = {}
        try:
            for p in root.glob(f"{job}/step-*/rank-*.json"):
                out.setdefault(int(p.parent.name[5:]), set()).add(int(p.name[5:11]))
        except FileNotFoundError:
            continue
        return out


def complete_steps(root: Path, job: str) -> set[int]:
    return {s for s, ranks in published(root, job).items() if ranks == set(range(WORLD))}


def restart_everything_and_check(cluster: LocalCluster, job: str, step: int) -> None:
    for h in cluster.stores:
        cluster.kill(h)
    for h in cluster.stores:
        cluster.restart(h)
    for r in range(WORLD):
        with CheckpointClient(job, r, WORLD, store=cluster.address(host_of(r))) as c:
            assert c.latest_step() == step
            assert_same(c.load(), rank_state(r, step))
            assert c.stats().last_load_source in ("durable", "h0", "h1")  # RAM empty: durable, or a peer that pulled it first


def test_full_cluster_restart_from_file_spill(make_inprocess_cluster, tmp_path) -> None:
    root = tmp_path / "spill"
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="128MiB",
                           extra_args=["--spill", f"file://{root}", "--spill-every-steps", "2", "--spill-keep-last", "2"])  # fmt: skip
    save_steps(cluster, "fs-job", range(1, 6))
    wait_for(lambda: {2, 4} <= complete_steps(root, "fs-job"), timeout=30, what="steps 2 and 4 spilled")
    assert 5 not in published(root, "fs-job")  # not a multiple of 2
    restart_everything_and_check(cluster, "fs-job", 4)


def test_full_cluster_restart_from_s3(moto, make_inprocess_cluster, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # moto first: it stops after the stores, so no spill is cut off mid-request (a store then waits 5 s for its spiller)
    for name, value in moto.env.items():  # in-process stores (s3fs, botocore) read the test's environment
        monkeypatch.setenv(name, value)
    args = ["--spill", "s3://ckpt/runs", "--spill-every-steps", "1", "--spill-compression", "zstd-shuffle4"]
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="128MiB", extra_args=args)
    save_steps(cluster, "s3-job", range(1, 4))

    def spilled_3() -> bool:
        status = [cluster.health(h) for h in cluster.stores]
        return all(s is not None and any(j.last_spilled_step >= 3 for j in s.spill) for s in status)

    wait_for(spilled_3, timeout=30, what="step 3 spilled to S3 by both stores")
    restart_everything_and_check(cluster, "s3-job", 3)


def test_half_written_spill_is_invisible_and_the_next_succeeds(make_cluster, tmp_path) -> None:
    root = tmp_path / "spill"
    args = ["--spill", f"file://{root}", "--spill-every-steps", "1", "--spill-max-rate", "2MiB", "--spill-orphan-seconds", "1"]
    cluster = make_cluster(hosts=2, replicas=2, capacity="256MiB", extra_args=args)
    save_steps(cluster, "half", range(1, 2), scale=400)  # ~6 MiB per rank: a few seconds per shard at 2 MiB/s
    wait_for(lambda: list(root.glob("half/step-*/rank-*.shard.tmp-*")), timeout=30, what="a spill in progress")
    cluster.kill("h0")  # SIGKILL mid-spill (an in-process stop would let the spill finish)
    assert 1 not in complete_steps(root, "half")  # nothing half-written is visible as a checkpoint
    assert not list(root.glob("half/step-000000000001/rank-00000[01].json"))
    cluster.restart("h0")  # empty RAM: its ranks' step 1 comes back from h1 by repair
    save_steps(cluster, "half", range(2, 4), scale=40)
    wait_for(lambda: {2, 3} <= complete_steps(root, "half"), timeout=60, what="the next spills")
    wait_for(lambda: not list(root.glob("half/step-*/*.tmp-*")), timeout=30, what="debris of the killed spill removed")


def test_retention_keep_last_and_best_exact_over_20_steps(make_inprocess_cluster, tmp_path) -> None:
    root = tmp_path / "spill"
    losses = {s: 10.0 - (s % 7) * 0.5 + 0.01 * s for s in range(1, 21)}
    best = sorted(losses, key=lambda s: losses[s])[:2]
    args = ["--spill", f"file://{root}", "--spill-every-steps", "1", "--spill-keep-last", "3", "--spill-keep-best", "2",
            "--spill-metric", "loss", "--spill-metric-mode", "min"]  # fmt: skip
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="128MiB", extra_args=args)
    for step in range(1, 21):
        save_steps(cluster, "ret", range(step, step + 1), metrics=losses)
        wait_for(lambda s=step: s in complete_steps(root, "ret"), timeout=30, what=f"step {step} spilled")
    expected = {18, 19, 20} | set(best)
    wait_for(lambda: set(published(root, "ret")) == expected, timeout=30, what=f"retention to leave exactly {sorted(expected)}")
    assert complete_steps(root, "ret") == expected
    manifest = json.loads((root / "ret/step-000000000020/rank-000000.json").read_text())
    assert manifest["metrics"] == {"loss": losses[20]}


@pytest.mark.slow  # storage down, then back, with the spiller's backoff between (~40 s on 2 cores)
def test_storage_outage_is_retried_and_saves_are_unaffected(make_cluster, moto) -> None:
    cluster = make_cluster(hosts=2, replicas=2, capacity="128MiB", env=moto.env,
                           extra_args=["--spill", "s3://ckpt/outage", "--spill-every-steps", "1"])  # fmt: skip

    def spilled(step: int) -> bool:
        status = [cluster.health(h) for h in cluster.stores]
        return all(s is not None and any(j.last_spilled_step == step and j.consecutive_failures == 0 for j in s.spill) for s in status)

    save_steps(cluster, "outage", range(1, 2))
    wait_for(lambda: spilled(1), timeout=30, what="step 1 spilled")
    moto.stop()  # storage down: connections refused
    save_steps(cluster, "outage", range(2, 5))  # saves and replication go on while storage is down

    def failing() -> bool:
        h = cluster.health("h0")
        return h is not None and any(j.consecutive_failures > 0 and "outage" in j.last_error for j in h.spill)

    wait_for(failing, timeout=60, what="the spill failure to be reported in status")
    with CheckpointClient("outage", 0, WORLD, store=cluster.address("h0")) as c:
        assert c.latest_step() == 4  # RAM tier unaffected
    moto.start()  # back, empty (moto keeps no state): the spiller retries and catches up with the newest step
    wait_for(lambda: spilled(4), timeout=120, what="the spiller to catch up")
    restart_everything_and_check(cluster, "outage", 4)


def test_sigterm_flushes_the_newest_committed_step(make_cluster, tmp_path) -> None:
    root = tmp_path / "spill"
    cluster = make_cluster(hosts=2, replicas=2, capacity="128MiB", extra_args=["--spill", f"file://{root}", "--flush-grace-seconds", "20"])
    save_steps(cluster, "flush", range(1, 4))  # no spill trigger configured: nothing spilled yet
    assert not published(root, "flush")
    for h in cluster.stores:
        proc = cluster.stores[h].proc
        assert proc is not None
        proc.send_signal(signal.SIGTERM)
    for h in cluster.stores:
        assert cluster.stores[h].proc.wait(timeout=30) == 0  # type: ignore[union-attr]
    assert complete_steps(root, "flush") == {3}
    for h in cluster.stores:
        cluster.restart(h)
    with CheckpointClient("flush", 1, WORLD, store=cluster.address("h0")) as c:
        assert c.latest_step() == 3
        assert_same(c.load(), rank_state(1, 3))


def test_two_failures_in_one_group_fall_back_to_durable(make_cluster, tmp_path) -> None:
    root = tmp_path / "spill"
    cluster = make_cluster(hosts=4, replicas=2, capacity="128MiB", extra_args=["--spill", f"file://{root}", "--spill-every-steps", "2"])
    world = 4  # one rank per host

    def save(step: int) -> None:
        for r in range(world):
            with CheckpointClient("grp", r, world, store=cluster.address(f"h{r}")) as c:
                c.save(step, rank_state(r, step)).wait(timeout=30)

    for step in (1, 2, 3):
        save(step)
    wait_for(lambda: 2 in {s for s, ranks in published(root, "grp").items() if ranks == set(range(world))}, timeout=30, what="step 2")
    cluster.kill("h0")
    cluster.kill("h1")  # the whole group (h0, h1): RAM copies of ranks 0 and 1 are gone
    with CheckpointClient("grp", 0, world, store=cluster.address("h2")) as c:
        assert c.latest_step() == 2  # step 3 lost its RAM copies of ranks 0-1 and was never spilled
        assert_same(c.load(2), rank_state(0, 2))
        assert c.stats().last_load_source == "durable"


def test_compression_is_chosen_per_job(make_inprocess_cluster, tmp_path) -> None:
    from trainer_client.errors import InvalidArgumentError

    root = tmp_path / "spill"
    args = ["--spill", f"file://{root}", "--spill-every-steps", "1"]
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="128MiB", extra_args=args)
    with CheckpointClient("zjob", 0, 1, store=cluster.address("h0"), spill_compression="zstd-shuffle4") as c:
        c.save(1, rank_state(0, 1, scale=32)).wait(timeout=30)
    with CheckpointClient("plain", 0, 1, store=cluster.address("h0")) as c:
        c.save(1, rank_state(0, 1, scale=32)).wait(timeout=30)
    manifests = {job: root / job / "step-000000000001" / "rank-000000.json" for job in ("zjob", "plain")}
    wait_for(lambda: all(p.exists() for p in manifests.values()), timeout=30, what="both jobs spilled")
    assert json.loads(manifests["zjob"].read_text())["codec"] == "zstd-shuffle4"
    assert json.loads(manifests["plain"].read_text())["codec"] == "none"  # the store's default
    for h in cluster.stores:
        cluster.kill(h)
        cluster.restart(h)
    with CheckpointClient("zjob", 0, 1, store=cluster.address("h1")) as c:
        assert_same(c.load(1), rank_state(0, 1, scale=32))
        assert c.stats().last_load_source == "durable" or c.stats().last_load_source.startswith("h")
    with pytest.raises(InvalidArgumentError, match="spill_compression"):
        CheckpointClient("zjob", 0, 1, store=cluster.address("h0"), spill_compression="lz4")


def start_with_a_silent_owner(make_inprocess_cluster, root: Path, job: str, steps: range) -> LocalCluster:  # type: ignore[no-untyped-def]
    """Two stores in one group whose h0 never spills (what a lost owner leaves unspilled); ``steps`` saved, h1's own
    ranks of the due ones (every 2nd) spilled."""
    args = ["--spill", f"file://{root}", "--spill-every-steps", "2"]
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="128MiB", keep=3, discovery="file", extra_args=args)
    wait_for(lambda: {"h0", "h1"} <= set(cluster.servers), timeout=10, what="both servers built")
    cluster.servers["h0"].store.durable.close()
    save_steps(cluster, job, steps)
    due = {s: {2, 3} for s in steps if s % 2 == 0}
    wait_for(lambda: published(root, job) == due, timeout=30, what="h1 to spill its own ranks")
    assert {rank for _, _, rank in cluster.servers["h1"].store.durable.status[job].spilled} == {2, 3}  # h0's are h0's
    return cluster


def restores_from_durable(cluster: LocalCluster, job: str, step: int, via: str) -> None:
    for h in cluster.members:
        cluster.kill(h)
    for h in cluster.members:
        cluster.restart(h)  # empty RAM: every rank comes back from the durable tier
    for r in range(WORLD):
        with CheckpointClient(job, r, WORLD, store=cluster.address(via)) as c:
            assert_same(c.load(step), rank_state(r, step))
            assert c.stats().last_load_source == "durable"


def test_a_lost_owners_shards_are_spilled_by_its_group_peer(make_inprocess_cluster, tmp_path) -> None:
    root = tmp_path / "spill"
    cluster = start_with_a_silent_owner(make_inprocess_cluster, root, "vacant", range(1, 3))
    cluster.kill("h0")
    cluster.remove_host("h0")  # h0's slot vacant: the next held slot of its group (h1's) spills h0's ranks
    wait_for(lambda: 2 in complete_steps(root, "vacant"), timeout=30, what="h0's ranks spilled by h1")
    restores_from_durable(cluster, "vacant", 2, via="h1")


@pytest.mark.slow  # a replacement joins and repairs first (~5 s)
def test_a_lost_owners_shards_are_spilled_by_its_slot_successor(make_inprocess_cluster, tmp_path) -> None:
    root = tmp_path / "spill"
    cluster = start_with_a_silent_owner(make_inprocess_cluster, root, "succ", range(1, 5))
    cluster.kill("h0")
    cluster.add_host("h9", replacing="h0")  # the successor in h0's slot: repairs h0's shards from h1, then spills them
    wait_for(lambda: {2, 4} <= complete_steps(root, "succ"), timeout=30, what="h0's ranks spilled by its successor")
    wait_for(lambda: "h9" in cluster.servers, timeout=10, what="h9's server built")
    assert cluster.servers["h9"].store.durable.status["succ"].bytes_written > 0
    assert {rank for _, _, rank in cluster.servers["h1"].store.durable.status["succ"].spilled} == {2, 3}  # never vacant
    restores_from_durable(cluster, "succ", 4, via="h1")
