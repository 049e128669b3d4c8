"""``SavePath``: how one planned shard gets into the store; two implementations, chosen once per client.

``CheckpointClient.save`` validates, plans (the shard's layout: what goes where in its bytes; its device part: which
blobs the device copies fill, whether its memory must be registered for DMA), then hands the :class:`PlannedShard` to
its path's :meth:`SavePath.capture` and wraps what comes back in a ``SaveHandle``:

- :class:`~trainer_client.transport.shared_memory_path.SharedMemoryPath` (the store shares this machine's memory): the
  shard is written into a segment of the rank's capture ring, then committed over the store's Unix socket;
- :class:`~trainer_client.transport.remote_path.RemotePath` (another machine, or ``--shm-dir ''``): the shard is staged
  in this process, hashed, and sent over the store's data channel.

The client's connect step (``trainer_client.transport.link.connect``) picks the path from the store's ``Hello``.

Call order (on the rank's own thread; one save at a time per client):

1. ``prepare(key, nbytes, pin)``, optional, any number of times before a save: make the memory of a save of ``nbytes``
   ready (reserved, mapped, faulted in; registered for DMA with ``pin``), so the next save makes no call.
2. ``capture(shard)`` for every save: take the save's memory, enqueue the device copies, write the host part, wait for
   the copies, hand the bytes to the store (commit, or send) and return the save's
   :class:`~trainer_client.capture.device_save.Capture`. Both paths take the memory first, then make one call,
   :meth:`~trainer_client.capture.device_save.Captures.capture`, with the save's
   :class:`~trainer_client.capture.device_save.Destination`: the memory, and as plain callables what hands it over
   (the ring's commit, the transfer's send; what they tell the store written down before the copy) or gives it back.
   The capture never calls back into the path. With ``shard.enqueued`` everything after taking the memory runs on the
   client's capture thread and ``capture`` returns at once; the ``Capture`` reports how it went. A failure before the
   hand-over gives the memory back (nothing is committed); ``CapacityExceededError`` is raised when the store has no
   room (or, enqueued with ``skip_capacity``, recorded in ``Capture.skipped_reason``).
3. ``close()`` once, after the last save's capture finished: what the path holds goes back (the lease reserved ahead,
   the mappings; a background send in flight is finished first).

``last_route`` says how the last save's bytes travelled (``"shared memory"``, ``"data channel"`` or ``"grpc"``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from memstore.v1 import store_pb2 as pb
from trainer_client.capture.cuda import DevicePart
from trainer_client.serialization import ShardLayout

if TYPE_CHECKING:
    from trainer_client.capture.device_save import Capture


@dataclass(frozen=True)
class PlannedShard:
    """One rank's save, planned: everything a :class:`SavePath` needs to capture it.

    Attributes:
        key: the shard's key (job, step, rank, timeline).
        layout: where every tensor and the header go in the shard's bytes (``serialization.plan``).
        device: its device tensors and whether its memory must be registered for DMA (``capture.cuda.device_part``).
        metrics: the save's metrics, as the store records them.
        stripe: with a replica group, this member's stripe (None: a whole shard).
        enqueued: ``capture="enqueued"``: the copies and the hand-over run on the client's capture thread.
        started: ``time.perf_counter()`` when ``save()`` was called (the capture's seconds, reported with the commit).
        floor: reads the job's restorable floor when the shard is handed over: (step, its timeline; "" = the shard's);
            None when there is no agreement.
        allocate_floor: the same, read for the save's ``Allocate`` when the store takes its segment as it comes
            (``AllocateResponse.reserve_at_save``): it first waits (bounded) for this save's agreement.
        on_success: called once the store took the shard (the client's timeline moves on).
        skip_capacity: enqueued, a full store skips the save (``on_capacity="skip"``) instead of failing it.
    """

    key: pb.ShardKey
    layout: ShardLayout
    device: DevicePart
    metrics: dict[str, float]
    stripe: pb.Stripe | None
    enqueued: bool
    started: float
    floor: Callable[[], tuple[int, str] | None] | None = None
    allocate_floor: Callable[[], tuple[int, str] | None] | None = None
    on_success: Callable[[], None] | None = None
    skip_capacity: bool = False


class SavePath(Protocol):
    """How a client's saves reach its store (the call order is in the module doc)."""

    @property
    def last_route(self) -> str:
        """How the last save's bytes travelled (the module doc)."""
        ...

    def prepare(self, key: pb.ShardKey, nbytes: int, pin: bool) -> None:
        """Make a save of ``nbytes`` fast from the first one (``key``: the rank's, any step); ``pin``: register for DMA."""
        ...

    def capture(self, shard: PlannedShard) -> Capture:
        """Capture ``shard`` into the store; its ``Capture`` (done unless ``shard.enqueued``)."""
        ...

    def close(self) -> None:
        """Give back what the path holds (after the last capture finished)."""
        ...
