"""``SharedMemoryPath``: saves straight into the store's shared memory (the store on this machine).

Each save takes a segment of the rank's capture ring (``trainer_client.capture.ring``): the one reserved ahead after
the previous commit (no call), else one allocated now. The save holds the segment's mapping while the device copies are
queued into it and the host part is written (``trainer_client.capture.device_save``), then the ring commits the lease over
the store's Unix socket: the store owns the bytes from then on, and ``save()`` returns. Checksums and replication happen
in the store, in the background. After the commit the ring reserves the next save's segment ahead, on its own thread.

The path decides, per save, what the commit tells the store (a ``CommitRequest`` with the shard's metrics, codec and
stripe, in a :class:`~trainer_client.capture.ring.Handover`) and how the copy goes (marks, hashing, below); the
capture gets the ring's commit, mark and abort of the lease as plain callables.

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

import torch

from memstore.v1 import store_pb2 as pb
from trainer_client import serialization
from trainer_client.capture.device_save import Capture, Captures, Destination
from trainer_client.capture.ring import CaptureRing, Handover
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
            functools.partial(link.control, "Commit"),
        )

    def prepare(self, key: pb.ShardKey, nbytes: int, pin: bool) -> None:
        """Fill the ring now (``CaptureRing.prepare``), every segment registered with ``pin``."""
        if pin:
            self.ring.pinning = True
            self.ring.pin_all()
        self.ring.prepare(key, self._world_size, nbytes)

    def capture(self, shard: PlannedShard) -> Capture:
        """Into a segment of the ring: the one reserved ahead (no call) or one allocated now, registered for DMA when the
        save needs it. With ``shard.enqueued`` the device copies are enqueued on the capture thread, after events recorded
        now on the trainer's streams, and the commit follows them there.

        Marks for a large CPU state on a store that replicates; else, with trainer hashing, checksums as it copies (CUDA
        bytes land after the host's copy: then the store hashes)."""
        layout, device, ring = shard.layout, shard.device, self.ring
        slot = ring.take(shard.key, self._world_size, layout.nbytes, pin=device.pin, floor=shard.allocate_floor)
        assert slot.hold is not None  # CaptureRing.take: held until committed or given back
        try:
            marking = self._marking and not device.blobs and not shard.enqueued and layout.nbytes >= MARKED_FROM
            sums = ChunkSums(self._chunk) if self._chunk > 0 and not device.blobs and not marking else None
            request = pb.CommitRequest(
                metrics=shard.metrics, format_version=serialization.FORMAT_VERSION, spill_codec=self._spill_codec, stripe=shard.stripe
            )
            handover = Handover(shard.key, self._world_size, request, shard.started, shard.floor, sums)
            into = Destination(
                target=torch.frombuffer(slot.hold.view, dtype=torch.uint8, count=layout.nbytes),  # the device copies land here
                memory=slot.mm,
                finish=functools.partial(ring.commit, slot, handover),
                abort=functools.partial(ring.abort, slot),
                mark=functools.partial(ring.mark, slot, handover) if marking else None,
                sums=sums,
            )
        except BaseException:
            ring.give_back(slot)
            raise
        return self._captures.capture(layout, device, into, shard.enqueued, shard.on_success, shard.skip_capacity)

    def close(self) -> None:
        self.ring.close()  # the lease reserved ahead is given back; ring segments unregistered and unmapped
