"""The parity fragments a store keeps for its group (``--redundancy ec:K+M``), and the records of what they hold.

A store is a parity host of M rows of its group (``memstore.core.erasure_layout``). Per (job, step, timeline) and
row it keeps one ``Fragment``: the sum (GF(2^8) addition: XOR) of every contribution the row's data hosts sent, a
contribution being one shard's blocks in that row (a ``memstore.core.parts.Run``), multiplied by the codec's
coefficient for M >= 2 (the sender does that). With each contribution comes its layout record (the shard's manifest
with its checksums, and its place in its owner's part), kept as long as the fragment: the records are what tells a
replacement which shards its lost predecessor owned, and what a rebuild reads from whom.

The fragment's bytes live in the store's shared memory (segments of the pool, one per extent of positions: the first
contribution of a row allocates its run, a longer one adds what is past the end), so they count against the capacity,
the job's quota and its memory as replicas do. Every block carries an xxh3 checksum, updated as contributions land and
checked before a block leaves (``read``), before a contribution is added to it (so a bit that flipped meanwhile is not
folded into a fresh checksum) and by the background scrub (``check``, ``memstore.server.engine.scrub``): a fragment
that fails it is dropped (``ChecksumMismatch`` to a reader; counted in ``corrupt``) and the next repair pass fills it
again from its data hosts (``memstore.server.engine.rebuild``), never used. (A contribution added to a fresh fragment
after such a drop starts it again; the others come back with the refill.)

A contribution is added whole or not at all (its bytes arrive first, checked against the sender's checksum), and once
per shard: a second one of the same shard (a retry, a repair pass racing the owner's push) adds nothing.

Lock: one per keeper (the fragments held) and one per fragment (its bytes and records); a segment is asked of the
``Room`` under a fragment's lock only (the engine's order: this, then the catalog's, then the pool's), never under the
keeper's. ``Store`` builds the one ``ParityKeeper``; the servicer's ``Contribute`` and ``ReadParity`` land here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from memstore.core.erasure_layout import BLOCK
from memstore.core.model import ErasurePlace, Manifest, ParityCover, ShardInfo, ShardKey, ShardState
from memstore.core.parts import Run, parity_columns, runs
from memstore.core.retention import ranked_versions
from memstore.erasure.codec import Codec
from memstore.errors import ChecksumMismatch, InvalidArgument, ShardNotFound
from memstore.server.engine.room import Room
from memstore.server.memory.pool import Segment, SegmentPool
from memstore.v1.integrity import checksum
from memstore.v1.streams import shard_manifest_problem

log = logging.getLogger(__name__)

Version = tuple[str, int, str]  # (job, step, timeline)


@dataclass
class Extent:
    """Positions ``first .. first+count-1`` of a fragment, in one segment."""

    first: int
    count: int
    segment: Segment


@dataclass
class Contributed:
    """The layout record of one contribution: the shard, its place, its run in this row."""

    manifest: Manifest
    place: ErasurePlace
    run: Run


@dataclass
class Fragment:
    """One row's parity of one version on this store."""

    version: Version
    row: int
    group: tuple[str, ...]
    m: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    extents: list[Extent] = field(default_factory=list)
    sums: dict[int, int] = field(default_factory=dict)  # position -> xxh3 of its block
    contributed: dict[ShardKey, Contributed] = field(default_factory=dict)
    created_unix: float = field(default_factory=time.time)
    dropped: bool = False

    @property
    def nbytes(self) -> int:
        return sum(e.count for e in self.extents) * BLOCK

    def block(self, position: int) -> memoryview | None:
        """The bytes of the block at ``position`` (None: no extent holds it: zeros)."""
        for e in self.extents:
            if e.first <= position < e.first + e.count:
                start = (position - e.first) * BLOCK
                return e.segment.view()[start : start + BLOCK]
        return None

    def gaps(self, first: int, end: int) -> list[tuple[int, int]]:
        """The runs of positions in ``first .. end-1`` that no extent holds yet."""
        out = []
        at = first
        for e in sorted(self.extents, key=lambda e: e.first):
            if e.first + e.count <= at:
                continue
            if e.first >= end:
                break
            if e.first > at:
                out.append((at, e.first))
            at = max(at, e.first + e.count)
        if at < end:
            out.append((at, end))
        return out

    def first_bad(self, first: int, end: int) -> int | None:
        """The first position in ``first .. end-1`` whose block fails its checksum (None: all verify or are zeros)."""
        for position in range(first, end):
            block = self.block(position)
            want = self.sums.get(position)
            if block is not None and want is not None and checksum(block) != want:
                return position
        return None

    def needs_of(self, key: ShardKey) -> tuple[ShardKey, ...]:
        """The other shards whose runs share positions with ``key``'s."""
        mine = self.contributed[key].run
        return tuple(sorted(k for k, c in self.contributed.items() if k != key and c.run.overlaps(mine.first, mine.end)))


class ParityKeeper:
    """This store's parity fragments, per (version, row): contributions added, blocks read, records listed, retired."""

    def __init__(self, host_id: str, room: Room, pool: SegmentPool, my_slot: Callable[[], str | None]) -> None:
        """``my_slot``: this store's slot name now (None: it holds none), which says of which rows it is a parity host."""
        self.host_id = host_id
        self.room = room
        self.pool = pool
        self.my_slot = my_slot
        self._lock = threading.Lock()
        self._fragments: dict[tuple[Version, int], Fragment] = {}
        self._codecs: dict[tuple[int, int], Codec] = {}
        self.corrupt = 0  # fragments dropped because a block failed its checksum

    # ---- contributions (Contribute; a repair's refill)

    def add(self, manifest: Manifest, place: ErasurePlace, row: int, first: int, blocks: int, data: memoryview, sent_sum: int) -> bool:
        """Add one shard's contribution to this store's fragment of ``row``: ``blocks`` blocks from position ``first``,
        ``data`` its bytes, ``sent_sum`` their xxh3. True if added, False if that shard's was in the fragment already."""
        run = self._check(manifest, place, row, first, blocks, data, sent_sum)
        key = manifest.key
        version = (key.job_id, key.step, key.timeline)
        incoming = np.frombuffer(data, dtype=np.uint8).reshape(blocks, BLOCK)
        for _ in range(2):  # a fragment found corrupt is dropped and the contribution goes into a fresh one
            fragment = self._fragment(version, row, place)
            with fragment.lock:
                if fragment.dropped:
                    raise ShardNotFound(f"the parity of row {row} of {key} was dropped meanwhile (retention, or it failed verification)")
                if key in fragment.contributed:
                    return False
                bad = fragment.first_bad(run.first, run.end)
                if bad is None:
                    self._accumulate(fragment, key, Contributed(manifest, place, run), incoming)
                    return True
            self._corrupt(fragment, bad)
        raise ChecksumMismatch(f"the parity of row {row} of {key} on store {self.host_id} failed verification twice in a row")

    def _accumulate(self, fragment: Fragment, key: ShardKey, contributed: Contributed, incoming: np.ndarray) -> None:
        """Add ``incoming`` (a run's blocks, verified ones' positions) into ``fragment`` (under its lock), each block's
        checksum updated with it."""
        run = contributed.run
        self._cover(fragment, key, run)
        codec = self._codec(contributed.place)
        for i in range(run.count):
            position = run.first + i
            block = fragment.block(position)
            assert block is not None
            codec.accumulate(np.frombuffer(block, dtype=np.uint8), incoming[i])
            fragment.sums[position] = checksum(block)
        fragment.contributed[key] = contributed

    def _check(self, m: Manifest, place: ErasurePlace, row: int, first: int, blocks: int, data: memoryview, sent_sum: int) -> Run:
        problem = shard_manifest_problem(m)
        if problem:
            raise InvalidArgument(f"contribution of an invalid shard: {problem}")
        slot = self.my_slot()
        if slot is None or slot not in place.group:
            raise InvalidArgument(f"store {self.host_id} (slot {slot}) is not in the group {place.group} of {m.key}'s parity")
        if place.group.index(slot) not in parity_columns(place, row):
            raise InvalidArgument(f"store {self.host_id} (slot {slot}) holds no parity of row {row} of group {place.group}")
        run = next((r for r in runs(place, m.nbytes) if r.row == row), None)
        if run is None or (run.first, run.count) != (first, blocks):
            want = "none" if run is None else f"{run.count} from position {run.first}"
            raise InvalidArgument(f"contribution of {m.key} to row {row}: {blocks} blocks from position {first}, expected {want}")
        if len(data) != blocks * BLOCK:
            raise InvalidArgument(f"contribution of {m.key} to row {row}: {len(data)} bytes, expected {blocks} x {BLOCK}")
        if checksum(data) != sent_sum:
            raise ChecksumMismatch(f"contribution of {m.key} to row {row} does not match its checksum; the sender should retry")
        return run

    def _fragment(self, version: Version, row: int, place: ErasurePlace) -> Fragment:
        with self._lock:
            fragment = self._fragments.get((version, row))
            if fragment is None or fragment.dropped:
                fragment = Fragment(version, row, place.group, place.m)
                self._fragments[(version, row)] = fragment
            elif (fragment.group, fragment.m) != (place.group, place.m):
                raise InvalidArgument(
                    f"row {row} of {version} has parity for group {fragment.group} (M={fragment.m}), not {place.group} (M={place.m})"
                )
            return fragment

    def _cover(self, fragment: Fragment, key: ShardKey, run: Run) -> None:
        """Extents for every position of ``run`` (zeroed), from the room for ``key`` (under ``fragment``'s lock)."""
        for lo, hi in fragment.gaps(run.first, run.end):
            segment = self.room.acquire(key, (hi - lo) * BLOCK)
            view = segment.view()[: (hi - lo) * BLOCK]
            if not segment.fresh:
                np.frombuffer(view, dtype=np.uint8)[:] = 0
            fragment.extents.append(Extent(lo, hi - lo, segment))

    def _codec(self, place: ErasurePlace) -> Codec:
        shape = (len(place.group) - place.m, place.m)
        with self._lock:
            if shape not in self._codecs:
                self._codecs[shape] = Codec(*shape)
            return self._codecs[shape]

    # ---- reads (ReadParity: a rebuild)

    def read(self, version: Version, row: int, first: int, blocks: int) -> tuple[list[ShardInfo], bytes]:
        """Blocks ``first .. first+blocks-1`` of this store's fragment of ``row``, each checked against its checksum, and
        whose contributions they hold. A block that fails drops the fragment (repair fills it again): ChecksumMismatch."""
        with self._lock:
            fragment = self._fragments.get((version, row))
        if fragment is None:
            raise ShardNotFound(f"store {self.host_id} holds no parity of row {row} of {version[0]} step {version[1]}")
        out = bytearray(blocks * BLOCK)
        with fragment.lock:
            if fragment.dropped:
                raise ShardNotFound(f"the parity of row {row} of {version[0]} step {version[1]} was dropped meanwhile")
            bad = fragment.first_bad(first, first + blocks)
            if bad is None:
                for i in range(blocks):
                    block = fragment.block(first + i)
                    if block is not None:
                        out[i * BLOCK : (i + 1) * BLOCK] = block
                contributors = [ShardInfo(c.manifest, ShardState.PARITY, False, erasure=c.place) for c in fragment.contributed.values()]
                return contributors, bytes(out)
        self._corrupt(fragment, bad)
        raise ChecksumMismatch(
            f"the parity of row {row} of {version[0]} step {version[1]} on store {self.host_id} failed verification at position {bad}: "
            "dropped, the data hosts' shards fill it again"
        )

    def check(self, version: Version, row: int, position: int) -> bool | None:
        """Re-verify one block of this store's fragment of ``row`` (the scrub); a corrupt one drops the fragment (repair
        fills it again). True: it verifies (or is zeros); False: it failed and the fragment went; None: no such fragment."""
        with self._lock:
            fragment = self._fragments.get((version, row))
        if fragment is None:
            return None
        with fragment.lock:
            if fragment.dropped:
                return None
            if fragment.first_bad(position, position + 1) is None:
                return True
        self._corrupt(fragment, position)
        return False

    def blocks_held(self, older_than: float) -> list[tuple[Version, int, int]]:
        """(version, row, position) of every block of the fragments created before ``older_than`` (wall clock), the
        oldest fragment first: what the scrub re-verifies."""
        out = []
        for fragment in sorted(self._held(""), key=lambda f: f.created_unix):
            if fragment.created_unix > older_than:
                continue
            with fragment.lock:
                positions = sorted(fragment.sums)
            out += [(fragment.version, fragment.row, p) for p in positions]
        return out

    def _corrupt(self, fragment: Fragment, position: int) -> None:
        if self._drop(fragment, f"block {position} failed its checksum"):
            self.corrupt += 1
            job, step, _ = fragment.version
            log.warning("the parity of row %d of %s step %d failed its checksum at position %d", fragment.row, job, step, position)

    def holds(self, version: Version, row: int, key: ShardKey) -> bool:
        with self._lock:
            fragment = self._fragments.get((version, row))
        return fragment is not None and not fragment.dropped and key in fragment.contributed

    # ---- what the store reports (List, census, status)

    def listing(self, job_id: str) -> list[ShardInfo]:
        """A ``PARITY`` info per shard each fragment covers (of ``job_id``, every job when ""): never a copy."""
        out = []
        for fragment in self._held(job_id):
            with fragment.lock:
                for key, c in sorted(fragment.contributed.items()):
                    spans = tuple(r.row for r in runs(c.place, c.manifest.nbytes))
                    cover = ParityCover(fragment.row, c.place, spans, fragment.needs_of(key))
                    out.append(ShardInfo(c.manifest, ShardState.PARITY, False, parity=cover))
        return out

    def bytes_by_job(self) -> dict[str, int]:
        """The bytes of the fragments held, per job."""
        out: dict[str, int] = {}
        for fragment in self._held(""):
            out[fragment.version[0]] = out.get(fragment.version[0], 0) + fragment.nbytes
        return out

    def versions(self, job_id: str) -> list[tuple[ShardKey, float]]:
        """(key, capture time) of every shard contributed to a fragment of ``job_id``."""
        out = []
        for fragment in self._held(job_id):
            with fragment.lock:
                out += [(k, c.manifest.created_unix or fragment.created_unix) for k, c in fragment.contributed.items()]
        return out

    def jobs(self) -> set[str]:
        return {f.version[0] for f in self._held("")}

    def _held(self, job_id: str) -> list[Fragment]:
        with self._lock:
            return [f for (v, _), f in sorted(self._fragments.items(), key=lambda kv: kv[0]) if not job_id or v[0] == job_id]

    # ---- retention and deletes

    def retire(self, job_id: str, keep: int, also: set[tuple[int, str]]) -> int:
        """Drop ``job_id``'s fragments but those of its ``keep`` newest versions among them and of the versions in
        ``also`` (those this store still holds copies of); returns how many went."""
        kept = set(ranked_versions(self.versions(job_id), keep)) | also
        gone = [f for f in self._held(job_id) if (f.version[1], f.version[2]) not in kept]
        for f in gone:
            self._drop(f, "retention")
        return len(gone)

    def delete(self, job_id: str, step: int) -> int:
        """Drop ``job_id``'s fragments of ``step`` (-1: every step); returns how many."""
        gone = [f for f in self._held(job_id) if step in (-1, f.version[1])]
        for f in gone:
            self._drop(f, "deleted")
        return len(gone)

    def _drop(self, fragment: Fragment, why: str) -> bool:
        """Forget ``fragment`` and give its memory back; False if it was dropped already."""
        with self._lock:
            if self._fragments.get((fragment.version, fragment.row)) is fragment:
                del self._fragments[(fragment.version, fragment.row)]
        with fragment.lock:
            if fragment.dropped:
                return False
            fragment.dropped = True
            extents, fragment.extents = fragment.extents, []
        log.info("dropping the parity of row %d of %s step %d (%s)", fragment.row, fragment.version[0], fragment.version[1], why)
        for e in extents:
            self.pool.release(e.segment)
        return True

    def close(self) -> None:
        for f in self._held(""):
            self._drop(f, "the store is closing")
