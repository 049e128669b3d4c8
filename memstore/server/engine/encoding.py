"""Erasure coding of owned shards (``--redundancy ec:K+M``): where replication would push copies, contributions go.

Life of a shard owned by this host under ec:K+M::

    commit -> checksums (CAPTURED -> REPLICATING) -> placed in this host's part of its version (an offset)
      -> per row its blocks fall in, its contribution sent to each of the row's M parity hosts (``Contribute``)
      -> COMMITTED when every one acknowledged, else UNDER_REPLICATED (their repair passes fill in what is missing)

The shard itself stays whole on this host only: a local restore is what it is under replicas. A contribution is the
shard's blocks in one row (``memstore.core.parts.Run``): for M=1 the blocks themselves (XOR parity), for M >= 2 the
codec's coefficient times each block, one per parity fragment. The layout record travels with it (the manifest with its
checksums, the place): what a replacement learns its lost predecessor's shards from (``memstore.server.engine.rebuild``).

Network per save: about one shard out (M=1), M shards for M >= 2; nobody receives a whole shard of another host.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from memstore.config import StoreConfig
from memstore.core.erasure_layout import BLOCK
from memstore.core.model import ErasurePlace, Manifest, ShardState
from memstore.core.parts import Run, next_offset, parity_columns, row_data_columns, runs
from memstore.erasure.codec import Codec
from memstore.errors import CaptureAbandoned, PlacementError, StoreError
from memstore.faults import fault
from memstore.server.convert import manifest_to_pb, place_to_pb
from memstore.server.engine.catalog import Catalog
from memstore.server.engine.entries import Entry
from memstore.server.events import StoreEvents
from memstore.server.membership import ClusterView, Membership
from memstore.server.peers import PeerDirectory
from memstore.v1 import store_pb2 as pb
from memstore.v1.integrity import compute_checksums, running_checksum

log = logging.getLogger(__name__)

ENCODE_WORKERS = 4  # shards checksummed and encoded at once
CHECKSUM_WORKERS = 4


def erasure_group(view: ClusterView) -> tuple[str, ...] | None:
    """The slot names of this host's erasure-coded group, in slot order (the codec's columns); None without one (no
    slot, or fewer slots than K+M: ``memstore.core.placement.erasure_placement``)."""
    mine = view.my_slot
    if mine is None or view.placement is None or not view.placement.erasure_groups:
        return None
    try:
        return view.placement.group_of(mine.name)
    except PlacementError:
        return None


def holder_of(view: ClusterView, group: tuple[str, ...], column: int) -> str:
    """The host holding the slot of ``column`` in ``group`` now ("" if vacant)."""
    return view.table.holder(group[column]) or ""


class Contributions:
    """The bytes of one shard's contributions: for each of its runs and each parity fragment of the run's row."""

    def __init__(self, view: memoryview, nbytes: int, place: ErasurePlace, codec: Codec) -> None:
        self.view = view
        self.nbytes = nbytes
        self.place = place
        self.codec = codec

    def block(self, run: Run, i: int) -> np.ndarray:
        """The shard's block ``i`` of ``run`` (zeros past the shard's end)."""
        start = run.start + i * run.stride
        end = min(self.nbytes, start + BLOCK)
        if end - start == BLOCK:
            return np.frombuffer(self.view[start:end], dtype=np.uint8)
        out = np.zeros(BLOCK, dtype=np.uint8)
        if end > start:
            out[: end - start] = np.frombuffer(self.view[start:end], dtype=np.uint8)
        return out

    def blocks(self, run: Run, fragment: int) -> Iterator[memoryview]:
        """What this shard adds to fragment ``fragment`` of ``run``'s row, block by block."""
        column = row_data_columns(self.place, run.row).index(self.place.column)
        for i in range(run.count):
            block = self.block(run, i)
            yield (block if self.place.m == 1 else self.codec.contribution(column, block)[fragment]).data

    def checksum(self, run: Run, fragment: int) -> int:
        h = running_checksum()
        for block in self.blocks(run, fragment):
            h.update(block)
        return h.intdigest()


@dataclass(frozen=True)
class Sending:
    """One contribution to send: fragment ``fragment`` of ``run``'s row, to ``host`` (holding ``slot``; "" vacant)."""

    contributions: Contributions
    manifest: Manifest
    run: Run
    fragment: int
    slot: str
    host: str


class Encoder:
    """Checksums a captured shard, places it in its part, sends its contributions to its rows' parity hosts and settles it.

    The erasure-coded counterpart of ``memstore.server.engine.replication.Replicator`` (``submit``, ``close``)."""

    def __init__(self, catalog: Catalog, config: StoreConfig, membership: Membership, peers: PeerDirectory, events: StoreEvents,
                 retention_due: threading.Event) -> None:  # fmt: skip
        self.catalog = catalog
        self.config = config
        self.host_id = config.host_id
        self.membership = membership
        self.peers = peers
        self.events = events
        self.retention_due = retention_due  # set when a shard settles: the janitor looks at retention again
        self.m = config.redundancy.m
        self._encode = ThreadPoolExecutor(max_workers=ENCODE_WORKERS, thread_name_prefix="encode")
        self._send = ThreadPoolExecutor(max_workers=max(2, 2 * self.m * config.redundancy.k), thread_name_prefix="contribute")
        self._codecs: dict[tuple[int, int], Codec] = {}
        self._lock = threading.Lock()

    def submit(self, entry: Entry) -> None:
        """Encode ``entry`` (just registered: a client's save taken in) in the background."""
        self.catalog.add_in_flight(1)
        self._encode.submit(self.capture_and_encode, entry)

    def announce(self, job_id: str, rank: int, nbytes: int) -> None:
        """Nothing to announce: no peer receives whole shards of this one (``Replicator.announce``'s counterpart)."""

    def close(self) -> None:
        self._encode.shutdown(wait=False, cancel_futures=True)
        self._send.shutdown(wait=False, cancel_futures=True)

    def codec(self, k: int, m: int) -> Codec:
        with self._lock:
            if (k, m) not in self._codecs:
                self._codecs[(k, m)] = Codec(k, m)
            return self._codecs[(k, m)]

    def capture_and_encode(self, entry: Entry) -> None:
        if not self.catalog.take_up(entry):  # a newer save of its rank came first (newest wins)
            self.catalog.add_in_flight(-1)
            self.retention_due.set()
            return
        try:
            if entry.progress is not None:
                entry.progress.wait_finished()
            if entry.manifest is None:
                sums = entry.client_checksums
                if sums is None:
                    sums = tuple(compute_checksums(entry.segment.view(), entry.nbytes, self.config.chunk_bytes, workers=CHECKSUM_WORKERS))
                self.catalog.checksummed(entry, self._manifest(entry, sums))
            self._encode_and_send(entry)
        except CaptureAbandoned as exc:
            log.warning("dropping %s: %s", entry.key, exc)
            self.catalog.drop(entry, reason=str(exc))
        except Exception as exc:  # never lose the local copy because encoding broke
            log.exception("erasure coding of %s failed", entry.key)
            self._settle(entry, [f"internal error: {exc}"])
        finally:
            self.catalog.add_in_flight(-1)

    def _manifest(self, entry: Entry, checksums: tuple[int, ...]) -> Manifest:
        return Manifest(
            key=entry.key, world_size=entry.world_size, nbytes=entry.nbytes, chunk_size=self.config.chunk_bytes, checksums=checksums,
            owner_host=self.host_id, format_version=entry.format_version, metrics=entry.metrics, created_unix=entry.created_unix,
            spill_codec=entry.spill_codec, stripe=entry.stripe,
        )  # fmt: skip

    def _encode_and_send(self, entry: Entry) -> None:
        view = self.membership.view
        group = erasure_group(view)
        mine = view.my_slot
        if group is None or mine is None or len(group) <= self.m:
            held = len(view.table.members())
            why = f"the slot table (v{view.table.version}) holds {held} store(s): no erasure-coded group to keep parity yet"
            self._settle(entry, [why])
            return
        column = group.index(mine.name)
        place = self.catalog.place_in_part(entry, lambda placed: ErasurePlace(group, column, self.m, next_offset(placed)))
        manifest = entry.manifest
        assert manifest is not None
        if not self.catalog.pin(entry):
            return
        try:
            work = self._contributions(view, entry, manifest, place)
            names = sorted({s.host or f"(vacant slot {s.slot})" for s in work})
            self.catalog.waiting_for(entry, f"waiting for the parity hosts {', '.join(names)} to acknowledge its contributions")
            futures = [self._send.submit(self._send_one, s) for s in work]
            errors = [e for e in (f.result() for f in futures) if e]
        finally:
            self.catalog.unpin(entry)
        self._settle(entry, errors)

    def _contributions(self, view: ClusterView, entry: Entry, manifest: Manifest, place: ErasurePlace) -> list[Sending]:
        """One ``Sending`` per contribution of ``entry``: per run, per parity fragment of the run's row."""
        codec = self.codec(len(place.group) - place.m, place.m)
        contributions = Contributions(entry.segment.view(entry.nbytes), entry.nbytes, place, codec)
        return [
            Sending(contributions, manifest, run, j, place.group[column], holder_of(view, place.group, column))
            for run in runs(place, entry.nbytes)
            for j, column in enumerate(parity_columns(place, run.row))
        ]

    def _send_one(self, s: Sending) -> str | None:
        """Send one contribution; its error (None: acknowledged)."""
        run = s.run
        if not s.host:
            return f"row {run.row}'s parity slot {s.slot} is vacant"
        try:
            fault("contribute.before_send")
            wire = pb.ContributeHeader(
                manifest=manifest_to_pb(s.manifest), place=place_to_pb(s.contributions.place), row=run.row, first_position=run.first,
                blocks=run.count, block_bytes=BLOCK, checksum=s.contributions.checksum(run, s.fragment), sender_host=self.host_id,
            )  # fmt: skip
            deadline = 10.0 + run.count * BLOCK / self.config.transfer_min_rate
            self.peers[s.host].contribute(wire, lambda: s.contributions.blocks(run, s.fragment), deadline)
            self.events.pushed(run.count * BLOCK)
            return None
        except StoreError as exc:
            return f"row {run.row} on {s.host}: {exc}"

    def _settle(self, entry: Entry, errors: list[str]) -> None:
        state: ShardState = self.catalog.settle_parity(entry, errors)
        self.events.settled(state.value)
        self.retention_due.set()
