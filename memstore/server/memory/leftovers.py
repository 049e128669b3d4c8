"""What a store leaves in its segment directory for the next one: sidecars written while it runs, and the
segments found at the next start, adopted or deleted.

A *sidecar* (``meta-seg-...``) is an opaque description (the engine's) written next to a segment once it holds a
verified shard (``write_sidecar``, atomically: a tmp file renamed into place). When a store was SIGKILLed, or
exited with ``keep_files``, the next store of its directory (same ``--host-id`` and ``--listen`` port) finds its
segments: ``Leftovers.settle`` adopts, once, those with a sidecar that the engine's check accepts (newest first,
as many as fit in the capacity) and deletes everything else the pool does not hold. A store that does not adopt
deletes them all, so it never serves stale segments. ``adopt_dead_dir`` does the same with the directory of
a dead predecessor under another host id (memstore.server.memory.shm_sweep), moving what it keeps into the store's own.

The pool holds what is adopted; ``Leftovers`` asks it, through ``SegmentHolder``, for room and the names of the
files it holds.

The engine's side of the same files: ``Sidecars`` encodes what a sidecar holds (a settled copy's ``ShardInfo``, as
the protobuf ``memstore.server.convert`` makes of it) for the catalog, and ``Adoption`` checks each leftover against
its sidecar and registers the good ones in the catalog (crash adoption). The catalog and the other parts of the
engine speak the core's types only; the bytes of a sidecar are made and read here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from memstore.core.model import ShardInfo, ShardKey, ShardState
from memstore.core.sizes import format_size
from memstore.server.convert import sidecar_bytes, sidecar_info
from memstore.server.engine.entries import Entry
from memstore.server.memory.segment import Segment, SegmentMaker
from memstore.server.memory.shm_dirs import LOCK_NAME, TMP_INFIX, delete_except, described_segments, sidecar_path, taken_over
from memstore.v1.integrity import first_mismatch
from memstore.v1.keys import key_problem
from memstore.v1.streams import manifest_problem, stripe_problem

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


class SidecarPool(Protocol):
    """What the engine's side asks of the segment pool (``memstore.server.memory.pool.SegmentPool``)."""

    def describe(self, seg: Segment, meta: bytes) -> None:
        """Write ``meta`` as ``seg``'s sidecar (logged, not raised, when it cannot)."""
        ...

    def adopt(self, check: Check) -> list[tuple[Segment, bytes]]:
        """This directory's leftovers that ``check`` accepts, held by the pool now."""
        ...

    def adopt_from(self, directory: Path, check: Check) -> list[tuple[Segment, bytes]] | None:
        """Those of a dead predecessor's ``directory``, moved into the pool's; None if it is not dead."""
        ...

    def release(self, seg: Segment) -> None:
        """Give a segment back."""
        ...


class AdoptingCatalog(Protocol):
    """What adoption asks of the catalog (``memstore.server.engine.catalog.Catalog``; each call takes its lock)."""

    def get(self, key: ShardKey) -> Entry | None:
        """The copy of ``key`` held, if any."""
        ...

    def register_adopted(self, entries: list[Entry]) -> tuple[list[Entry], int]:
        """Register ``entries`` but those whose shard is held already: returns them, and the bytes held."""
        ...


class Sidecars:
    """Writes a settled copy's sidecar: its ``ShardInfo`` as a serialized ``memstore.v1.ShardInfo``.

    The catalog calls ``describe`` under its lock, so a sidecar is never written for a copy already dropped (the
    pool's lock, taken inside, serializes it with the segment's release). No lock of its own: it only encodes.
    """

    def __init__(self, pool: SidecarPool) -> None:
        self._pool = pool

    def describe(self, segment: Segment, info: ShardInfo) -> None:
        self._pool.describe(segment, sidecar_bytes(info))


class Adoption:
    """Crash adoption: the verified shards a previous incarnation of this host left in shared memory, or a dead
    predecessor under another host id left in its segment directory, registered in the catalog like copies pulled by
    repair, so repair finds them held and a store that crashed serves its RAM again without a network repair
    (GEMINI's software-failure path).

    No lock of its own. The check runs while the pool settles its leftovers (``Leftovers``' lock held) and takes the
    catalog's lock to ask whether a shard is held; the registration is one step under the catalog's lock that asks
    again, so a shard pulled or saved in between is not adopted twice (its leftover segment goes back).
    """

    def __init__(self, host_id: str, catalog: AdoptingCatalog, pool: SidecarPool) -> None:
        self.host_id = host_id
        self._catalog = catalog
        self._pool = pool

    def adopt(self, predecessor: Path | None = None) -> int:
        """Take over this host's leftovers, or (with ``predecessor``) those of a dead predecessor's segment directory
        (``SegmentPool.adopt_from``); returns how many shards were adopted.

        A segment is adopted only if its sidecar is well-formed, names a settled copy, and every chunk still matches
        its checksum; the rest is deleted. A shard this store holds already is not adopted twice.
        """
        found = self._pool.adopt(self._check) if predecessor is None else self._pool.adopt_from(predecessor, self._check) or []
        entries = [self._entry(seg, sidecar_info(meta), predecessor) for seg, meta in found]
        twice, held = self._catalog.register_adopted(entries)
        for entry in twice:
            self._pool.release(entry.segment)
        count = len(entries) - len(twice)
        if count:
            log.info(
                "adopted %d shards (%d bytes held) left in shared memory by %s; verified every chunk",
                count, held, "this host's previous incarnation" if predecessor is None else predecessor,
            )  # fmt: skip
        return count

    def _check(self, seg: Segment, meta: bytes) -> bool:
        info = sidecar_info(meta)
        m = info.manifest
        problem = manifest_problem(m) or key_problem(m.key.job_id, m.key.step, m.key.rank, m.world_size, m.key.timeline)
        if not problem and m.stripe is not None:
            problem = stripe_problem(m.stripe, m.key.rank, m.world_size, m.nbytes)
        if problem or info.state is None or not info.state.settled or m.nbytes > seg.size or self._catalog.get(m.key) is not None:
            return False
        return first_mismatch(seg.view(), m.nbytes, m.chunk_size, m.checksums) is None

    def _entry(self, seg: Segment, info: ShardInfo, predecessor: Path | None) -> Entry:
        m = info.manifest
        seg.owner = m.key.job_id  # never pooled for another job
        state = info.state or ShardState.REPLICA
        if predecessor is not None and m.owner_host != self.host_id:
            state = ShardState.REPLICA  # a predecessor's copy: held like one repair pulled
        return Entry(
            m.key, m.world_size, m.nbytes, seg, m.owner_host, state, manifest=m, metrics=dict(m.metrics),
            format_version=m.format_version, copies=info.copies, created_unix=m.created_unix or time.time(),
            spill_codec=m.spill_codec, stripe=m.stripe, erasure=info.erasure,
        )  # fmt: skip
