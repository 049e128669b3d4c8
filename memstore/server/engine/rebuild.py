"""Rebuilding what a lost host held under ``--redundancy ec:K+M``: its shards from the survivors, its parity from the data.

**A lost shard** (a replacement's own, or any shard a restore asks for that no store holds): its group's parity hosts
list it (``ParityCover``: its manifest with checksums, its place in its owner's part). For every row its blocks fall in
(a ``memstore.core.parts.Run``), the rebuild reads, in parallel from every survivor, the row's parity fragment(s) over
the run's positions (``ReadParity``, which also says whose contributions they hold) and the blocks of every other data
shard in them (``ReadRange``, strided), and the codec solves for the lost column (M=1: the XOR of all of them). The
result is checked against the manifest's checksums before it is registered: bit-exact, or ``ChecksumMismatch`` (a
parity or a block is corrupt), never served. A parity whose block fails its own checksum is dropped by its keeper and
not used; one that passes them and still gives a shard that fails is set aside by trying the row's other combinations
of parities (M >= 2, while fewer than M columns of the row are lost) before reporting.

**Lost parity** (a replacement's fragments, or contributions that never arrived): for each row this store keeps parity
of, every data shard of the row's hosts (their listings say where it lies: ``ShardInfo.erasure``) that its fragment
lacks is read back from its owner and added (``ParityKeeper.add``): the data hosts re-contribute by being read.

``repair_once`` does both, every ``--repair-interval`` (the store's ``repair`` thread under ec:K+M), the newest step of
every job first (what a restarted trainer restores), and ``Recovery.fetch`` calls ``rebuild`` for a restore.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from memstore.config import StoreConfig
from memstore.core.erasure_layout import BLOCK
from memstore.core.model import ErasurePlace, Holding, Manifest, ShardInfo, ShardKey, ShardState
from memstore.core.parts import Run, data_columns, parity_columns, row_data_columns, runs
from memstore.core.rebuildable import can_rebuild_from
from memstore.core.retention import ranked_versions
from memstore.erasure.codec import Codec
from memstore.errors import ChecksumMismatch, PeerUnavailable, ShardNotFound, StoreError
from memstore.server.engine.catalog import Catalog
from memstore.server.engine.encoding import erasure_group, holder_of
from memstore.server.engine.entries import Entry, holdings_of
from memstore.server.engine.parity import ParityKeeper
from memstore.server.engine.room import Room
from memstore.server.events import StoreEvents
from memstore.server.membership import ClusterView, Membership
from memstore.server.peers import PeerDirectory
from memstore.v1.integrity import checksum, chunk_spans

log = logging.getLogger(__name__)

WINDOW = 32  # positions a rebuild solves at once per row (WINDOW blocks per column in memory)
READERS = 16  # reads in flight at once, over every survivor


@dataclass(frozen=True)
class Parity:
    """One parity fragment read over a window: its index in the row, its bytes, whose contributions they hold."""

    index: int
    data: np.ndarray
    contributors: tuple[ShardInfo, ...]


class Rebuilder:
    """Rebuilds lost shards from their group's survivors, and this store's parity fragments from their data hosts."""

    def __init__(
        self, catalog: Catalog, keeper: ParityKeeper, room: Room, config: StoreConfig, membership: Membership, peers: PeerDirectory,
        events: StoreEvents, stop: threading.Event, retention_due: threading.Event,
    ) -> None:  # fmt: skip
        self.catalog = catalog
        self.keeper = keeper
        self.room = room
        self.config = config
        self.host_id = config.host_id
        self.membership = membership
        self.peers = peers
        self.events = events
        self._stop = stop
        self.retention_due = retention_due
        self._reads = ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="rebuild-read")
        self._codecs: dict[tuple[int, int], Codec] = {}
        self._lock = threading.Lock()
        self.rebuilt = 0  # shards rebuilt here
        self.refilled = 0  # contributions read back into this store's fragments
        self.set_aside = 0  # rows of rebuilds solved again with other parities, the first ones giving a shard that failed

    def close(self) -> None:
        self._reads.shutdown(wait=False, cancel_futures=True)

    def _codec(self, place: ErasurePlace) -> Codec:
        shape = (data_columns(place), place.m)
        with self._lock:
            if shape not in self._codecs:
                self._codecs[shape] = Codec(*shape)
            return self._codecs[shape]

    # ---- what the group lists

    def group_listings(self, job_id: str, view: ClusterView | None = None) -> dict[str, list[ShardInfo] | StoreError]:
        """What every other member of this store's group lists of ``job_id`` (every job: "")."""
        view = view or self.membership.view
        group = erasure_group(view) or ()
        hosts = [h for h in (view.table.holder(s) for s in group) if h and h != self.host_id]
        return self.peers.list_all(job_id, self.config.peer_timeout, hosts=hosts)

    def covers(self, key: ShardKey, view: ClusterView | None = None) -> list[Holding]:
        """The parity covers of ``key`` its group lists (this store's own included)."""
        listings = self.group_listings(key.job_id, view)
        holdings = holdings_of(self.host_id, self.keeper.listing(key.job_id))
        for host, shards in listings.items():
            if not isinstance(shards, StoreError):
                holdings += holdings_of(host, shards)
        return [h for h in holdings if h.key == key and h.parity is not None]

    # ---- a lost shard

    def rebuild(self, key: ShardKey) -> str:
        """Rebuild ``key`` from its group and register it here (verified against its manifest); returns "rebuild".
        ShardNotFound when no parity covers it; ChecksumMismatch when what the survivors give does not verify."""
        view = self.membership.view
        listings = self.group_listings(key.job_id, view)
        infos = [(h, i) for h, r in listings.items() if not isinstance(r, StoreError) for i in r]
        infos += [(self.host_id, i) for i in self.keeper.listing(key.job_id)]
        covers = [(h, i) for h, i in infos if i.parity is not None and i.manifest.key == key]
        if not covers:
            raise ShardNotFound(f"no parity of {key} is reachable in its group: it cannot be rebuilt")
        started = time.monotonic()
        manifest = covers[0][1].manifest
        place = covers[0][1].parity.place  # type: ignore[union-attr]
        segment = self.room.acquire(key, max(1, manifest.nbytes))
        try:
            self._solve(view, manifest, place, segment.view())
        except BaseException:
            self.room.release(segment)
            raise
        entry = Entry(
            key, manifest.world_size, manifest.nbytes, segment, manifest.owner_host, ShardState.COMMITTED, manifest=manifest,
            metrics=dict(manifest.metrics), format_version=manifest.format_version, copies=1, source="rebuild",
            created_unix=manifest.created_unix or time.time(), stripe=manifest.stripe, erasure=place,
            arrived_verified=time.monotonic(), spill_codec=manifest.spill_codec,
        )  # fmt: skip
        if self.catalog.register_pulled(entry):
            self.rebuilt += 1
            self.retention_due.set()
            self.events.pulled("rebuild", manifest.nbytes)
        log.info("rebuilt %s from its group in %.2fs", key, time.monotonic() - started)
        return "rebuild"

    def _solve(self, view: ClusterView, manifest: Manifest, place: ErasurePlace, out: memoryview) -> None:
        """Write the shard's bytes into ``out``, run by run, and verify them against the manifest's checksums.

        Each row is solved first with its first agreeing parities. If chunks then fail, a parity that passed its
        block checksums is wrong anyway (say a contribution made from bytes that changed after they were checksummed):
        each row whose blocks fall in a failing chunk is solved again with its other combinations of parities (M >= 2
        has some while fewer than M columns are lost), one that leaves fewer chunks failing is kept. ChecksumMismatch
        when no choice verifies: the shard is never served wrong."""
        shard_runs = runs(place, manifest.nbytes)
        for run in shard_runs:
            self._solve_run(view, manifest, place, run, out, 0)
        bad = bad_chunks(out, manifest)
        for run in shard_runs:
            if not bad or not bad & chunks_of(run, manifest):
                continue
            for choice in itertools.count(1):
                before = [bytes(out[start:end]) for start, end in spans_of(run, manifest.nbytes)]
                if not self._solve_run(view, manifest, place, run, out, choice):
                    break  # no other combination of this row's parities
                now = bad_chunks(out, manifest)
                if len(now) < len(bad):
                    self.set_aside += 1
                    log.warning("rebuild of %s: row %d solved with its first parities failed verification; combination %d verifies "
                                "(a parity fragment is wrong under valid checksums)", manifest.key, run.row, choice)  # fmt: skip
                    bad = now
                    break
                for (start, end), saved in zip(spans_of(run, manifest.nbytes), before, strict=True):
                    out[start:end] = saved
        if bad:
            raise ChecksumMismatch(
                f"{manifest.key} rebuilt from its group's parity fails verification at chunk {min(bad)} with every choice of parity: "
                "a parity fragment or a survivor's block is corrupt; not served"
            )

    def _solve_run(self, view: ClusterView, manifest: Manifest, place: ErasurePlace, run: Run, out: memoryview, choice: int) -> bool:
        """Write the shard's blocks of ``run`` into ``out``, window by window (each window's reads in parallel), solved
        with combination ``choice`` of each window's agreeing parities; False (nothing written) when it has none."""
        for lo in range(run.first, run.end, WINDOW):
            hi = min(run.end, lo + WINDOW)
            lost = self._window(view, manifest, place, run, lo, hi, choice)
            if lost is None:
                return False
            window = run.clipped(lo, hi)
            assert window is not None
            for i, (start, end) in enumerate(spans_of(window, manifest.nbytes)):  # blocks past the shard's end only trail
                out[start:end] = lost[i * BLOCK : i * BLOCK + end - start]
        return True

    def _window(
        self, view: ClusterView, manifest: Manifest, place: ErasurePlace, run: Run, lo: int, hi: int, choice: int = 0
    ) -> memoryview | None:
        """The lost shard's blocks at positions ``lo .. hi-1`` of ``run``'s row, solved from the survivors with
        combination ``choice`` of the parities that agree (None: there are not that many)."""
        key = manifest.key
        version = ShardKey(key.job_id, key.step, 0, key.timeline)
        count = hi - lo
        parities: list[Future[Parity]] = []
        for j, column in enumerate(parity_columns(place, run.row)):
            host = holder_of(view, place.group, column)
            if host:
                parities.append(self._reads.submit(self._read_parity, host, j, version, run.row, lo, count))
        got = []
        errors = []
        for f in parities:
            try:
                got.append(f.result())
            except StoreError as exc:
                log.info("rebuild of %s: a parity of row %d is unavailable: %s", key, run.row, exc)
                errors.append(str(exc))
        if not got:
            raise PeerUnavailable(f"no parity of row {run.row} of {key} could be read" + "".join(f"; {e}" for e in errors))
        return self._decode(view, key, place, run, lo, hi, got, choice)

    def _read_parity(self, host: str, j: int, version: ShardKey, row: int, first: int, blocks: int) -> Parity:
        buf = np.empty(blocks * BLOCK, dtype=np.uint8)
        if host == self.host_id:
            infos, data = self.keeper.read((version.job_id, version.step, version.timeline), row, first, blocks)
            buf[:] = np.frombuffer(data, dtype=np.uint8)
            contributors = tuple(infos)
        else:
            timeout = self.config.peer_timeout + blocks * BLOCK / self.config.transfer_min_rate
            contributors = self.peers[host].read_parity(version, row, first, blocks, buf.data, timeout)
        return Parity(j, buf, tuple(contributors))

    def _decode(
        self, view: ClusterView, key: ShardKey, place: ErasurePlace, run: Run, lo: int, hi: int, got: list[Parity], choice: int
    ) -> memoryview | None:
        """Solve for ``key``'s column from the parities ``got`` (those holding the same contributions as the first:
        combination ``choice`` of them, None if there are fewer) and the other contributors' blocks, read in parallel."""
        count = hi - lo
        columns = row_data_columns(place, run.row)
        k = data_columns(place)
        mine = columns.index(place.column)
        same = [p for p in got if {i.manifest.key for i in p.contributors} == {i.manifest.key for i in got[0].contributors}]
        reads: dict[int, Future[np.ndarray]] = {}
        for info in got[0].contributors:
            other = info.erasure
            if info.manifest.key == key or other is None:
                continue
            theirs = next((r for r in runs(other, info.manifest.nbytes) if r.row == run.row), None)
            clipped = theirs.clipped(lo, hi) if theirs is not None else None
            if clipped is None:
                continue
            host = holder_of(view, other.group, other.column)
            reads[columns.index(other.column)] = self._reads.submit(self._read_blocks, host, info.manifest, clipped, lo, count)
        present: dict[int, np.ndarray] = {c: np.zeros(count * BLOCK, dtype=np.uint8) for c in range(k) if c != mine}
        for column, f in reads.items():
            try:
                present[column] = f.result()
            except StoreError as exc:
                log.info("rebuild of %s: column %d of row %d is unavailable: %s", key, column, run.row, exc)
                del present[column]
        missing = k - len(present)
        if len(same) < missing:
            raise PeerUnavailable(
                f"{key} cannot be rebuilt: row {run.row} misses {missing} data column(s) and has {len(same)} parity fragment(s) that agree"
            )
        combos = list(itertools.combinations(same, missing))
        if choice >= len(combos):
            return None
        codec = self._codec(place)
        for p in combos[choice]:
            present[k + p.index] = p.data
        solved = codec.decode(present, count * BLOCK)
        return np.ascontiguousarray(solved[mine], dtype=np.uint8).data

    def _read_blocks(self, host: str, manifest: Manifest, clipped: Run, lo: int, count: int) -> np.ndarray:
        """The blocks of ``manifest``'s shard in ``clipped`` (within a window from position ``lo`` of ``count``), read from
        ``host``, placed at their positions in a zeroed window."""
        out = np.zeros(count * BLOCK, dtype=np.uint8)
        at = (clipped.first - lo) * BLOCK
        into = out.data[at : at + clipped.count * BLOCK]
        if not host:
            raise PeerUnavailable(f"the slot of {manifest.key}'s owner is vacant")
        if host == self.host_id:
            entry = self.catalog.readable(manifest.key, wait=0.0)
            self._copy_blocks(entry, clipped, into)
        else:
            timeout = self.config.peer_timeout + clipped.count * BLOCK / self.config.transfer_min_rate
            self.peers[host].read_range(manifest.key, clipped.start, BLOCK, clipped.stride, clipped.count, into, timeout)
        return out

    def _copy_blocks(self, entry: Entry, run: Run, into: memoryview) -> None:
        if not self.catalog.pin(entry):
            raise ShardNotFound(f"{entry.key} was dropped while it was read")
        try:
            for i, piece in enumerate(read_pieces(entry.segment.view(entry.nbytes), run.start, BLOCK, run.stride, run.count)):
                into[i * BLOCK : (i + 1) * BLOCK] = piece
        finally:
            self.catalog.unpin(entry)

    # ---- lost parity

    def refill(self, info: ShardInfo, host: str, row: int, fragment: int) -> None:
        """Read ``info``'s blocks in ``row`` from ``host`` (its owner) and add them to this store's fragment ``fragment``."""
        place = info.erasure
        assert place is not None
        run = next(r for r in runs(place, info.manifest.nbytes) if r.row == row)
        buf = np.empty(run.count * BLOCK, dtype=np.uint8)
        timeout = self.config.peer_timeout + run.count * BLOCK / self.config.transfer_min_rate
        self.peers[host].read_range(info.manifest.key, run.start, BLOCK, run.stride, run.count, buf.data, timeout)
        if place.m > 1:
            codec = self._codec(place)
            column = row_data_columns(place, row).index(place.column)
            blocks = buf.reshape(run.count, BLOCK)
            buf = np.concatenate([codec.contribution(column, blocks[i])[fragment] for i in range(run.count)])
        data = buf.data
        if self.keeper.add(info.manifest, place, row, run.first, run.count, data, checksum(data)):
            self.refilled += 1

    # ---- the repair pass

    def repair_once(self) -> bool:
        """Rebuild this store's own shards its group's parity covers and it lacks, then fill its fragments with what
        their data hosts hold and they lack; the ``--keep`` newest versions of every job, the newest first. True if every
        member answered and nothing failed."""
        view = self.membership.view
        group = erasure_group(view)
        mine = view.my_slot
        if group is None or mine is None:
            return True
        listings = self.group_listings("", view)
        infos = [(h, i) for h, r in listings.items() if not isinstance(r, StoreError) for i in r]
        recent = self._recent(infos)
        rebuilt = self._rebuild_own(infos, recent, mine.name)
        refilled = self._refill_parity(view, infos, recent, group, group.index(mine.name))
        return rebuilt and refilled and not any(isinstance(r, StoreError) for r in listings.values())

    def _rebuild_own(self, infos: list[tuple[str, ShardInfo]], recent: dict[str, set[tuple[int, str]]], slot: str) -> bool:
        """Rebuild the recent shards the parity covers name as this store's slot's that it lacks; False if one failed."""
        held = {i.manifest.key for _, i in infos if i.verified and i.parity is None}
        own: dict[ShardKey, list[Holding]] = {}
        for host, info in infos:
            cover, key = info.parity, info.manifest.key
            if cover is not None and cover.place.group[cover.place.column] == slot and key.version in recent.get(key.job_id, ()):
                own.setdefault(key, []).extend(holdings_of(host, [info]))
        ok = True
        for key in sorted(own, key=lambda k: (-k.step, k.job_id, k.rank, k.timeline)):
            if self._stop.is_set():
                return False
            if self.catalog.get(key) is not None or not can_rebuild_from(own[key], held):
                continue
            try:
                self.rebuild(key)
            except StoreError as exc:
                ok = False
                log.warning("repair: rebuilding %s failed: %s", key, exc)
        return ok

    def _refill_parity(
        self, view: ClusterView, infos: list[tuple[str, ShardInfo]], recent: dict[str, set[tuple[int, str]]], group: tuple[str, ...],
        me: int,
    ) -> bool:  # fmt: skip
        """Add to this store's fragments the recent data shards of their rows that they lack, read from their owners."""
        ok = True
        for host, info in sorted(infos, key=lambda hi: (-hi[1].manifest.key.step, hi[1].manifest.key)):
            place, key = info.erasure, info.manifest.key
            if place is None or (place.group, place.m) != (group, self.config.redundancy.m) or not _settled_copy(info):
                continue
            if host != holder_of(view, place.group, place.column) or key.version not in recent.get(key.job_id, ()):
                continue
            for run in runs(place, info.manifest.nbytes):
                columns = parity_columns(place, run.row)
                if me not in columns or self.keeper.holds((key.job_id, key.step, key.timeline), run.row, key):
                    continue
                if self._stop.is_set():
                    return False
                try:
                    self.refill(info, host, run.row, columns.index(me))
                except StoreError as exc:
                    ok = False
                    log.warning("repair: refilling the parity of row %d with %s failed: %s", run.row, key, exc)
        return ok

    def _recent(self, infos: list[tuple[str, ShardInfo]]) -> dict[str, set[tuple[int, str]]]:
        """Per job, the ``--keep`` newest versions among what the group lists and this store holds."""
        copies: dict[str, list[tuple[ShardKey, float]]] = {}
        for _, info in infos:
            copies.setdefault(info.manifest.key.job_id, []).append((info.manifest.key, info.manifest.created_unix))
        for info in self.catalog.list_shards(""):
            copies.setdefault(info.manifest.key.job_id, []).append((info.manifest.key, info.manifest.created_unix))
        return {job: set(ranked_versions(pairs, self.config.keep)) for job, pairs in copies.items()}


def spans_of(run: Run, nbytes: int) -> list[tuple[int, int]]:
    """The byte ranges ``[start, end)`` of a shard of ``nbytes`` that ``run``'s blocks hold, block by block (a block
    wholly past the end holds none)."""
    out = []
    for i in range(run.count):
        start = run.start + i * run.stride
        end = min(nbytes, start + BLOCK)
        if end > start:
            out.append((start, end))
    return out


def chunks_of(run: Run, manifest: Manifest) -> set[int]:
    """The manifest's chunks that ``run``'s blocks fall in."""
    size = manifest.chunk_size
    return {c for start, end in spans_of(run, manifest.nbytes) for c in range(start // size, (end - 1) // size + 1)}


def bad_chunks(buf: memoryview, manifest: Manifest) -> set[int]:
    """The chunks of the shard in ``buf`` whose checksum differs from the manifest's."""
    view = memoryview(buf)
    spans = chunk_spans(manifest.nbytes, manifest.chunk_size)
    return {i for i, (off, n) in enumerate(spans) if checksum(view[off : off + n]) != manifest.checksums[i]}


def _settled_copy(info: ShardInfo) -> bool:
    return info.verified and info.parity is None and info.state is not None and info.state.settled


def read_pieces(view: memoryview, offset: int, length: int, stride: int, count: int) -> list[bytes | memoryview]:
    """``count`` pieces of ``length`` bytes of ``view``, piece i at ``offset + i * stride``, zero-padded past its end
    (``ReadRange``)."""
    out: list[bytes | memoryview] = []
    for i in range(count):
        start = offset + i * stride
        end = min(len(view), start + length)
        if end - start == length:
            out.append(view[start:end])
        else:
            out.append(bytes(view[start:end]) + bytes(length - max(0, end - start)) if end > start else bytes(length))
    return out
