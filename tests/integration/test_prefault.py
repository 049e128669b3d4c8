"""Pre-faulted memory against real stores: saves take the reserve, the client maps the next segment ahead."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from memstore.testing import LocalCluster, wait_for
from memstore.v1 import store_pb2 as pb
from memstore.v1.channel import store_stub
from trainer_client import CheckpointClient, Connection

pytestmark = pytest.mark.integration
MiB = 1 << 20


def health(cluster: LocalCluster, host: str) -> pb.HealthResponse:
    channel, stub = store_stub(cluster.address(host))
    try:
        return stub.Health(pb.HealthRequest(), timeout=10)
    finally:
        channel.close()


def segments(cluster: LocalCluster, host: str) -> set[str]:
    d = Path(cluster.segment_dir(host))
    return {str(p) for p in d.iterdir() if p.name.startswith("seg-")} if d.is_dir() else set()


def settled(cluster: LocalCluster, host: str) -> bool:
    return not health(cluster, host).reserve_filling


def state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4 * MiB // 4,), float(step))}  # 4 MiB


def test_saves_take_prefaulted_segments_and_the_next_one_is_mapped_ahead(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="256MiB", extra_args=["--prefault", "32MiB", "--prefault-unit", "4MiB"])
    for host in ("h0", "h1"):
        wait_for(lambda host=host: settled(cluster, host), timeout=30, what=f"{host}'s reserve faulted in")
    h = health(cluster, "h0")
    assert h.reserve_bytes >= 32 * MiB and h.pooled_bytes >= h.reserve_bytes and h.used_bytes >= h.pooled_bytes
    ready = segments(cluster, "h0")
    c = CheckpointClient("pf", 0, 1, store=cluster.address("h0"))
    try:
        used: list[str] = []
        take = c._ring.slot
        c._ring.slot = lambda *a: (lambda slot: (used.append(slot.path), slot)[1])(take(*a))  # type: ignore[method-assign]
        c.save(1, state(1)).wait(timeout=30)
        assert used[0] in ready, "the first save of a fresh job should land in memory faulted in at start-up"
        # The client reserved the next save's segment after the commit and mapped it in the background.
        ahead = c._ring.ahead_path()
        assert ahead != used[0] and os.path.exists(ahead) and ahead in c._ring.mapped_paths
        c.save(2, state(2)).wait(timeout=30)
        assert used[1] == ahead and c._ring.ahead_path() not in (ahead, "")
        assert c.load(2)["w"][0].item() == 2.0
        # The peer's copies came from its reserve too: no segment created on h1 beyond what it had.
        wait_for(lambda: settled(cluster, "h1"), timeout=30, what="h1's reserve refilled")
        assert health(cluster, "h1").used_bytes <= 256 * MiB
    finally:
        c.close()


def test_a_store_answers_only_once_the_first_pass_of_its_reserve_is_faulted_in(make_inprocess_cluster) -> None:
    """--prefault 40MiB with keep 2: 8 MiB (N/(keep+3)) is ready at the store's very first answer, so a replacement's
    first restore or a fresh job's first save never waits for fresh memory; the rest follows in the background."""
    flags = ["--prefault", "40MiB", "--prefault-unit", "4MiB"]
    cluster = make_inprocess_cluster(hosts=1, replicas=1, capacity="256MiB", keep=2, extra_args=flags)
    assert health(cluster, "h0").pooled_bytes >= 8 * MiB  # ready (pooled), not merely being faulted in


def steps_held(cluster: LocalCluster, host: str, job: str) -> set[int]:
    channel, stub = store_stub(cluster.address(host))
    try:
        return {s.manifest.key.step for s in stub.List(pb.ListRequest(job_id=job), timeout=10).shards}
    finally:
        channel.close()


def test_a_reserve_sized_as_documented_faults_nothing_in_after_start_up(make_inprocess_cluster) -> None:
    """--prefault (keep+3) x the shard, as docs/operations.md says, and no --prefault-unit, on stores whose capacity is
    about the reserve (no room for a capture ring to grow past what its saves need): the reserve is cut into
    shard-sized segments before any shard arrives, and the owner's cycle (the kept steps, the one being saved, the
    one reserved ahead, one ready) never needs a segment beyond them. Sized for keep+2, the owner faulted a fifth
    one in during the first saves, beside their copies and pushes."""
    keep = 2
    prefault = (keep + 3) * 4 * MiB
    cluster = make_inprocess_cluster(
        hosts=2, replicas=2, capacity=str(prefault + 4 * MiB), keep=keep, extra_args=["--prefault", str(prefault)]
    )
    for host in ("h0", "h1"):
        wait_for(lambda host=host: settled(cluster, host), timeout=30, what=f"{host}'s reserve faulted in")
    ready = {host: segments(cluster, host) for host in ("h0", "h1")}
    assert len(ready["h0"]) == keep + 3
    with CheckpointClient("sized", 0, 1, connection=Connection(cluster.address("h0"))) as c:
        for step in range(1, 2 * keep + 4):
            c.save(step, state(step)).wait(timeout=30)
            wait_for(lambda: all(len(steps_held(cluster, h, "sized")) <= keep for h in ("h0", "h1")), timeout=30, what="retention")
        c._ring.wait_ahead()
        for host in ("h0", "h1"):
            wait_for(lambda host=host: settled(cluster, host), timeout=30, what=f"{host}'s reserve settled")
            assert segments(cluster, host) <= ready[host], f"{host} made segments beyond its reserve"


def test_auto_reserve_faults_in_the_rest_of_the_cycle_and_nothing_twice(make_inprocess_cluster) -> None:
    """At the defaults the owner's ring and the peer's reserve together hold (keep + 1) shards each, never more: the
    peer learns the shard size from the first replica and faults in the next ones off the save's path."""
    keep = 2
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="256MiB", keep=keep)  # --prefault auto (the default)
    assert health(cluster, "h0").reserve_bytes == 0  # nothing faulted in before a job saves
    with CheckpointClient("auto", 0, 1, connection=Connection(cluster.address("h0"))) as c:
        c.save(1, state(1)).wait(timeout=30)
        wait_for(lambda: health(cluster, "h1").reserve_bytes >= keep * 4 * MiB, timeout=30, what="the peer learned from the replica")
        c._ring.wait_ahead()
        before = segments(cluster, "h1")
        for step in range(2, 2 * keep + 4):
            c.save(step, state(step)).wait(timeout=30)
            c._ring.wait_ahead()
            assert segments(cluster, "h1") <= before, "the peer made a segment beyond its reserve"
            # the peer's retention lets the oldest replica go on its own time: the next replica lands in that segment
            wait_for(lambda: len(steps_held(cluster, "h1", "auto")) <= keep, timeout=30, what="the peer's retention")
        for host in ("h0", "h1"):
            wait_for(lambda host=host: settled(cluster, host), timeout=30, what=f"{host}'s reserve settled")
            used = health(cluster, host).used_bytes
            assert used <= (keep + 1) * (4 * MiB + 2 * 4096), f"{host} holds {used} bytes: more than its cycle"


def test_a_prepared_rank_has_its_peer_fault_in_its_first_replica_before_it_comes(make_inprocess_cluster) -> None:
    """``prepare`` (a reservation ahead before the rank's first save) tells the group peers to expect its replicas (``Expect``): the
    peer faults their memory in before the first save, which lands there instead of in fresh pages."""
    keep = 2
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="256MiB", keep=keep)  # --prefault auto (the default)
    with CheckpointClient("expect", 0, 1, connection=Connection(cluster.address("h0"))) as c:
        c.prepare(state(1))
        wait_for(lambda: health(cluster, "h1").reserve_bytes >= (keep + 1) * 4 * MiB, timeout=30, what="the peer to fault in the cycle")
        wait_for(lambda: settled(cluster, "h1"), timeout=30, what="h1's reserve settled")
        before = segments(cluster, "h1")
        c.save(1, state(1)).wait(timeout=30)
        assert segments(cluster, "h1") <= before, "the first replica landed in a segment made for it"
        assert steps_held(cluster, "h1", "expect") == {1}


def test_prefault_off_keeps_nothing(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=1, replicas=1, capacity="64MiB", extra_args=["--prefault", "0"])
    c = CheckpointClient("off", 0, 1, store=cluster.address("h0"))
    try:
        c.save(1, state(1)).wait(timeout=30)
        assert health(cluster, "h0").reserve_bytes == 0
    finally:
        c.close()


def test_a_failed_reservation_ahead_only_costs_the_reservation(make_inprocess_cluster) -> None:
    """The next save's segment is reserved and mapped on the ring's thread; if that failed (the store was briefly
    full, the mapping failed), the save allocates and maps its memory itself instead of failing."""
    from concurrent.futures import Future

    cluster = make_inprocess_cluster(hosts=1, replicas=1, capacity="128MiB", extra_args=["--prefault", "32MiB", "--prefault-unit", "4MiB"])
    wait_for(lambda: settled(cluster, "h0"), timeout=30, what="reserve faulted in")
    with CheckpointClient("pf-race", 0, 1, store=cluster.address("h0")) as c:
        c.save(1, state(1)).wait(timeout=30)
        assert c._ring.ahead_path()
        lease = c._ring._ahead.result()  # type: ignore[union-attr]
        c._ring.give_back(lease)
        failed: Future = Future()
        failed.set_exception(ValueError("mmap length is greater than file size"))
        c._ring._ahead = failed
        c.save(2, state(2)).wait(timeout=30)
        assert c.load(2)["w"][0].item() == 2.0


def test_a_replacement_with_the_automatic_reserve_faults_its_groups_newest_shard_in_before_serving(
    make_inprocess_cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """--prefault auto (the default) knows no shard size on a fresh store, but a replacement's group does: before it
    serves, the replacement lists what it will pull and faults the newest step's shards in, so the pull a restarted
    trainer's load() waits for lands in memory ready for it (nothing fresh is faulted in beside that pull)."""
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="256MiB", keep=2)
    with caplog.at_level(logging.INFO, logger="memstore.server.store"):
        with CheckpointClient("auto-repl", 0, 1, connection=Connection(cluster.address("h0"))) as c:
            for step in (1, 2):
                c.save(step, state(step)).wait(timeout=30)
        assert "the group holds" not in caplog.text  # fresh stores of a fresh cluster: nothing to expect
        cluster.kill("h0")
        caplog.clear()
        cluster.restart("h0")
        said = [r.getMessage() for r in caplog.records if getattr(r, "host", "h0") == "h0"]
    assert any("the group holds 1 shard(s) of 4.00 MiB" in m for m in said), said
    assert any("of the --prefault reserve before serving" in m for m in said), said
    with CheckpointClient("auto-repl", 0, 1, connection=Connection(cluster.address("h0"))) as c:
        assert c.load()["w"][0].item() == 2.0
