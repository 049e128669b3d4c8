"""memstore.server.memory.leftovers alone: sidecars, and adopting or deleting what a previous store left, against a
fake pool (``FakeHolder``). The pool's side (SegmentPool.adopt after a SIGKILL, keep_files) is in test_segments."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from memstore.server.memory.leftovers import Leftovers, write_sidecar
from memstore.server.memory.pages import PAGE
from memstore.server.memory.segment import Segment, SegmentMaker
from memstore.server.memory.shm_dirs import LOCK_NAME, sidecar_path

pytestmark = pytest.mark.unit


class FakeHolder:
    """The pool, as adoption sees it: a capacity, and the segments it holds."""

    def __init__(self, capacity: int, names: set[str] | None = None) -> None:
        self.capacity = capacity
        self.held: list[Segment] = []
        self.names = names or set()

    def room_left(self) -> int:
        return self.capacity - sum(s.size for s in self.held)

    def hold(self, seg: Segment) -> None:
        self.held.append(seg)

    def held_names(self) -> set[str]:
        return (
            self.names
            | {os.path.basename(s.path or "") for s in self.held}
            | {os.path.basename(sidecar_path(s.path or "")) for s in self.held}
        )


def leave(directory: Path, name: str, pages: int, meta: bytes | None, described_at: float = 1000.0) -> str:
    """A segment file a previous store left, with its sidecar (``meta``) or none."""
    path = directory / name
    path.write_bytes(bytes([pages]) * (pages * PAGE))
    if meta is not None:
        write_sidecar(str(path), meta)
        os.utime(sidecar_path(str(path)), (described_at, described_at))
    return str(path)


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    d = tmp_path / "h0-1"
    d.mkdir()
    (d / LOCK_NAME).write_bytes(b"")
    return d


def test_write_sidecar_replaces_atomically_and_leaves_no_tmp_file(directory: Path) -> None:
    seg = str(directory / "seg-1-0-aaaa")
    write_sidecar(seg, b"v1")
    write_sidecar(seg, b"v2")
    assert Path(sidecar_path(seg)).read_bytes() == b"v2"
    assert sorted(p.name for p in directory.iterdir()) == [LOCK_NAME, "meta-seg-1-0-aaaa"]
    with pytest.raises(OSError):
        write_sidecar(str(directory / "gone" / "seg-1-1-bbbb"), b"v1")


def test_settle_adopts_the_newest_accepted_that_fit_and_deletes_the_rest(directory: Path) -> None:
    old = leave(directory, "seg-1-0-aaaa", 2, b"old", described_at=1000)
    new = leave(directory, "seg-1-1-bbbb", 2, b"new", described_at=2000)
    leave(directory, "seg-1-2-cccc", 1, b"bad", described_at=3000)
    leave(directory, "seg-1-3-dddd", 1, None)  # never described
    leave(directory, "seg-1-4-eeee", 1, b"boom", described_at=4000)
    (directory / "meta-seg-1-5-ffff.tmp-dead").write_bytes(b"half")
    (directory / "stray").mkdir()
    holder = FakeHolder(capacity=3 * PAGE, names={"seg-9-9-held"})  # room for one of the two it accepts
    (directory / "seg-9-9-held").write_bytes(b"")  # a segment the pool holds: kept
    seen: list[bytes] = []

    def check(seg: Segment, meta: bytes) -> bool:
        seen.append(meta)
        if meta == b"boom":
            raise ValueError("checksum mismatch")
        return meta != b"bad" and bytes(seg.view(1)) == bytes([seg.size // PAGE])

    leftovers = Leftovers(directory, SegmentMaker(directory), adopting=True)
    kept = leftovers.settle(check, holder)
    assert [(s.path, m) for s, m in kept] == [(new, b"new")] and holder.held == [kept[0][0]]
    assert seen == [b"boom", b"bad", b"new"]  # newest first; the old one did not fit, so it was never checked
    assert all(s.exported and s.described for s, _ in kept)
    assert sorted(p.name for p in directory.iterdir()) == sorted([LOCK_NAME, "seg-9-9-held", "seg-1-1-bbbb", "meta-seg-1-1-bbbb"])
    assert not Path(old).exists() and not leftovers.pending
    with pytest.raises(RuntimeError, match="once"):
        leftovers.settle(check, holder)
    kept[0][0].unmap()


def test_settle_without_a_check_deletes_all_but_what_the_pool_holds(directory: Path) -> None:
    leave(directory, "seg-1-0-aaaa", 1, b"m")
    leftovers = Leftovers(directory, SegmentMaker(directory), adopting=False)
    assert leftovers.settle(None, FakeHolder(1 << 20)) == []
    assert [p.name for p in directory.iterdir()] == [LOCK_NAME]
    assert leftovers.settle(None, FakeHolder(1 << 20)) == []  # settled: nothing more to do
    with pytest.raises(RuntimeError, match="adopt_leftovers=True"):
        leftovers.settle(lambda s, m: True, FakeHolder(1 << 20))


def test_abandon_leaves_the_files_and_ends_the_wait(directory: Path) -> None:
    leave(directory, "seg-1-0-aaaa", 1, b"m")
    leftovers = Leftovers(directory, SegmentMaker(directory), adopting=True)
    assert leftovers.abandon() and not leftovers.abandon()
    assert leftovers.settle(None, FakeHolder(1 << 20)) == []
    assert sorted(p.name for p in directory.iterdir()) == [LOCK_NAME, "meta-seg-1-0-aaaa", "seg-1-0-aaaa"]


def test_an_unlistable_directory_adopts_nothing(tmp_path: Path) -> None:
    leftovers = Leftovers(tmp_path / "missing", SegmentMaker(tmp_path / "missing"), adopting=True)
    holder = FakeHolder(1 << 20)
    assert leftovers.settle(lambda s, m: True, holder) == [] and holder.held == []
