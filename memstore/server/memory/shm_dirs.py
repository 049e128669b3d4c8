"""A store's segment directory on the tmpfs: its name, its lock, and orphans that no running store holds.

Files of one store live in ``<shm_dir>/<host_id>-<port>/`` (``segment_dir``), locked by ``.lock``
(``flock``) while the store runs (``claim``, by ``memstore.server.memory.pool.SegmentPool``). A directory whose
``.lock`` nobody holds belongs to no running store: an *orphan* (``orphaned_dirs``). A starting store takes
over its predecessor's orphan (``taken_over``: memstore.server.memory.shm_sweep adopts its verified segments) and
reclaims the others after a grace period (``reclaim_dir``); ``memstore reclaim-shm`` (``reclaim_orphans``)
removes them all at once by hand.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from memstore.core.sizes import format_size
from memstore.core.status import Orphan
from memstore.errors import ConfigError, StaleLock

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
SEGMENT_PREFIX = "seg-"
SIDECAR_PREFIX = "meta-"
TMP_INFIX = ".tmp-"
CLAIM_WAIT_SECONDS = 2.0  # a lock held only briefly (an orphan probe, a reclaim) does not fail a starting store
_STORE_DIR_NAME = re.compile(r"[A-Za-z0-9._-]{1,80}")


def segment_dir(shm_dir: str, host_id: str, listen: str) -> str:
    """The segment directory of one store: ``<shm_dir>/<host_id>-<port>`` ('' when ``shm_dir`` is '').

    ``listen`` is the store's *bound* HOST:PORT: the port is unique among the stores running on a
    machine, so two clusters with the same host ids never share a directory, and a replacement
    started with the same ``--host-id`` and ``--listen`` finds the directory of the store it replaces.
    """
    if not shm_dir:
        return ""
    port = listen.rpartition(":")[2]
    if not port.isdigit():
        raise ValueError(f"listen address {listen!r} has no numeric port")
    return os.path.join(shm_dir, f"{host_id}-{int(port)}")


def sidecar_path(segment_path: str) -> str:
    """Where the sidecar of the segment at ``segment_path`` lives: ``meta-<segment name>`` next to it."""
    head, name = os.path.split(segment_path)
    return os.path.join(head, SIDECAR_PREFIX + name)


# -- directory locks -----------------------------------------------------------------
def try_lock(directory: Path, create: bool) -> int | None:
    """flock ``directory/.lock`` exclusively: the fd, or None if another process holds it.

    Raises FileNotFoundError (no lock file and not ``create``), OSError, or StaleLock.
    """
    path = directory / LOCK_NAME
    fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    try:
        st, own = os.stat(path), os.fstat(fd)
        same = (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)
    except FileNotFoundError:
        same = False
    if not same:
        os.close(fd)
        raise StaleLock(str(path))
    return fd


def claim(directory: Path) -> int:
    """Own ``directory`` exclusively (created if missing): the fd of its flocked ``.lock``, held until closed.
    Waits up to ``CLAIM_WAIT_SECONDS`` for a lock held briefly (an orphan probe, a reclaim); ConfigError if a
    running store holds it or the directory is not usable."""
    deadline = time.monotonic() + CLAIM_WAIT_SECONDS
    while True:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = try_lock(directory, create=True)
        except StaleLock:
            fd = None  # reclaimed under our feet: recreate it
        except OSError as exc:
            raise ConfigError(f"--shm-dir {directory} is not usable: {exc}") from None
        if fd is not None:
            return fd
        if time.monotonic() >= deadline:
            raise ConfigError(
                f"--shm-dir {directory} is in use by another running store (same --host-id and --listen port?); give each store its own"
            )
        time.sleep(0.02)


def is_segment_name(name: str) -> bool:
    return name.startswith(SEGMENT_PREFIX) and TMP_INFIX not in name


def described_segments(directory: Path) -> list[tuple[float, str, int]] | None:
    """The segments of ``directory`` that have a sidecar (adoptable): (sidecar mtime, path, size), newest first;
    None if the directory cannot be listed (logged)."""
    candidates: list[tuple[float, str, int]] = []
    try:
        with os.scandir(directory) as it:
            for e in it:
                if not is_segment_name(e.name) or not e.is_file(follow_symlinks=False):
                    continue
                try:
                    size = e.stat(follow_symlinks=False).st_size
                    described_at = os.stat(sidecar_path(e.path)).st_mtime
                except OSError:
                    continue  # no sidecar: never described (or being allocated when the store died)
                candidates.append((described_at, e.path, size))
    except OSError as exc:
        log.warning("cannot list %s to adopt its segments: %s", directory, exc)
        return None
    return sorted(candidates, key=lambda c: (-c[0], c[1]))


def delete_except(directory: Path, keep: set[str]) -> int:
    """Delete every entry of ``directory`` whose name is not in ``keep`` (files and directories); how many went."""
    removed = 0
    try:
        children = list(directory.iterdir())
    except OSError:
        return 0
    for child in children:
        if child.name in keep:
            continue
        try:
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
            removed += 1
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot delete %s: %s", child, exc)
    return removed


def _is_ours(name: str) -> bool:
    """A name the pool creates in its directory."""
    return name == LOCK_NAME or name.startswith((SEGMENT_PREFIX, SIDECAR_PREFIX))


# -- orphans ---------------------------------------------------------------------------
def _store_dir_contents(directory: Path) -> list[os.DirEntry[str]] | None:
    """The entries of ``directory`` if it looks like a store's segment dir (else None: never touch it)."""
    if not _STORE_DIR_NAME.fullmatch(directory.name) or directory.is_symlink() or not directory.is_dir():
        return None
    try:
        with os.scandir(directory) as it:
            entries = list(it)
    except OSError:
        return None
    if not entries:
        return None
    for e in entries:
        if not _is_ours(e.name) or (e.name != LOCK_NAME and not e.is_file(follow_symlinks=False)):
            return None  # something that is not ours: leave the directory alone
    return entries


def _orphan_of(directory: Path, entries: list[os.DirEntry[str]]) -> Orphan:
    total = files = 0
    for e in entries:
        if e.name == LOCK_NAME:
            continue
        with contextlib.suppress(OSError):
            total += e.stat(follow_symlinks=False).st_size
            files += is_segment_name(e.name)
    return Orphan(str(directory), dir_host_id(directory.name), total, files)


def dir_host_id(name: str) -> str:
    """The host id a segment directory's name ``<host_id>-<port>`` carries (the whole name if it has no port)."""
    base, _, port = name.rpartition("-")
    return base if base and port.isdigit() else name


def _held(directory: Path) -> bool:
    """Whether a running store holds ``directory``'s lock (probed with a non-blocking flock, released at once)."""
    try:
        fd = try_lock(directory, create=False)
    except FileNotFoundError:
        return False  # no lock file: no store ever claimed it (or one is creating it right now: it retries)
    except (StaleLock, OSError):
        return True  # cannot tell: treat as owned
    if fd is None:
        return True
    os.close(fd)
    return False


def orphaned_dirs(shm_dir: str) -> list[Orphan]:
    """Segment directories under ``shm_dir`` whose ``.lock`` no running store holds, sorted by path.

    Only directories that look like a store's (nothing but ``.lock``, ``seg-*`` and ``meta-*`` files) are
    considered, so pointing this at a shared directory never reports anybody else's files.
    """
    if not shm_dir:
        return []
    try:
        children = sorted(Path(shm_dir).iterdir())
    except OSError:
        return []
    out: list[Orphan] = []
    for child in children:
        entries = _store_dir_contents(child)
        if entries is not None and not _held(child):
            out.append(_orphan_of(child, entries))
    return out


def reclaim_orphans(shm_dir: str) -> list[Orphan]:
    """Delete the orphaned segment directories under ``shm_dir``; returns those deleted (``reclaim_dir``)."""
    return [o for o in (reclaim_dir(Path(orphan.path)) for orphan in orphaned_dirs(shm_dir)) if o is not None]


def reclaim_dir(directory: Path) -> Orphan | None:
    """Delete the orphaned segment directory ``directory``: what it held, or None if it was left alone (a
    running store holds its lock, or it does not look like a store's).

    Deleted while holding its lock (``taken_over``), so a store starting with that directory meanwhile waits
    for it and then starts in a fresh one; a directory a store claimed since it was listed is skipped.
    """
    with taken_over(directory) as entries:
        if entries is None:
            return None
        final = _orphan_of(directory, entries)
    log.info("reclaimed orphaned segment dir %s (%d segments, %s)", final.path, final.files, format_size(final.bytes))
    return final


@contextlib.contextmanager
def taken_over(directory: Path) -> Iterator[list[os.DirEntry[str]] | None]:
    """Hold the lock of ``directory``, a dead store's segment directory, and yield its entries; on exit remove
    the directory with whatever is still in it (what the caller moved out stays). Yields None, and touches
    nothing, when a running store holds the lock or it does not look like a store's."""
    fd = None
    if _store_dir_contents(directory) is not None:  # never create a lock file in somebody else's directory
        try:
            fd = try_lock(directory, create=True)
        except (StaleLock, OSError):
            fd = None
    if fd is None:
        yield None  # held by a running store (or being reclaimed, or not a store's)
        return
    try:
        entries = _store_dir_contents(directory)
        yield entries
        if entries is not None:
            _remove_locked(directory)
    finally:
        os.close(fd)


def _remove_locked(directory: Path) -> None:
    """Remove every file of ``directory`` (a store's: ``_store_dir_contents``), its lock last, then the directory,
    and the dead store's control socket beside it (``<directory>.sock``, memstore.server.local_control_server)."""
    sock = directory.with_name(directory.name + ".sock")
    with contextlib.suppress(OSError):
        if stat.S_ISSOCK(os.lstat(sock).st_mode):
            os.unlink(sock)
    try:
        names = [n for n in os.listdir(directory) if n != LOCK_NAME]
    except OSError:
        return
    for name in names:
        if _is_ours(name):
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.unlink(directory / name)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(directory / LOCK_NAME)
    with contextlib.suppress(OSError):
        directory.rmdir()
