"""Client paths against real stores: trainer crash after save, corrupt local copy, no shared memory."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from memstore.testing import wait_for
from memstore.v1 import store_pb2 as pb
from tests.states import assert_same, rank_state
from trainer_client import CheckpointClient, Connection, SaveResult
from trainer_client.errors import CapacityExceededError, InvalidArgumentError

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def test_trainer_killed_right_after_save_loses_nothing(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="128MiB")
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from tests.states import rank_state
        from trainer_client import CheckpointClient
        c = CheckpointClient("crash", 0, 1, store={cluster.address("h0")!r})
        c.save(5, rank_state(0, 5, scale=64))   # returns once the store owns the bytes
        os.kill(os.getpid(), signal.SIGKILL)     # the trainer dies before waiting for replication
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], timeout=60)
    assert proc.returncode == -signal.SIGKILL
    c = CheckpointClient("crash", 0, 1, connection=Connection(cluster.address("h0")))
    try:
        wait_for(lambda: c.latest_step() == 5, timeout=20, what="step 5 restorable")
        assert_same(c.load(), rank_state(0, 5, scale=64))
        # ... and replication finished without the trainer: the peer holds a verified copy too.
        c2 = CheckpointClient("crash", 0, 1, connection=Connection(cluster.address("h1")))
        cluster.kill("h0")
        assert_same(c2.load(5), rank_state(0, 5, scale=64))
        c2.close()
    finally:
        c.close()


@pytest.mark.parametrize("onto", [None, "meta"])
def test_corrupt_local_copy_is_discarded_and_peer_copy_used(make_inprocess_cluster, onto: str | None) -> None:  # type: ignore[no-untyped-def]
    """Onto a device (``meta`` here: the same path, no bytes land) the client hashes the chunks beside its copies
    (``trainer_client.chunk_check``); the failed chunk makes it ask again, and the store drops its copy."""
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="128MiB")
    c = CheckpointClient("corrupt", 0, 1, connection=Connection(cluster.address("h0")))
    try:
        c.save(1, rank_state(0, 1, scale=16)).wait(timeout=30)
        # Flip bytes in h0's RAM copy: the segment file the store maps (test-only access to its shm dir).
        segs = sorted(Path(cluster.segment_dir("h0")).glob("seg-*"), key=lambda p: p.stat().st_mtime)
        assert segs
        for seg in segs:
            with open(seg, "r+b") as fh:
                fh.seek(4096)
                fh.write(b"\xde\xad\xbe\xef" * 16)
        if onto is None:
            assert_same(c.load(1), rank_state(0, 1, scale=16))
        else:
            out = c.load(1, map_location=onto)
            assert all(t.is_meta for t in out.values() if isinstance(t, torch.Tensor))
        assert c.stats().last_load_source == "h1"  # the verified copy came from the peer
    finally:
        c.close()


def test_path_without_shared_memory_uses_the_data_channel(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="128MiB")
    c = CheckpointClient("remote", 0, 1, connection=Connection(cluster.address("h0"), shared_memory=False))
    try:
        assert not c.stats().shared_memory
        info = c.save(3, rank_state(0, 3, scale=8)).wait(timeout=30)
        assert isinstance(info, SaveResult) and info.committed  # a small dataclass, not protobuf
        assert info.copies == 2 and info.host == "h0" and (info.step, info.rank) == (3, 0)
        assert c.stats().last_save_route == "data channel"
        assert_same(c.load(), rank_state(0, 3, scale=8))
        assert_same(c.load(zero_copy=False), rank_state(0, 3, scale=8))
        # A store without a data channel: the same save and load over gRPC streams.
        c._link.data.data_port = 0
        c.save(4, rank_state(0, 4, scale=8)).wait(timeout=30)
        assert c.stats().last_save_route == "grpc"
        assert_same(c.load(4), rank_state(0, 4, scale=8))
    finally:
        c.close()


def test_background_remote_saves_report_at_wait(make_cluster) -> None:
    """remote_save="background": save() returns after the staging copy; wait() reports the send and the commit."""
    # A process per store: with the stores on the test's GIL, a send could lag until the next step superseded it.
    cluster = make_cluster(hosts=2, replicas=2, capacity="64MiB")
    with CheckpointClient("bg", 0, 1, connection=Connection(cluster.address("h0"), shared_memory=False), remote_save="background") as c:
        handles = [c.save(step, rank_state(0, step, scale=8)) for step in (1, 2, 3)]  # at most two sends in flight
        results = [h.wait(timeout=30) for h in handles]
        # The store may skip pushing an older step once a newer one arrived (by design: a newer save never waits
        # for an older one's replication), and then wait() says so; the newest step always reaches both hosts.
        for r in results[:-1]:
            assert r.copies == 2 or (r.superseded and r.copies == 1 and "superseded by step" in r.error), r
        assert results[-1].copies == 2 and not results[-1].superseded
        assert_same(c.load(), rank_state(0, 3, scale=8))
        too_big = c.save(4, {"x": torch.zeros(20 << 20)})  # 80 MiB > 64 MiB: refused after save() returned
        with pytest.raises(CapacityExceededError):
            too_big.wait(timeout=30)
        assert too_big.done()
    with pytest.raises(InvalidArgumentError, match="remote_save"):
        CheckpointClient("bg", 0, 1, connection=Connection(cluster.address("h0")), remote_save="later")


def test_newer_save_does_not_wait_for_older_replication(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="256MiB")
    c = CheckpointClient("burst", 0, 1, connection=Connection(cluster.address("h0")))
    try:
        handles = [c.save(step, rank_state(0, step, scale=32)) for step in range(1, 6)]  # no waits in between
        assert handles[-1].wait(timeout=60).copies == 2
        assert c.latest_step() == 5
        assert_same(c.load(), rank_state(0, 5, scale=32))
    finally:
        c.close()


def test_replacement_adopts_verified_segments_and_discards_corrupt_ones(make_cluster) -> None:
    cluster = make_cluster(hosts=2, replicas=2, capacity="128MiB")
    c = CheckpointClient("adopt", 0, 1, connection=Connection(cluster.address("h0")))
    for step in (1, 2):
        c.save(step, rank_state(0, step, scale=16)).wait(timeout=30)
    c.close()
    shm = Path(cluster.segment_dir("h0"))
    cluster.kill("h0", keep_memory=True)  # the store process crashes; the host and its shared memory stay
    # Corrupt the segment of step 1 behind the dead store's back: its sidecar names the shard it holds.
    for meta in shm.glob("meta-*"):
        info = pb.ShardInfo.FromString(meta.read_bytes())
        if info.manifest.key.step == 1:
            with open(shm / meta.name.removeprefix("meta-"), "r+b") as fh:
                fh.seek(100)
                fh.write(b"\xff" * 64)
    cluster.restart("h0")
    health = cluster.health("h0")
    assert health is not None and health.adopted_shards == 1  # step 2 verified and adopted; step 1 discarded
    with CheckpointClient("adopt", 0, 1, connection=Connection(cluster.address("h0"))) as c2:
        assert_same(c2.load(2), rank_state(0, 2, scale=16))
        assert c2.stats().last_load_source == "h0"  # its own RAM, no network
        assert_same(c2.load(1), rank_state(0, 1, scale=16))
        assert c2.stats().last_load_source == "h1"  # the discarded copy came back from the peer, verified


def _mapped_file(address: int) -> str:
    """The file whose mapping holds ``address`` in this process ("" for anonymous memory)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5].strip() if len(fields) > 5 else ""
    return ""


def test_zero_copy_restore_is_private_and_stable(make_inprocess_cluster) -> None:
    cluster = make_inprocess_cluster(hosts=1, replicas=1, capacity="64MiB", keep=1)
    c = CheckpointClient("zc", 0, 1, connection=Connection(cluster.address("h0")))
    try:
        c.save(1, rank_state(0, 1, scale=64)).wait(timeout=30)
        first = c.load(1)
        weight = first["model"]["weight"]
        assert _mapped_file(weight.data_ptr()).startswith(cluster.segment_dir("h0"))  # a view into the shared mapping, not a copy
        weight.add_(1.0)  # copy-on-write: the store's bytes are untouched
        assert_same(c.load(1), rank_state(0, 1, scale=64))
        # Newer saves evict step 1 and recycle segments; what the trainer restored must not change.
        for step in range(2, 6):
            c.save(step, rank_state(0, step, scale=64)).wait(timeout=30)
        expected = rank_state(0, 1, scale=64)
        expected["model"]["weight"].add_(1.0)
        assert_same(first, expected)
        copied = c.load(5, zero_copy=False)
        assert copied["model"]["weight"].untyped_storage().nbytes() == copied["model"]["weight"].numel() * 4
    finally:
        c.close()
