"""Shared memory of real stores is neither lost nor leaked: SIGTERM cleans up, --shm-keep-on-exit keeps,
a SIGKILLed store's segments are orphans until its restart (or a replacement under a new host id that takes over
its slot) adopts them, one dir per host id and port."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from memstore.server.memory.shm_dirs import orphaned_dirs, segment_dir
from memstore.testing import LocalCluster, wait_for
from memstore.v1 import store_pb2 as pb
from memstore.v1 import store_pb2_grpc as pb_grpc
from memstore.v1.channel import insecure_channel
from tests.harness.pods import Pods
from tests.states import assert_same, rank_state
from tools.dns_server import DnsServer
from tools.shm_replacement import replace_once
from tools.shm_replacement import run as run_replacements
from trainer_client import CheckpointClient

pytestmark = pytest.mark.integration


def store_dir(cluster: LocalCluster, host_id: str) -> Path:
    """The segment dir the store reports (Hello.shm_dir)."""
    with insecure_channel(cluster.address(host_id)) as ch:
        return Path(pb_grpc.StoreStub(ch).Hello(pb.HelloRequest(), timeout=5).shm_dir)


def segment_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("seg-*")) if directory.exists() else []


def sigterm(cluster: LocalCluster, host_id: str) -> None:
    proc = cluster.stores[host_id].proc
    assert proc is not None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, cluster.log_tail(host_id)


def save_steps(cluster: LocalCluster, host_id: str, job: str, steps: range) -> None:
    with CheckpointClient(job, 0, 1, store=cluster.address(host_id)) as c:
        for step in steps:
            c.save(step, rank_state(0, step, scale=32)).wait(timeout=30)


def test_sigterm_leaves_no_segment_file_behind(make_cluster) -> None:
    cluster = make_cluster(hosts=2, replicas=2, capacity="64MiB")
    dirs = {h: store_dir(cluster, h) for h in ("h0", "h1")}
    save_steps(cluster, "h0", "term", range(1, 4))
    assert all(segment_files(d) for d in dirs.values())  # owner and replica hold segments
    for h in ("h0", "h1"):
        sigterm(cluster, h)
        assert segment_files(dirs[h]) == [] and not dirs[h].exists(), sorted(dirs[h].iterdir())
    assert orphaned_dirs(cluster.shm_dir) == []


def test_shm_keep_on_exit_keeps_segments_and_they_show_as_orphans(make_cluster) -> None:
    cluster = make_cluster(hosts=2, replicas=2, capacity="64MiB", extra_args=["--shm-keep-on-exit"])
    d = store_dir(cluster, "h0")
    save_steps(cluster, "h0", "keep", range(1, 3))
    sigterm(cluster, "h0")
    kept = segment_files(d)
    assert len(kept) >= 2, cluster.log_tail("h0")  # both steps' shards stay on the tmpfs
    # No store owns them now: h1 reports them, and `memstore status` says how to reclaim them.
    health = cluster.health("h1")
    assert health is not None
    (orphan,) = health.orphans
    assert (orphan.path, orphan.host_id, orphan.files) == (str(d), "h0", len(kept))
    assert orphan.bytes >= sum(p.stat().st_size for p in kept)
    status = subprocess.run(
        [sys.executable, "-m", "memstore", "status", "--store", cluster.address("h1"), "--json"], capture_output=True, text=True, timeout=30
    )
    rows = {r["host"]: r for r in json.loads(status.stdout)["hosts"]}
    assert [o["path"] for o in rows["h1"]["orphans"]] == [str(d)]
    text = subprocess.run(
        [sys.executable, "-m", "memstore", "status", "--store", cluster.address("h1")], capture_output=True, text=True, timeout=30
    ).stdout
    assert str(d) in text and f"memstore reclaim-shm --shm-dir {d.parent}" in text
    # Its replacement owns the dir again.
    cluster.restart("h0")
    wait_for(lambda: (h := cluster.health("h1")) is not None and not h.orphans, timeout=10, what="orphan list to clear")


def test_two_clusters_with_the_same_host_ids_share_an_shm_dir(make_cluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    shared = str(tmp_path / "shm")
    a = make_cluster(hosts=1, replicas=1, capacity="16MiB", extra_args=["--shm-dir", shared])
    b = make_cluster(hosts=1, replicas=1, capacity="16MiB", extra_args=["--shm-dir", shared])
    da, db = store_dir(a, "h0"), store_dir(b, "h0")
    assert str(da) == segment_dir(shared, "h0", a.address("h0"))
    assert str(db) == segment_dir(shared, "h0", b.address("h0"))
    assert da != db


def test_sigkilled_store_adopts_its_segments(make_cluster) -> None:
    cluster = make_cluster(hosts=2, replicas=2, capacity="64MiB")
    d = store_dir(cluster, "h0")
    save_steps(cluster, "h0", "adopt", range(1, 3))
    cluster.kill("h0", keep_memory=True)
    assert len(list(d.glob("meta-seg-*"))) >= 2  # the shards' segments, described (sidecars)
    health = cluster.health("h1")
    assert health is not None and [o.path for o in health.orphans] == [str(d)]
    cluster.restart("h0")
    health = cluster.health("h0")
    assert health is not None and health.adopted_shards == 2 and health.shards == 2
    with CheckpointClient("adopt", 0, 1, store=cluster.address("h0")) as c:
        for step in (2, 1):
            assert_same(c.load(step), rank_state(0, step, scale=32))
            assert c.stats().last_load_source == "h0"  # served from its own (adopted) RAM, not pulled from h1
    health = cluster.health("h1")
    assert health is not None and not health.orphans


def test_a_replacement_under_a_new_host_id_adopts_its_predecessors_shards_and_pulls_none(make_cluster) -> None:
    """A replaced pod on the same node: SIGKILLed, its slot taken over by a new host id on the same --shm-dir."""
    cluster = make_cluster(hosts=2, replicas=2, capacity="64MiB", discovery="file", metrics=True)
    old = store_dir(cluster, "h0")
    save_steps(cluster, "h0", "swap", range(1, 3))
    round_ = replace_once(cluster, "h0", "h2", steps=0, mib=0)
    assert round_["stranded_by_sigkill_bytes"] > 0 and not old.exists(), cluster.log_tail("h2")
    assert (round_["adopted_shards"], round_["repair_pulls"], round_["pulled_bytes"], round_["stranded_after_bytes"]) == (2, 0, 0, 0)
    with CheckpointClient("swap", 0, 1, store=cluster.address("h2")) as c:
        for step in (2, 1):
            assert_same(c.load(step), rank_state(0, step, scale=32))
            assert c.stats().last_load_source == "h2"  # from the RAM it adopted


@pytest.mark.slow
def test_ten_sigkill_replacements_strand_nothing_and_repair_nothing() -> None:
    """The measurement in docs/operations.md (``python -m tools.shm_replacement``). The grace period must
    outlast a replacement's start: the surviving store reclaims a dead directory that is nobody's predecessor once
    it has seen it dead that long, and a store process starting on a busy 2-core machine took more than 1 s."""
    result = run_replacements(replacements=10, grace=8.0)
    for r in result["rounds"]:
        measured = (r["adopted_shards"], r["repair_pulls"], r["stranded_after_bytes"], r["exact"], r["served_locally"])
        assert measured == (2, 0, 0, True, True), r
    assert result["unreplaced"]["stranded_by_sigkill_bytes"] > 0 and result["unreplaced"]["reclaimed_after_s"] < 10


@pytest.mark.slow
def test_a_pod_replaced_after_a_sigkill_serves_its_predecessors_shards_without_repair(dns_server: DnsServer, tmp_path: Path) -> None:
    """Kubernetes: pods named by their IPs behind DNS, every pod of the "node" on one --shm-dir. The replacement
    adopts everything (a repair pull would stall it 60 s: it is ready at once), the live pod's directory stays."""
    job, world = "pod-job", 2
    pods = Pods(tmp_path, dns_server, world)
    try:
        pods.start_all()
        for rank in range(world):
            with CheckpointClient(job, rank, world, store=pods.node_address(rank), timeout=20, run_id="run") as c:
                for step in (1, 2):
                    assert c.save(step, rank_state(rank, step)).wait(timeout=30).copies == 2
        dead = f"{pods.host_id(1)}-{pods.port}"
        live = {p.name for p in (tmp_path / "shm").iterdir()} - {dead, f"{dead}.sock"}
        assert len(live) == 2  # the other pod's directory and its control socket
        old = pods.ips.pop(1)
        pods.procs[old].kill()  # SIGKILL after the grace period: no drain
        pods.procs[old].wait(timeout=10)
        pods._publish()  # the endpoint leaves the Service
        pods.start(1, env={"MEMSTORE_FAULTS": "repair.after_pull=stall:60"})
        wait_for(lambda: pods.probe(1) == "SERVING", timeout=30, what="the new pod ready")
        health = pods.health(1)
        assert health is not None and health.adopted_shards == 4 and health.shards == 4, pods.log(pods.ips[1])
        assert pods.held(1, job) == {(1, 0), (1, 1), (2, 0), (2, 1)}
        dirs = {p.name for p in (tmp_path / "shm").iterdir()}
        new = f"{pods.host_id(1)}-{pods.port}"
        assert dirs == live | {new, f"{new}.sock"}  # the dead pod's directory and socket went, the live pod's stayed
        assert orphaned_dirs(str(tmp_path / "shm")) == []
    finally:
        pods.close()
