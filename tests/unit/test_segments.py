"""SegmentPool: exact accounting, sidecars, adoption of a crashed store's segments, clean close, orphans."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from memstore.cli import build_parser
from memstore.cli import main as cli_main
from memstore.config import StoreConfig
from memstore.errors import CapacityExceeded, ConfigError
from memstore.server.memory import shm_dirs
from memstore.server.memory.pool import PAGE, Segment, SegmentPool
from memstore.server.memory.shm_dirs import orphaned_dirs, reclaim_orphans, segment_dir, sidecar_path

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
KiB = 1 << 10


def seg_files(directory: str | Path) -> list[str]:
    """Segment data files (no sidecars, no lock) in ``directory``."""
    d = Path(directory)
    return sorted(p.name for p in d.iterdir() if p.name.startswith("seg-")) if d.exists() else []


def all_files(directory: str | Path) -> list[str]:
    d = Path(directory)
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def disk_bytes(directory: str | Path) -> int:
    return sum((Path(directory) / n).stat().st_size for n in seg_files(directory))


def fill(seg: Segment, byte: int) -> bytes:
    data = bytes([byte]) * seg.size
    seg.view()[:] = data
    return data


def crashed_store(directory: Path, script: str) -> None:
    """Run ``script`` (with ``pool`` a SegmentPool on ``directory``) in a child that then SIGKILLs itself."""
    header = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from memstore.server.memory.pool import SegmentPool
        pool = SegmentPool({str(directory)!r}, 1 << 30)
        """
    )
    code = header + textwrap.dedent(script) + "\nos.kill(os.getpid(), signal.SIGKILL)\n"
    proc = subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


# -- namespacing -----------------------------------------------------------------------
def test_segment_dir_is_host_and_port() -> None:
    assert segment_dir("/dev/shm/memstore", "h0", "127.0.0.1:7070") == "/dev/shm/memstore/h0-7070"
    assert segment_dir("/x", "node-3.a", "[::1]:80") == "/x/node-3.a-80"
    assert segment_dir("", "h0", "127.0.0.1:7070") == ""
    with pytest.raises(ValueError, match="port"):
        segment_dir("/x", "h0", "nowhere")


def test_same_host_id_different_ports_do_not_collide(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(shm_dirs, "CLAIM_WAIT_SECONDS", 0.1)
    shm = str(tmp_path / "shm")
    a = SegmentPool(segment_dir(shm, "h0", "127.0.0.1:7070"), 1 << 20)
    b = SegmentPool(segment_dir(shm, "h0", "127.0.0.1:8080"), 1 << 20)
    try:
        sa, sb = a.acquire(PAGE, "job"), b.acquire(PAGE, "job")
        assert Path(sa.path or "").parent != Path(sb.path or "").parent
        with pytest.raises(ConfigError, match="in use by another running store"):
            SegmentPool(segment_dir(shm, "h0", "0.0.0.0:7070"), 1 << 20)  # same host id and port: refused
        assert orphaned_dirs(shm) == []  # both are held
    finally:
        a.close()
        b.close()
    assert all_files(shm) == []  # clean exits remove their directories


def test_a_lock_probe_does_not_fail_a_starting_store(tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = tmp_path / "h0-1"
    d.mkdir()
    fd = os.open(d / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what orphaned_dirs() does for an instant
    result: list[object] = []
    t = threading.Thread(target=lambda: result.append(SegmentPool(str(d), 1 << 20)))
    t.start()
    os.close(fd)
    t.join(timeout=10)
    (pool,) = result
    assert isinstance(pool, SegmentPool)
    pool.close()


# -- accounting ------------------------------------------------------------------------
def test_accounting_is_exact_through_acquire_release_trim(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pool = SegmentPool(str(tmp_path / "h0-1"), 64 * PAGE)
    d = pool.directory
    assert d is not None

    def check() -> None:
        assert pool.used_bytes == pool.in_use_bytes + pool.pooled_bytes == pool.tracked_bytes == disk_bytes(d)
        assert pool.segment_count == len(seg_files(d))

    a = pool.acquire(10 * PAGE, "job")
    b = pool.acquire(3 * PAGE + 1, "job")  # rounded up to whole pages
    check()
    assert b.size == 4 * PAGE and pool.in_use_bytes == 14 * PAGE
    pool.release(a)
    assert pool.in_use_bytes == 4 * PAGE and pool.pooled_bytes == 10 * PAGE
    check()
    again = pool.acquire(10 * PAGE, "job")  # the pooled one comes back
    assert again is a and pool.pooled_bytes == 0
    pool.release(a)
    pool.release(a)  # twice: ignored, accounting unharmed
    check()
    other = pool.acquire(10 * PAGE, "other-job")  # never another job's pooled bytes
    assert other is not a
    check()
    with pytest.raises(CapacityExceeded):
        pool.acquire(60 * PAGE, "job")  # drops the pooled segment trying to make room, still does not fit
    check()
    assert pool.pooled_bytes == 0 and pool.in_use_bytes == 14 * PAGE
    exported = pool.acquire(PAGE, "job")
    exported.exported = True
    pool.release(exported)  # a reader mapped it: unlinked, not pooled
    check()
    spare = pool.acquire(PAGE, "job")
    pool.release(spare, reuse=False)  # nothing will need it soon (a parity fragment dropped): unlinked, not pooled
    check()
    assert pool.pooled_bytes == 0 and pool.in_use_bytes == 14 * PAGE
    pool.release(b)
    pool.trim(0)
    check()
    assert pool.used_bytes == 10 * PAGE and seg_files(d) == [os.path.basename(other.path or "")]
    pool.close()
    assert not d.exists()


def test_anonymous_pool_without_shm_dir() -> None:
    pool = SegmentPool(None, 8 * PAGE)
    seg = pool.acquire(PAGE, "job")
    assert seg.path is None
    pool.describe(seg, b"ignored")  # nothing to adopt without files
    assert pool.adopt(lambda s, m: True) == []
    pool.release(seg)
    assert pool.used_bytes == pool.tracked_bytes == PAGE
    pool.close()
    assert pool.used_bytes == 0


# -- sidecars and close ------------------------------------------------------------------
def test_sidecars_follow_the_segment(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pool = SegmentPool(str(tmp_path / "h0-1"), 16 * PAGE)
    seg = pool.acquire(PAGE, "job")
    assert seg.path is not None
    pool.describe(seg, b"manifest v1")
    pool.describe(seg, b"manifest v2")  # replaced atomically
    assert Path(sidecar_path(seg.path)).read_bytes() == b"manifest v2"
    assert not [n for n in all_files(tmp_path / "h0-1") if ".tmp-" in n]
    pool.release(seg)  # pooled: no sidecar, never adoptable
    assert not Path(sidecar_path(seg.path)).exists() and Path(seg.path).exists()
    pool.describe(seg, b"late")  # released meanwhile: no sidecar appears
    assert not Path(sidecar_path(seg.path)).exists()
    again = pool.acquire(PAGE, "job")
    assert again is seg and not Path(sidecar_path(seg.path)).exists()
    pool.describe(again, b"v3")
    again.exported = True
    pool.release(again)  # destroyed: file and sidecar gone
    assert all_files(tmp_path / "h0-1") == [".lock"]
    pool.close()


def test_close_unlinks_every_segment_in_use_and_pooled(tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = tmp_path / "h0-1"
    pool = SegmentPool(str(d), 16 * PAGE)
    kept = [pool.acquire(PAGE, "job") for _ in range(3)]
    for s in kept:
        pool.describe(s, b"m")
    pool.release(pool.acquire(2 * PAGE, "job"))
    assert len(seg_files(d)) == 4
    pool.close()
    assert not d.exists() and pool.used_bytes == 0
    pool.release(kept[0])  # the engine releasing after close: harmless
    assert pool.used_bytes == 0


def test_keep_files_keeps_segments_in_use_with_their_sidecars(tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = tmp_path / "h0-1"
    pool = SegmentPool(str(d), 16 * PAGE)
    described, plain = pool.acquire(PAGE, "job"), pool.acquire(PAGE, "job")
    pool.describe(described, b"m")
    pool.release(pool.acquire(2 * PAGE, "job"))  # pooled: goes anyway
    pool.keep_files_on_close = True  # what the server sets from --shm-keep-on-exit
    pool.close()
    names = {os.path.basename(described.path or ""), os.path.basename(plain.path or "")}
    assert set(seg_files(d)) == names
    assert Path(sidecar_path(described.path or "")).read_bytes() == b"m"
    # ... and the next store of this directory adopts the described one, deletes the rest.
    pool2 = SegmentPool(str(d), 16 * PAGE, adopt_leftovers=True)
    kept = pool2.adopt(lambda s, m: m == b"m")
    assert [(s.path, m) for s, m in kept] == [(described.path, b"m")]
    assert seg_files(d) == [os.path.basename(described.path or "")]
    pool2.close(keep_files=False)
    assert not d.exists()


def test_keep_files_with_nothing_in_use_removes_the_directory(tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = tmp_path / "h0-1"
    pool = SegmentPool(str(d), 16 * PAGE, adopt_leftovers=True)
    pool.adopt(lambda s, m: True)
    pool.release(pool.acquire(PAGE, "job"))
    pool.close(keep_files=True)
    assert not d.exists()


# -- adoption ----------------------------------------------------------------------------
def test_adopt_after_sigkill_keeps_described_segments_that_check(tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = tmp_path / "h0-1"
    crashed_store(
        d,
        """
        for i, byte in enumerate((1, 2, 3, 4)):
            seg = pool.acquire(2 * 4096, "job")
            seg.view()[:] = bytes([byte]) * seg.size
            if byte != 4:                      # 4: allocated, never described (a trainer was copying in)
                pool.describe(seg, bytes([byte]))
        pool.release(pool.acquire(4096, "job"))   # pooled: no sidecar
        open(os.path.join(pool.directory, "meta-" + os.path.basename(seg.path) + ".tmp-dead"), "wb").write(b"half")  # being written
        open(os.path.join(pool.directory, "meta-seg-99-0-orphan"), "wb").write(b"x")  # a sidecar without its segment
        """,
    )
    assert len(seg_files(d)) == 5 and orphaned_dirs(str(tmp_path)) != []
    pool = SegmentPool(str(d), 1 << 20, adopt_leftovers=True)
    seen: list[bytes] = []

    def check(seg: Segment, meta: bytes) -> bool:
        seen.append(meta)
        if meta == b"\x02":
            raise ValueError("checksum mismatch")  # rejected by raising
        return bytes(seg.view()) == meta * seg.size

    kept = pool.adopt(check)
    assert sorted(seen) == [b"\x01", b"\x02", b"\x03"]
    assert sorted(m for _, m in kept) == [b"\x01", b"\x03"]
    expected = [os.path.basename(p) for s, _ in kept for p in (s.path or "", sidecar_path(s.path or ""))]
    assert all_files(d) == sorted([".lock", *expected])
    assert pool.in_use_bytes == pool.used_bytes == pool.tracked_bytes == disk_bytes(d) == 4 * PAGE
    assert all(s.exported and bytes(s.view(1)) == m for s, m in kept)
    assert orphaned_dirs(str(tmp_path)) == []  # it is owned again
    with pytest.raises(RuntimeError, match="once"):
        pool.adopt(check)
    seg = kept[0][0]
    pool.release(seg)  # adopted segments are never recycled (a reader of the old store may map them)
    assert not Path(seg.path or "").exists() and not Path(sidecar_path(seg.path or "")).exists()
    assert pool.pooled_bytes == 0 and pool.in_use_bytes == 2 * PAGE
    pool.close()
    assert not d.exists()


def test_adopt_keeps_the_newest_that_fit_in_capacity(tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = tmp_path / "h0-1"
    pool = SegmentPool(str(d), 16 * PAGE)
    segs = [pool.acquire(2 * PAGE, "job") for _ in range(3)]
    for i, s in enumerate(segs):
        pool.describe(s, bytes([i]))
        os.utime(sidecar_path(s.path or ""), (1000 + i, 1000 + i))  # described in order 0, 1, 2
    pool.close(keep_files=True)
    small = SegmentPool(str(d), 5 * PAGE, adopt_leftovers=True)  # room for two of the three
    kept = small.adopt(lambda s, m: True)
    assert [m for _, m in kept] == [b"\x02", b"\x01"]
    assert small.in_use_bytes == 4 * PAGE == disk_bytes(d) and len(seg_files(d)) == 2
    with pytest.raises(CapacityExceeded):
        small.acquire(2 * PAGE, "job")
    small.close()


def test_without_adopt_leftovers_are_deleted(tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = tmp_path / "h0-1"
    crashed_store(d, "pool.describe(pool.acquire(4096, 'job'), b'm')")
    assert len(seg_files(d)) == 1
    plain = SegmentPool(str(d), 16 * PAGE)  # a store that does not adopt: wiped at construction
    assert all_files(d) == [".lock"]
    with pytest.raises(RuntimeError, match="adopt_leftovers=True"):
        plain.adopt(lambda s, m: True)
    plain.close(keep_files=True)


def test_adopt_never_called_the_first_acquire_starts_clean(tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = tmp_path / "h0-1"
    crashed_store(d, "pool.describe(pool.acquire(4096, 'job'), b'm')")
    pool = SegmentPool(str(d), 16 * PAGE, adopt_leftovers=True)
    assert len(seg_files(d)) == 1  # construction deletes nothing: adopt() gets its chance first
    seg = pool.acquire(PAGE, "job")
    assert seg_files(d) == [os.path.basename(seg.path or "")] and all_files(d) == sorted([".lock", *seg_files(d)])
    with pytest.raises(RuntimeError, match="before any acquire"):
        pool.adopt(lambda s, m: True)
    pool.close()


def test_adopt_with_a_full_dir_of_junk_leaves_only_the_lock(tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = tmp_path / "h0-1"
    d.mkdir()
    (d / "seg-1-0-aaaa").write_bytes(b"")  # empty segment with a sidecar: unreadable
    (d / "meta-seg-1-0-aaaa").write_bytes(b"m")
    (d / "seg-1-1-bbbb").write_bytes(b"\0" * PAGE)  # no sidecar
    (d / "stray").mkdir()
    pool = SegmentPool(str(d), 16 * PAGE, adopt_leftovers=True)
    assert pool.adopt(lambda s, m: True) == []
    assert all_files(d) == [".lock"] and pool.used_bytes == 0
    pool.close()


# -- orphans -----------------------------------------------------------------------------
def test_orphans_are_unlocked_store_dirs_and_reclaim_removes_only_them(tmp_path) -> None:  # type: ignore[no-untyped-def]
    shm = tmp_path / "shm"
    crashed_store(shm / "h1-7071", "pool.describe(pool.acquire(3 * 4096, 'job'), b'm'); pool.acquire(4096, 'job')")
    running = SegmentPool(str(shm / "h0-7070"), 16 * PAGE)
    running.acquire(PAGE, "job")
    (shm / "h2").mkdir()  # an old-layout dir of a store that is gone
    (shm / "h2" / ".lock").write_bytes(b"")
    (shm / "not-ours").mkdir()  # somebody else's directory: never touched
    (shm / "not-ours" / "data.bin").write_bytes(b"x")
    (shm / "loose-file").write_bytes(b"x")
    orphans = orphaned_dirs(str(shm))
    assert [(o.path, o.host_id, o.files) for o in orphans] == [(str(shm / "h1-7071"), "h1", 2), (str(shm / "h2"), "h2", 0)]
    assert orphans[0].bytes == 4 * PAGE + 1  # two segments and a 1-byte sidecar
    assert running.orphans() == orphans
    # A lock taken again after listing (a store starting): that dir is not deleted.
    fd = os.open(shm / "h2" / ".lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        reclaimed = reclaim_orphans(str(shm))
    finally:
        os.close(fd)
    assert [o.path for o in reclaimed] == [str(shm / "h1-7071")] and reclaimed[0].bytes == 4 * PAGE + 1
    assert sorted(p.name for p in shm.iterdir()) == ["h0-7070", "h2", "loose-file", "not-ours"]
    assert [o.path for o in reclaim_orphans(str(shm))] == [str(shm / "h2")]
    assert len(seg_files(shm / "h0-7070")) == 1 and orphaned_dirs(str(shm)) == []
    running.close()
    assert sorted(p.name for p in shm.iterdir()) == ["loose-file", "not-ours"]
    assert orphaned_dirs(str(tmp_path / "missing")) == [] and orphaned_dirs("") == []


def test_reclaim_shm_command(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    shm = tmp_path / "shm"
    crashed_store(shm / "h3-9000", "pool.acquire(2 * 4096, 'job')")
    assert cli_main(["reclaim-shm", "--shm-dir", str(tmp_path / "typo")]) == 2  # a wrong path is an error, not "nothing to do"
    assert "is not a directory" in capsys.readouterr().err
    assert cli_main(["reclaim-shm", "--shm-dir", str(shm), "--dry-run", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["dry_run"] and listed["bytes"] == 2 * PAGE
    assert listed["orphans"] == [{"path": str(shm / "h3-9000"), "host_id": "h3", "bytes": 2 * PAGE, "files": 1}]
    assert (shm / "h3-9000").exists()
    assert cli_main(["reclaim-shm", "--shm-dir", str(shm)]) == 0
    out = capsys.readouterr().out
    assert "reclaimed 1 orphaned segment dirs" in out and "h3-9000" in out
    assert not (shm / "h3-9000").exists()
    assert cli_main(["reclaim-shm", "--shm-dir", str(shm)]) == 0
    assert "no orphaned segment dirs" in capsys.readouterr().out


def test_shm_keep_on_exit_flag() -> None:
    base = {"host_id": "h0", "replicas": "1"}
    assert StoreConfig.load(base, env={}).shm_keep_on_exit is False
    assert StoreConfig.load(base, env={"MEMSTORE_SHM_KEEP_ON_EXIT": "1"}).shm_keep_on_exit is True
    with pytest.raises(ConfigError, match="--shm-keep-on-exit"):
        StoreConfig.load({**base, "shm_keep_on_exit": "maybe"}, env={})
    parser = build_parser()
    assert parser.parse_args(["serve", "--shm-keep-on-exit"]).shm_keep_on_exit is True
    assert parser.parse_args(["serve", "--no-shm-keep-on-exit"]).shm_keep_on_exit is False
    assert parser.parse_args(["serve"]).shm_keep_on_exit is None  # env / file / default decide
    cli = {"shm_keep_on_exit": False, **base}
    assert StoreConfig.load(cli, env={"MEMSTORE_SHM_KEEP_ON_EXIT": "true"}).shm_keep_on_exit is False  # CLI wins
