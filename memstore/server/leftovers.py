"""What a store leaves in its segment directory for the next one: sidecars written while it runs, and the
segments found at the next start, adopted or deleted.

A *sidecar* (``meta-seg-...``) is an opaque description (the engine's) written next to a segment once it holds a
verified shard (``write_sidecar``, atomically: a tmp file renamed into place). When a store was SIGKILLed, or
exited with ``keep_files``, the next store of its directory (same ``--host-id`` and ``--listen`` port) finds its
segments: ``Leftovers.settle`` adopts, once, those with a sidecar that the engine's check accepts (newest first,
as many as fit in the capacity) and deletes everything else the pool does not hold. A store that does not adopt
deletes them all, so it never serves stale segments. ``adopt_dead_dir`` does the same with the directory of
a dead predecessor under another host id (memstore.server.shm_sweep), moving what it keeps into the store's own.

The pool holds what is adopted; ``Leftovers`` asks it, through ``SegmentHolder``, for room and the names of the
files it holds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from memstore.core.sizes import format_size
from memstore.server.segment import Segment, SegmentMaker
from memstore.server.shm_dirs import LOCK_NAME, TMP_INFIX, delete_except, described_segments, sidecar_path, taken_over

log = logging.getLogger(__name__)

Check = Callable[[Segment, bytes], bool]  # the engine's verdict on a leftover segment and its sidecar bytes


def write_sidecar(segment_path: str, meta: bytes) -> None:
    """Write ``meta`` as the sidecar of the segment at ``segment_path``, atomically (tmp file + rename); raises
    OSError, leaving no tmp file behind."""
    sidecar = sidecar_path(segment_path)
    tmp = f"{sidecar}{TMP_INFIX}{secrets.token_hex(4)}"
    try:
        with open(tmp, "wb") as fh:
            fh.write(meta)
        os.replace(tmp, sidecar)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class SegmentHolder(Protocol):
    """What adoption asks of the pool (each call takes the pool's lock)."""

    capacity: int

    def room_left(self) -> int:
        """Bytes the capacity has left."""
        ...

    def hold(self, seg: Segment) -> None:
        """Account ``seg`` as in use."""
        ...

    def held_names(self) -> set[str]:
        """The file names of the segments held, and of their sidecars."""
        ...


class Leftovers:
    """The segments a previous store of ``directory`` left, until ``settle`` adopts or deletes them, once."""

    def __init__(self, directory: Path, maker: SegmentMaker, *, adopting: bool) -> None:
        """``adopting``: the pool will offer them to ``settle`` with a check (``SegmentPool.adopt``)."""
        self.directory = directory
        self.adopting = adopting
        self._maker = maker
        self._lock = threading.Lock()
        self.pending = True  # not settled yet

    def abandon(self) -> bool:
        """Give up on settling (the pool is closing): whether they were still pending. Takes no lock (the pool
        calls it with its own held; ``settle`` takes the pool's lock inside this one's)."""
        pending, self.pending = self.pending, False
        return pending

    def settle(self, check: Check | None, holder: SegmentHolder) -> list[tuple[Segment, bytes]]:
        """Adopt (``check`` given) or delete (None) the leftovers, then delete every file ``holder`` does not hold.
        Once: a later call with a check raises RuntimeError, one without does nothing. Returns the kept
        (segment, sidecar bytes), newest first."""
        with self._lock:
            if not self.pending:
                if check is not None:
                    if not self.adopting:
                        raise RuntimeError("SegmentPool.adopt() needs a pool constructed with adopt_leftovers=True")
                    raise RuntimeError("SegmentPool.adopt() must be called once, right after construction, before any acquire()")
                return []
            try:
                kept = self._adopt(check, holder) if check is not None else []
                delete_except(self.directory, {LOCK_NAME, *holder.held_names()})
            finally:
                self.pending = False
        return kept

    def _adopt(self, check: Check, holder: SegmentHolder) -> list[tuple[Segment, bytes]]:
        return adopt_described(self.directory, self._maker, check, holder)


def adopt_dead_dir(directory: Path, maker: SegmentMaker, check: Check, holder: SegmentHolder) -> list[tuple[Segment, bytes]] | None:
    """Adopt the described segments ``check`` accepts from ``directory``, the segment directory of a dead store
    (a predecessor of this one), into ``maker``'s directory, and remove ``directory`` with the rest; None
    (nothing touched) if a running store holds its lock or it is not a store's directory."""
    with taken_over(directory) as entries:
        if entries is None:
            return None
        return adopt_described(directory, maker, check, holder, into=maker.directory)


def adopt_described(
    directory: Path, maker: SegmentMaker, check: Check, holder: SegmentHolder, into: Path | None = None
) -> list[tuple[Segment, bytes]]:
    """Map each described segment of ``directory`` (newest first) and keep those ``check`` accepts that fit the
    capacity: held by ``holder``, and with ``into`` moved there with their sidecars (a rename: same tmpfs, no
    copy). Rejected ones are deleted; the caller deletes what is left. Returns the kept (segment, sidecar bytes)."""
    candidates = described_segments(directory)
    if candidates is None:
        return []
    kept: list[tuple[Segment, bytes]] = []
    rejected = 0
    for _, path, size in candidates:
        if size <= 0:
            rejected += 1
            continue
        if size > holder.room_left():
            log.warning("not adopting %s (%s): beyond the %s capacity", path, format_size(size), format_size(holder.capacity))
            rejected += 1
            continue
        try:
            with open(sidecar_path(path), "rb") as fh:
                meta = fh.read()
            seg = maker.map_existing(path, size)
        except (OSError, ValueError) as exc:
            log.warning("not adopting %s: unreadable: %s", path, exc)
            rejected += 1
            continue
        try:
            ok = bool(check(seg, meta))
        except Exception as exc:
            log.warning("not adopting %s: %s", path, exc)
            ok = False
        if ok and into is not None:
            ok = _move(seg, into)
        if not ok:
            seg.destroy()
            rejected += 1
            continue
        seg.exported = True
        seg.described = True
        holder.hold(seg)
        kept.append((seg, meta))
    if candidates or rejected:
        log.info(
            "adopted %d leftover segments (%s) of %s; discarded %d",
            len(kept),
            format_size(sum(s.size for s, _ in kept)),
            directory,
            rejected,
        )
    return kept


def _move(seg: Segment, into: Path) -> bool:
    """Rename ``seg``'s file and its sidecar into ``into`` (the map stays valid); whether it could."""
    assert seg.path is not None
    target = str(into / os.path.basename(seg.path))
    if os.path.lexists(target) or os.path.lexists(sidecar_path(target)):
        log.warning("not adopting %s: %s exists already", seg.path, target)
        return False
    try:
        os.rename(sidecar_path(seg.path), sidecar_path(target))
        os.rename(seg.path, target)
    except OSError as exc:
        log.warning("not adopting %s: cannot move it into %s: %s", seg.path, into, exc)
        with contextlib.suppress(OSError):
            os.unlink(sidecar_path(target))
        return False
    seg.path = target
    return True
