"""Membership that changes: stores follow a peers file; hosts are replaced under new names, join, drain, conflict."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from memstore.testing import LocalCluster, free_ports, wait_for
from memstore.v1 import store_pb2 as pb
from tests.states import assert_same, rank_state
from trainer_client import CheckpointClient, Connection

pytestmark = pytest.mark.integration

JOB = "membership-job"
HOSTS, WORLD = 4, 8


def host_of(rank: int) -> str:
    return f"h{rank // (WORLD // HOSTS)}"


def client(cluster: LocalCluster, rank: int, host: str) -> CheckpointClient:
    return CheckpointClient(JOB, rank, WORLD, store=cluster.address(host), timeout=20, run_id="run")


def save_steps(cluster: LocalCluster, steps: range, hosts: dict[int, str] | None = None, copies: int = 2) -> None:
    cs = [client(cluster, r, (hosts or {}).get(r, host_of(r))) for r in range(WORLD)]
    try:
        for step in steps:
            for h in [c.save(step, rank_state(c.rank, step)) for c in cs]:
                assert h.wait(timeout=30).copies == copies
    finally:
        for c in cs:
            c.close()


def held(cluster: LocalCluster, host: str) -> set[tuple[int, int]]:
    from memstore.v1.channel import store_stub

    channel, stub = store_stub(cluster.address(host))
    with channel:
        resp = stub.List(pb.ListRequest(job_id=JOB), timeout=5)
    return {(s.manifest.key.step, s.manifest.key.rank) for s in resp.shards if s.verified}


def slots(cluster: LocalCluster, host: str) -> list[str]:
    h = cluster.health(host)
    return [s.host_id for s in h.slots.slots] if h is not None else []


def assert_restores(cluster: LocalCluster, step: int, via: dict[int, str]) -> None:
    for rank, host in via.items():
        with client(cluster, rank, host) as c:
            assert_same(c.load(step), rank_state(rank, step))


def test_replacement_under_a_new_name_restores_and_repairs(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=HOSTS, replicas=2, capacity="256MiB", keep=3, discovery="file")
    save_steps(cluster, range(1, 4))
    assert slots(cluster, "h0") == ["h0", "h1", "h2", "h3"]

    cluster.kill("h1")
    cluster.add_host("h9", replacing="h1")  # new host id, new port: takes h1's slot
    for h in ("h0", "h2", "h3", "h9"):
        wait_for(lambda h=h: slots(cluster, h) == ["h0", "h9", "h2", "h3"], timeout=20, what=f"{h} to see h9 in slot 1")

    # Every rank of the lost host restores step 3 bit-exactly through the new store.
    assert_restores(cluster, 3, {2: "h9", 3: "h9"})
    # After repair the new store holds its group's recent steps; then losing the group's other member loses nothing.
    wanted = {(step, r) for step in (2, 3) for r in range(4)}
    wait_for(lambda: wanted <= held(cluster, "h9"), timeout=30, what="h9 to repair slot 1's group")
    cluster.kill("h0")
    with client(cluster, 0, "h9") as c:
        assert c.latest_step() == 3
    assert_restores(cluster, 3, {r: "h9" if r < 4 else host_of(r) for r in range(WORLD)})


def test_a_fifth_host_joins_while_saving(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=HOSTS, replicas=2, capacity="256MiB", keep=3, discovery="file")
    save_steps(cluster, range(1, 3))
    seen: list[int] = []
    errors: list[str] = []
    calls: list[tuple[float, float, int | None]] = []
    t0 = time.monotonic()
    stop = threading.Event()

    def watch() -> None:
        with client(cluster, 0, "h0") as c:
            last = False
            while not last:
                last = stop.is_set()  # one more call after the saves finished: the final answer must be step 7
                started = time.monotonic()
                try:
                    latest = c.latest_step()
                except Exception as exc:  # recorded, not fatal: a dead watcher would freeze `seen` and hide why
                    errors.append(f"{type(exc).__name__} after {time.monotonic() - started:.1f}s: {exc}")
                    latest = None
                calls.append((round(started - t0, 2), round(time.monotonic() - started, 2), latest))
                if latest is not None:
                    seen.append(latest)
                stop.wait(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        cluster.add_host("h4")
        save_steps(cluster, range(3, 6))
        for h in ("h0", "h1", "h2", "h3", "h4"):
            wait_for(lambda h=h: slots(cluster, h) == ["h0", "h1", "h2", "h3", "h4"], timeout=20, what=f"{h} to see h4 join")
        save_steps(cluster, range(6, 8))
    finally:
        stop.set()
        watcher.join()
    assert seen and seen == sorted(seen), f"latest_step went backwards: {seen}"
    assert not errors, errors
    assert seen[-1] == 7, (round(time.monotonic() - t0, 2), calls[-20:])
    assert_restores(cluster, 7, {r: host_of(r) for r in range(WORLD)})
    # The new slot holds copies too (mixed placement over 5 slots gives it a group).
    wait_for(lambda: any(step == 7 for step, _ in held(cluster, "h4")), timeout=30, what="h4 to hold copies of step 7")


def test_drain_with_one_replica_and_a_spill_target_keeps_every_step(make_cluster, tmp_path: Path) -> None:
    spill = tmp_path / "spill"
    cluster = make_cluster(hosts=HOSTS, replicas=1, capacity="256MiB", keep=3, discovery="file", extra_args=["--spill", f"file://{spill}"])
    save_steps(cluster, range(1, 4), copies=1)
    sp = cluster.stores["h1"]
    assert sp.proc is not None
    sp.proc.terminate()  # SIGTERM: drain, then leave
    assert sp.proc.wait(timeout=60) == 0, cluster.log_tail("h1")
    cluster.remove_host("h1")
    # Every committed step stays restorable, for every rank, through the stores that remain.
    for step in (1, 2, 3):
        assert_restores(cluster, step, {r: "h0" if host_of(r) == "h1" else host_of(r) for r in range(WORLD)})
    with client(cluster, 2, "h2") as c:
        assert c.latest_step() == 3
    assert "drain" in cluster.log_tail("h1", 80)


def test_a_second_store_with_a_live_host_id_is_refused(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="64MiB", discovery="file")
    save_steps_small(cluster)
    (port,) = free_ports(1)
    proc = subprocess.run(
        [sys.executable, "-m", "memstore", "serve", "--host-id", "h1", "--listen", f"127.0.0.1:{port}",
         "--peers-file", str(cluster.peers_file), "--replicas", "2", "--capacity", "64MiB", "--shm-dir", cluster.shm_dir],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "h1" in proc.stderr and cluster.address("h1") in proc.stderr and "already" in proc.stderr, proc.stderr
    # The live store still holds its slot and its shards.
    assert slots(cluster, "h0") == ["h0", "h1"]
    with CheckpointClient(JOB, 1, 2, store=cluster.address("h1"), timeout=20, run_id="run") as c:
        assert_same(c.load(1), rank_state(1, 1))


def save_steps_small(cluster: LocalCluster) -> None:
    for rank, host in ((0, "h0"), (1, "h1")):
        with CheckpointClient(JOB, rank, 2, store=cluster.address(host), timeout=20, run_id="run") as c:
            assert c.save(1, rank_state(rank, 1)).wait(timeout=30).copies == 2


def test_a_garbage_peers_file_keeps_the_last_good_membership(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="64MiB", discovery="file")
    save_steps_small(cluster)
    good = cluster.peers_file.read_text()
    cluster.peers_file.write_text('{"hosts": {"h0": "127.0.0.1:notaport"')

    def error_of(host: str) -> str:
        h = cluster.health(host)
        return h.discovery.error if h is not None else ""

    for host in ("h0", "h1"):
        wait_for(lambda host=host: str(cluster.peers_file) in error_of(host), timeout=20, what=f"{host} to report the bad file")
        assert slots(cluster, host) == ["h0", "h1"]  # the last good membership stays
    with CheckpointClient(JOB, 0, 2, store=cluster.address("h0"), timeout=20, run_id="run") as c:
        assert_same(c.load(1), rank_state(0, 1))
        assert c.save(2, rank_state(0, 2)).wait(timeout=30).copies == 2

    cluster.peers_file.write_text(good)
    wait_for(lambda: error_of("h0") == "", timeout=20, what="the error to clear")


def test_serve_refuses_to_start_from_a_bad_peers_file(tmp_path: Path) -> None:
    bad = tmp_path / "peers.json"
    bad.write_text(json.dumps({"hosts": {"h0": "127.0.0.1:1", "bad id!": "127.0.0.1:2"}}))
    (port,) = free_ports(1)
    proc = subprocess.run(
        [sys.executable, "-m", "memstore", "serve", "--host-id", "h0", "--listen", f"127.0.0.1:{port}", "--peers-file", str(bad),
         "--shm-dir", ""],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert str(bad) in proc.stderr and "bad id!" in proc.stderr, proc.stderr


def test_a_drain_gives_its_lone_shards_to_a_peer_replaced_a_moment_ago(make_inprocess_cluster) -> None:
    """A rolling replacement: h1 was lost and its replacement just started when h0 drains. h0's channel to h1 still
    backs off its reconnects (its pushes to the lost h1 failed) and fails calls at once; the drain asks on a fresh
    channel, so it does not take the replacement for gone and leave its lone shards behind (the recovery matrix's
    rolling-replacement row lost every step that way)."""
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="64MiB")
    with CheckpointClient(JOB, 0, 1, connection=Connection(cluster.address("h0"), timeout=10)) as c:
        c.save(1, rank_state(0, 1)).wait(timeout=30)
        cluster.kill("h1")  # lost with its RAM
        try:
            c.save(2, rank_state(0, 2)).wait(timeout=30)  # its push to h1 fails: h0's channel to h1 backs off
        except Exception:
            pass  # under-replicated: step 2 is alone on h0
    cluster.restart("h1")
    failures = cluster.servers["h0"].store.drain(30.0)
    assert failures == [], failures
    assert (2, 0) in held(cluster, "h1")


def test_memstore_drain_pushes_lone_shards_to_peers(make_cluster) -> None:
    """R=1 and no durable tier: `memstore drain` copies every shard only the store holds to a peer, then the store exits."""
    cluster = make_cluster(hosts=HOSTS, replicas=1, capacity="256MiB", keep=3, discovery="file")
    save_steps(cluster, range(1, 3), copies=1)
    out = subprocess.run(
        [sys.executable, "-m", "memstore", "drain", "--store", cluster.address("h3"), "--wait", "60"],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "drained and gone" in out.stdout, out.stdout
    sp = cluster.stores["h3"]
    assert sp.proc is not None and sp.proc.wait(timeout=30) == 0
    assert "copied 4 of 4 lone shard(s) to peers; 0 not copied" in cluster.log_tail("h3", 80)  # ranks 6, 7 x steps 1, 2
    cluster.remove_host("h3")
    for step in (1, 2):
        assert_restores(cluster, step, {r: "h0" if host_of(r) == "h3" else host_of(r) for r in range(WORLD)})
    status = subprocess.run(
        [sys.executable, "-m", "memstore", "status", "--store", cluster.address("h0")], capture_output=True, text=True, timeout=60
    )
    assert "VACANT (last held by h3)" in status.stdout, status.stdout


def test_members_fed_from_python(tmp_path: Path) -> None:
    """Another runtime (Ray, next) feeds members through FedMembers into in-process StoreServers."""
    from memstore.config import StoreConfig
    from memstore.membership import FedMembers, Member
    from memstore.server.app import StoreServer

    servers: dict[str, StoreServer] = {}
    feeds: dict[str, FedMembers] = {}
    try:
        for h in ("a", "b"):
            config = StoreConfig.load(
                {"host_id": h, "listen": "127.0.0.1:0", "replicas": 2, "capacity": "64MiB", "shm_dir": "", "discovery": "fed",
                 "discovery_interval": 0.2}, env={},
            )  # fmt: skip
            feeds[h] = FedMembers(f"test feed of {h}")
            servers[h] = StoreServer(config, discovery=feeds[h])
        members = [Member(h, s.address) for h, s in servers.items()]
        for h, s in servers.items():
            feeds[h].set(members)
            s.join()
            s.start()
        for s in servers.values():
            assert [x.host_id for x in s.store.membership.view.table.slots] == ["a", "b"]
        with CheckpointClient(JOB, 0, 1, store=servers["a"].address, timeout=20, run_id="run") as c:
            assert c.save(1, rank_state(0, 1)).wait(timeout=30).copies == 2
        feeds["a"].set([members[0], Member("c", "127.0.0.1:1")])  # b leaves, c (never started) joins: it takes b's slot
        wait_for(lambda: [x.host_id for x in servers["a"].store.membership.view.table.slots] == ["a", "c"], timeout=10, what="c in slot1")
        assert servers["a"].store.membership.view.table.slots[1].former == ("b",)
    finally:
        for s in servers.values():
            s.stop(grace=0)
