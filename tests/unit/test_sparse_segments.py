"""Sparse segments: a save's fresh segment is made without its pages, and its client faults them in on all its cores as
it maps it (``populate_writable``), where the store used to fault them in on one thread and the client map them again.
A full tmpfs is an error of that call, never a SIGBUS; a sparse segment nobody committed is never pooled."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from memstore.server.memory.pool import PAGE, SegmentPool
from memstore.v1.pagefaults import address_of, populate_supported, populate_writable
from trainer_client.capture import ring
from trainer_client.capture.ring import map_segment
from trainer_client.errors import CapacityExceededError

pytestmark = [pytest.mark.unit, pytest.mark.skipif(not populate_supported(), reason="needs MADV_POPULATE_WRITE (Linux >= 5.14)")]
MiB = 1 << 20


def blocks(path: str) -> int:
    return os.stat(path).st_blocks * 512


@pytest.fixture
def pool() -> SegmentPool:
    d = Path("/dev/shm") / f"memstore-test-sparse-{os.getpid()}-{os.urandom(4).hex()}"
    p = SegmentPool(str(d), 256 * MiB)
    yield p
    p.close()


def test_a_save_s_fresh_segment_is_made_without_its_pages_and_its_client_faults_them_in(pool: SegmentPool) -> None:
    seg = pool.acquire(32 * MiB, "job", ring=0, sparse=True)
    assert seg.sparse and seg.path is not None and blocks(seg.path) == 0  # nothing allocated yet: made at once
    mm = map_segment(seg.path, seg.size)  # the client's mapping: every page allocated, on all cores
    try:
        assert blocks(seg.path) >= seg.size
        mm[:4] = b"abcd"
        assert bytes(seg.view(4)) == b"abcd"  # one file, the store's view sees the client's bytes
    finally:
        mm.close()
    replica = pool.acquire(32 * MiB, "job")  # the store writes a replica itself: its pages are faulted in first
    assert not replica.sparse and replica.path is not None and blocks(replica.path) >= replica.size


def test_a_sparse_segment_is_pooled_only_with_every_page_allocated(pool: SegmentPool) -> None:
    lost = pool.acquire(4 * MiB, "job", ring=0, sparse=True)  # its client died before mapping it
    pool.release(lost)
    assert pool.pooled_bytes == 0 and lost.path is not None and not os.path.exists(lost.path)
    kept = pool.acquire(4 * MiB, "job", ring=0, sparse=True)
    kept.sparse = False  # what a commit does (Catalog.commit_lease): its client faulted every page in
    pool.release(kept)
    assert pool.pooled_bytes == kept.size
    filled = pool.acquire(4 * MiB, "job", ring=1, sparse=True)  # a ring's fill: mapped, then given back unused
    assert filled.path is not None
    map_segment(filled.path, filled.size).close()
    pool.release(filled)
    assert pool.pooled_bytes == kept.size + filled.size and not filled.sparse


def test_populate_writable_reports_a_page_it_cannot_allocate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages past the file's end cannot be faulted in, as with a full tmpfs: the call says so instead of the first write
    raising SIGBUS, and ``map_segment`` turns that into CapacityExceededError (the save gives its lease back)."""
    path = tmp_path / "shrunk"
    path.write_bytes(b"\0" * 4 * PAGE)
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, 4 * PAGE, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    try:
        os.truncate(path, PAGE)  # three mapped pages now lie past the end
        assert populate_writable(address_of(mm), PAGE)
        assert not populate_writable(address_of(mm), 4 * PAGE)
    finally:
        mm.close()
    os.truncate(path, 4 * PAGE)
    monkeypatch.setattr(ring, "populate_writable", lambda addr, size: False)  # the tmpfs filled up meanwhile
    with pytest.raises(CapacityExceededError, match="could not be faulted in"):
        map_segment(str(path), 4 * PAGE)


def test_a_fresh_segment_is_faulted_in_on_all_cores_and_a_full_tmpfs_raises_leaving_no_file(
    pool: SegmentPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from memstore.errors import CapacityExceeded
    from memstore.server.memory import segment

    calls: list[int] = []

    def populate(addr: int, length: int) -> bool:
        calls.append(length)
        return populate_writable(addr, length)

    monkeypatch.setattr(segment, "populate_writable", populate)
    seg = pool.acquire(32 * MiB, "job")  # the store writes it itself: allocated in one multi-threaded pass
    assert calls == [seg.size] and seg.path is not None and blocks(seg.path) >= seg.size
    monkeypatch.setattr(segment, "populate_writable", lambda addr, length: False)  # what a full tmpfs answers
    before = set(os.listdir(pool.directory))
    with pytest.raises(CapacityExceeded, match="could not be faulted in"):
        pool.acquire(16 * MiB, "job")
    assert set(os.listdir(pool.directory)) == before  # the half-made file is gone
