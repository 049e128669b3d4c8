"""``SharedMemoryPath``: saves straight into the store's shared memory (the store on this machine).

Each save takes a segment of the rank's capture ring (``trainer_client.capture.ring``): the one reserved ahead after
the previous commit (no call), else one allocated now. The save holds the segment's mapping while the device copies are
queued into it and the host part is written (``trainer_client.capture.device_save``), then commits the lease over the
store's Unix socket: the store owns the bytes from then on, and ``save()`` returns. Checksums and replication happen in
the store, in the background. After the commit the ring reserves the next save's segment ahead, on its own thread.

Two variants of the copy, each chosen per save:

- **marks**: a large CPU state (``MARKED_FROM`` bytes or more) on a store that replicates, with
  ``MEMSTORE_MARKED_CAPTURES`` on: the copy tells the store how many bytes are final as it goes (a ``Commit`` with
  ``captured_bytes``), and the store pushes them to the replicas meanwhile. The store holds the shard from the first
  mark on, so an abort after it leaves the lease to the store (it drops the shard once no more marks come).
- **trainer hashing**: with ``MEMSTORE_TRAINER_HASHING=on``, a state this process copies alone is hashed chunk by chunk
  as it is copied, with the store's chunk size; the commit carries the checksums and the store never reads it back.

A failure before the commit gives the lease back (the segment stays in the ring); a commit the store refuses lets the
lease expire there. Nothing is committed in either case.
"""

from __future__ import annotations

import functools
import time

import torch

from memstore.v1 import store_pb2 as pb
from memstore.v1.integrity import CHECKSUM_ALGO
from trainer_client import serialization
from trainer_client.capture.device_save import Capture, Captures, DevicePart, HostPart
from trainer_client.capture.ring import CaptureRing, Slot
from trainer_client.serialization import ChunkSums
from trainer_client.transport.link import StoreLink
from trainer_client.transport.save_path import PlannedShard

MARKED_FROM = 64 << 20  # a CPU state this large is pushed by the store while it is copied (CommitRequest.captured_bytes)


class SharedMemoryPath:
    """The :class:`~trainer_client.transport.save_path.SavePath` into the store's memory, through the rank's capture ring.

    Args:
        link: the client's connection (``shared_memory`` True).
        captures: the client's capture machinery (device copier, capture thread).
        rank, world_size: the client's.
        spill_codec: the job's codec on the durable tier ("" = the store's).
        marking: ``MEMSTORE_MARKED_CAPTURES`` allows marks (``trainer_client.knobs.marked_captures``).
        hashing: ``MEMSTORE_TRAINER_HASHING`` is on (``trainer_client.knobs.trainer_hashing``).
    """

    last_route = "shared memory"

    def __init__(
        self, link: StoreLink, captures: Captures, rank: int, world_size: int, spill_codec: str, marking: bool, hashing: bool
    ) -> None:
        hello = link.hello
        self._link = link
        self._captures = captures
        self._world_size = world_size
        self._spill_codec = spill_codec
        self._marking = marking and hello.marked_captures and hello.replicas > 1
        self._chunk = hello.max_chunk_bytes if hashing else 0  # 0: the trainer does not hash
        # The segments this rank's saves land in, mapped (and registered for DMA) once; the next save's reserved ahead.
        # The reservation ahead goes over gRPC from the ring's thread: it never queues behind a save's call, nor it behind it.
        self.ring = CaptureRing(
            functools.partial(link.control, "Allocate", what=f"allocate memory for rank {rank}'s save"),
            lambda lease_id: link.control("Release", pb.ReleaseRequest(lease_id=lease_id), "release an unused capture lease"),
            functools.partial(link.unary, "Allocate", what=f"reserve memory for rank {rank}'s next save"),
        )

    def prepare(self, key: pb.ShardKey, nbytes: int, pin: bool) -> None:
        """Fill the ring now (``CaptureRing.prepare``), every segment registered with ``pin``."""
        if pin:
            self.ring.pinning = True
            self.ring.pin_all()
        self.ring.prepare(key, self._world_size, nbytes)

    def capture(self, shard: PlannedShard) -> Capture:
        """Into a segment of the ring: the one reserved ahead (no call) or one allocated now. With ``shard.enqueued`` the
        device copies are enqueued on the capture thread, after events recorded now on the trainer's streams."""
        destination = functools.partial(self._segment, shard)
        return self._captures.capture(shard.layout, destination, shard.enqueued, shard.on_success, shard.skip_capacity)

    def _segment(self, shard: PlannedShard, device: DevicePart) -> _SegmentSave:
        """The save's segment, taken and held (registered for DMA when ``device.pin``)."""
        ring = self.ring
        if device.pin and not ring.pinning:
            ring.pinning = True  # from now on every ring segment is registered once (this slot below, the rest as used)
        slot = ring.take(shard.key, self._world_size, shard.layout.nbytes)
        try:
            return _SegmentSave(self, shard, slot, bool(device.blobs))
        except BaseException:
            ring.give_back(slot)
            raise

    def close(self) -> None:
        self.ring.close()  # the lease reserved ahead is given back; ring segments unregistered and unmapped


class _SegmentSave:
    """One save into a ring segment (a :class:`~trainer_client.capture.device_save.Destination`): the slot it holds, its
    marks, its commit or abort."""

    def __init__(self, path: SharedMemoryPath, shard: PlannedShard, slot: Slot, device_blobs: bool) -> None:
        assert slot.hold is not None  # CaptureRing.take: held until committed or given back
        self._path = path
        self._shard = shard
        self._slot = slot
        self.target = torch.frombuffer(slot.hold.view, dtype=torch.uint8, count=shard.layout.nbytes)  # the device copies land here
        self.memory = slot.mm
        # Marks for a large CPU state on a store that replicates; else, with trainer hashing, checksums as it copies (CUDA
        # bytes land after the host's copy: then the store hashes).
        marking = path._marking and not device_blobs and not shard.enqueued and shard.layout.nbytes >= MARKED_FROM
        self.sums = ChunkSums(path._chunk) if path._chunk > 0 and not device_blobs and not marking else None
        self.host = HostPart(mark=self.mark if marking else None, sums=self.sums)
        self._marked = False  # the store took the shard in at the first mark

    def _request(self, captured: int | None = None) -> pb.CommitRequest:
        path, shard = self._path, self._shard
        return _commit_request(
            shard, self._slot.lease_id, path._spill_codec, name_key=self._slot.ahead, captured=captured,
            capture=None if captured is not None else path.ring.report(), capture_seconds=time.perf_counter() - shard.started,
            sums=self.sums,
        )  # fmt: skip

    def mark(self, captured: int) -> None:
        """The first ``captured`` bytes are final: the store starts pushing them."""
        self._path._link.control("Commit", self._request(captured), f"commit step {self._shard.key.step} (its first {captured} bytes)")
        self._marked = True  # the store holds the lease's shard from the first mark on

    def finish(self) -> None:
        """Commit: hand the segment to the store; then reserve the next save's segment ahead."""
        ring, key, nbytes = self._path.ring, self._shard.key, self._shard.layout.nbytes
        try:
            self._path._link.control("Commit", self._request(), f"commit step {key.step}")
        finally:
            ring.committed(self._slot)  # taken in, or refused (the lease then expires in the store)
        ring.reserve_ahead(key, self._path._world_size, nbytes)

    def abort(self) -> None:
        """A step before the commit failed: give the lease back (after a mark the store drops the shard by itself)."""
        if self._marked:
            self._path.ring.committed(self._slot)
        else:
            self._path.ring.give_back(self._slot)


def _commit_request(
    shard: PlannedShard, lease_id: str, spill_codec: str, *, name_key: bool, captured: int | None = None,
    capture: pb.CaptureStats | None = None, capture_seconds: float = 0.0, sums: ChunkSums | None = None,
) -> pb.CommitRequest:  # fmt: skip
    """The ``Commit`` of ``shard`` written into the segment of ``lease_id``.

    ``name_key``: the lease was reserved ahead, before its step was known: the commit names the shard. ``captured``: a
    mark (the first ``captured`` bytes are final; the store starts pushing them) instead of the final commit, which
    carries the ring's ``capture`` report, the capture's seconds and, when the trainer hashed the copy, its ``sums``.
    """
    request = pb.CommitRequest(
        lease_id=lease_id, metrics=shard.metrics, format_version=serialization.FORMAT_VERSION, spill_codec=spill_codec,
        stripe=shard.stripe, restorable_floor=shard.restorable_floor(), captured_bytes=captured,
    )  # fmt: skip
    if captured is None:
        if capture is not None:
            request.capture.CopyFrom(capture)
        request.capture_seconds = capture_seconds
        if sums is not None and sums.values is not None:
            request.chunk_size, request.checksum_algo = sums.chunk_size, CHECKSUM_ALGO
            request.chunk_checksums.extend(sums.values)
    if name_key:
        request.key.CopyFrom(shard.key)
        request.nbytes = shard.layout.nbytes
    return request
