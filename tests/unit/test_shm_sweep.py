"""Dead stores' segment directories (memstore.server.memory.shm_sweep): which are adopted, which reclaimed and when, and
that a directory a live store holds is never touched; against real pools on a tmp dir and a fake clock."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from memstore.config import StoreConfig
from memstore.core.model import ShardInfo, ShardKey, ShardState
from memstore.core.slots import Slot, SlotTable
from memstore.core.status import Orphan
from memstore.server.convert import sidecar_bytes
from memstore.server.memory.leftovers import write_sidecar
from memstore.server.memory.pages import PAGE
from memstore.server.memory.pool import SegmentPool
from memstore.server.memory.segment import Segment
from memstore.server.memory.shm_dirs import LOCK_NAME, orphaned_dirs, reclaim_dir
from memstore.server.memory.shm_sweep import ShmSweeper, plan
from memstore.server.store import Store
from tests.unit.engine_fakes import manifest_of

pytestmark = pytest.mark.unit


def dead(path: str, host_id: str) -> Orphan:
    return Orphan(path, host_id, 100, 1)


def test_plan_adopts_predecessors_at_once_and_reclaims_the_rest_after_the_grace_period() -> None:
    a, b, c = dead("/s/old-1", "old"), dead("/s/x-1", "x"), dead("/s/y-1", "y")
    first = plan([a, b], {"me", "old"}, {}, now=100.0, grace=60.0)
    assert first.adopt == ("/s/old-1",) and first.reclaim == () and first.first_seen == {"/s/x-1": 100.0}
    second = plan([b, c], {"me"}, first.first_seen, now=159.0, grace=60.0)
    assert second.reclaim == () and second.first_seen == {"/s/x-1": 100.0, "/s/y-1": 159.0}
    third = plan([b, c], {"me"}, second.first_seen, now=160.0, grace=60.0)
    assert third.reclaim == ("/s/x-1",) and third.first_seen == {"/s/y-1": 159.0}
    assert plan([c], {"me"}, {}, now=1e9, grace=0.0).reclaim == ()  # 0: never
    assert plan([], {"me"}, third.first_seen, now=200.0, grace=60.0).first_seen == {}  # gone: forgotten


def leave(directory: Path, name: str, fill: int, meta: bytes) -> None:
    """A described segment a dead store left: two pages of ``fill``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / LOCK_NAME).touch()
    (directory / name).write_bytes(bytes([fill]) * (2 * PAGE))
    write_sidecar(str(directory / name), meta)


def good(seg: Segment, meta: bytes) -> bool:
    """The engine's check, faked: the sidecar names the byte every page holds."""
    return bytes(seg.view(1)) == meta


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def sweeper(pool: SegmentPool, predecessors: set[str], grace: float, clock: Clock) -> ShmSweeper:
    assert pool.directory is not None

    def adopt(directory: Path) -> int:
        return len(pool.adopt_from(directory, good) or [])

    return ShmSweeper(pool.directory, lambda: predecessors, adopt, grace, threading.Event(), clock=clock)


def test_a_predecessors_verified_segments_move_in_and_its_directory_goes(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    old = shm / "10-0-0-1-7070"
    leave(old, "seg-1-0-aaaa", 7, b"\x07")
    leave(old, "seg-1-1-bbbb", 8, b"\x00")  # corrupt: its bytes do not match what its sidecar says
    (old / "seg-1-2-cccc").write_bytes(b"\x01" * PAGE)  # never described
    pool = SegmentPool(str(shm / "10-0-0-2-7070"), 16 * PAGE, adopt_leftovers=True)
    pool.adopt(good)
    try:
        s = sweeper(pool, {"10-0-0-2", "10-0-0-1"}, grace=600, clock=Clock())
        done = s.sweep()
        assert (done.adopted_shards, done.adopted_dirs, done.reclaimed_dirs) == (1, 1, 0)
        assert not old.exists() and orphaned_dirs(str(shm)) == []
        assert pool.directory is not None
        assert sorted(p.name for p in pool.directory.iterdir()) == [LOCK_NAME, "meta-seg-1-0-aaaa", "seg-1-0-aaaa"]
        assert pool.used_bytes == 2 * PAGE and pool.segment_count == 1
    finally:
        pool.close()
    assert not (shm / "10-0-0-2-7070").exists()  # adopted segments are the pool's: a clean exit removes them


def test_others_wait_for_the_grace_period_then_go_and_a_live_stores_directory_never_does(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    stranger = shm / "x-7071"
    leave(stranger, "seg-1-0-aaaa", 1, b"\x01")
    (shm / "not-a-store").mkdir()
    (shm / "not-a-store" / "notes.txt").write_text("keep me")
    me = SegmentPool(str(shm / "me-7070"), 16 * PAGE)
    live = SegmentPool(str(shm / "old-7072"), 16 * PAGE)  # a second live store on the same --shm-dir
    seg = live.acquire(PAGE, "job")
    live.describe(seg, b"\x00")
    clock = Clock()
    try:
        s = sweeper(me, {"me", "old"}, grace=60, clock=clock)  # even a predecessor's id: its lock is held
        assert s.sweep().reclaimed_dirs == 0 and stranger.exists()
        clock.now = 59.0
        assert s.sweep().reclaimed_dirs == 0 and stranger.exists()
        clock.now = 60.0
        done = s.sweep()
        # the segment and its one-byte sidecar
        assert (done.reclaimed_dirs, done.reclaimed_bytes, done.adopted_shards) == (1, 2 * PAGE + 1, 0)
        assert not stranger.exists()
        assert live.directory is not None and seg.path is not None and Path(seg.path).exists()
        assert (shm / "not-a-store" / "notes.txt").read_text() == "keep me"
        assert reclaim_dir(live.directory) is None  # the lock is held: left alone
    finally:
        live.close()
        me.close()


def test_never_reclaims_with_a_grace_period_of_zero(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    leave(shm / "x-7071", "seg-1-0-aaaa", 1, b"\x01")
    pool = SegmentPool(str(shm / "me-7070"), 16 * PAGE)
    clock = Clock()
    try:
        s = sweeper(pool, {"me"}, grace=0, clock=clock)
        s.sweep()
        clock.now = 1e9
        assert s.sweep().reclaimed_dirs == 0 and (shm / "x-7071").exists()
    finally:
        pool.close()


def test_reclaim_removes_a_dead_socket(tmp_path: Path) -> None:
    """A dead store's control socket (``<dir>.sock``) goes with its directory; other files beside it stay."""
    shm = tmp_path / "shm"
    leave(shm / "x-1", "seg-1-0-aaaa", 1, b"\x01")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(shm / "x-1.sock"))
    (shm / "y-1.sock").write_text("not a socket")
    assert reclaim_dir(shm / "x-1") is not None
    assert sorted(p.name for p in shm.iterdir()) == ["y-1.sock"]


def engine(tmp_path: Path, host_id: str, port: int) -> Store:
    config = StoreConfig.load(
        {"host_id": host_id, "listen": f"127.0.0.1:{port}", "replicas": "1", "capacity": "8MiB", "shm_dir": str(tmp_path / "shm"),
         "chunk_bytes": "64KiB", "prefault": "0"},
        env={},
    )  # fmt: skip
    store = Store(config)
    store.start()
    return store


def test_a_store_adopts_once_the_slot_table_says_whose_slot_it_took_over(tmp_path: Path) -> None:
    """The takeover learned after start (a later table): adopted before that table is in force; a corrupt segment is
    dropped. The dead store: a store that closed keeping its files, as a SIGKILL leaves them."""
    old = engine(tmp_path, "old", 7001)
    keys = [ShardKey("job", step, 0) for step in (1, 2)]
    for key in keys:
        lease, seg = old.allocate(key, 1, 256 << 10)
        seg.view(256 << 10)[:] = bytes([key.step]) * (256 << 10)
        old.commit(lease, {}, 1)
        assert old.wait_committed(key, 5)[1]
    old_dir = old.pool.directory
    assert old_dir is not None
    old.pool.keep_files_on_close = True
    old.close()
    (corrupt,) = [p for p in old_dir.glob("seg-*") if p.read_bytes()[:1] == b"\x01"]
    with open(corrupt, "r+b") as fh:
        fh.seek(1000)
        fh.write(b"\xff")
    new = engine(tmp_path, "new", 7002)
    try:
        assert new.adopted_shards == 0 and old_dir.exists()  # holds no slot yet: nobody says "old" was its predecessor
        table = SlotTable(2, (Slot(0, "new", "127.0.0.1:7002", former=("old",), former_until=(2,)),))
        assert new.membership.adopt(table, "a peer")
        assert new.adopted_shards == 1 and not old_dir.exists()
        assert [s.manifest.key for s in new.list_shards("job")] == [keys[1]]
        ((_, view),) = list(new.read(keys[1]))
        assert bytes(view) == b"\x02" * (256 << 10)
    finally:
        new.close()


def test_repair_adopts_a_dead_dir_that_holds_what_it_would_pull(tmp_path: Path) -> None:
    """A successor whose slot table does not name its predecessor: the dead directory holding shards repair wants
    is adopted (no network pull); one holding none of them is left for the grace period."""
    shm = tmp_path / "shm"
    wanted, other = ShardKey("job", 5, 0), ShardKey("job", 5, 1)
    for key, name in ((wanted, "x-7071"), (other, "y-7072")):
        info = ShardInfo(manifest_of(key, bytes([7]) * (2 * PAGE)), ShardState.COMMITTED, True, copies=2)
        leave(shm / name, f"seg-{key.rank}-0-aaaa", 7, sidecar_bytes(info))
    pool = SegmentPool(str(shm / "me-7070"), 16 * PAGE)
    adopted: list[str] = []

    def adopt(directory: Path) -> int:
        adopted.append(directory.name)
        return len(pool.adopt_from(directory, lambda seg, meta: True) or [])

    try:
        assert pool.directory is not None
        s = ShmSweeper(pool.directory, lambda: {"me"}, adopt, 600, threading.Event(), clock=Clock())
        assert s.adopt_holders({ShardKey("job", 6, 0)}) == 0 and adopted == []
        assert s.adopt_holders({wanted}) == 1 and adopted == ["x-7071"]
        assert not (shm / "x-7071").exists() and (shm / "y-7072").exists()
        assert s.total.adopted_shards == 1 and s.total.adopted_dirs == 1
    finally:
        pool.close()
