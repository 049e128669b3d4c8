"""``RemotePath``: saves staged in this process, then sent over the store's data channel (no shared memory).

A trainer in another pod or on another machine (or a store run with ``--shm-dir ''``) cannot copy into the store's
memory. Each save is copied into a staging buffer of this process (kept between saves, so its pages are faulted in
once; registered for CUDA copies like a ring segment), its chunks are hashed, and the shard goes to the store with its
manifest (``PutHeader``) over the data channel (``trainer_client.transport.remote``), gRPC streams for a store without
one.

``remote_save="sync"`` (default): the send follows the copy on the same thread and ``save()`` returns once the store
holds verified bytes (crash-safe; the stall includes the transfer); the copy hashes each chunk while it is in cache.
``"background"``: ``save()`` returns after the staging copy, and a thread hashes and sends it (the stall is one copy;
a crash of this process before the send finished loses the save, and its handle reports it). At most
``MAX_BACKGROUND_SENDS`` sends are in flight: the next save waits for the oldest. With ``capture="enqueued"`` the
capture thread sends once the copies are done.

The path takes the staging buffer and writes down what the send tells the store (a
:class:`~trainer_client.transport.remote.StagedShard`: the manifest but for its checksums); the capture gets the
transfer's send (or its hand-off to the sending thread) and the buffer's return as plain callables.

A failure before the send gives the staging buffer back; a send that fails (or that the store refuses: a chunk whose
checksum does not match) commits nothing.
"""

from __future__ import annotations

import collections
import functools
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from memstore.v1 import store_pb2 as pb
from memstore.v1.integrity import CHECKSUM_ALGO, DEFAULT_CHUNK_BYTES
from trainer_client import serialization
from trainer_client.capture.device_save import Capture, Captures, Destination
from trainer_client.serialization import ChunkSums
from trainer_client.transport.link import StoreLink
from trainer_client.transport.remote import StagedShard, byte_view, empty_buffer
from trainer_client.transport.save_path import PlannedShard

MAX_BACKGROUND_SENDS = 2  # remote_save="background": staged saves in flight; the next waits for the oldest


class RemotePath:
    """The :class:`~trainer_client.transport.save_path.SavePath` over the store's data channel.

    Args:
        link: the client's connection (its ``data`` transfer sends the shards).
        captures: the client's capture machinery (device copier, capture thread).
        world_size: the client's.
        spill_codec: the job's codec on the durable tier ("" = the store's).
        background: ``remote_save="background"``: the send runs on a thread of its own.
    """

    def __init__(self, link: StoreLink, captures: Captures, world_size: int, spill_codec: str, background: bool) -> None:
        self._transfer = link.data
        self._captures = captures
        self._world_size = world_size
        self._spill_codec = spill_codec
        self._background = background
        self._chunk = min(DEFAULT_CHUNK_BYTES, link.hello.max_chunk_bytes or DEFAULT_CHUNK_BYTES)
        self._free: list[tuple[torch.Tensor, memoryview]] = []  # staging buffers no save uses, each with its bytes' view
        self._sends: collections.deque[Future[None]] = collections.deque()
        self._sender: ThreadPoolExecutor | None = None

    @property
    def last_route(self) -> str:
        """How the last save travelled: "data channel" or "grpc" ("" before the first)."""
        return self._transfer.last_route

    def prepare(self, key: pb.ShardKey, nbytes: int, pin: bool) -> None:
        """Make the staging buffer now (registered with ``pin``)."""
        staging, _ = self._staging_buffer(nbytes)
        if pin:
            self._captures.copier.pin_buffer(staging[0])
        self._free.append(staging)

    def capture(self, shard: PlannedShard) -> Capture:
        """Stage the shard (device copies and host part into a staging buffer, registered for CUDA copies when the save
        needs it), then send it: inline, or on the sending thread (``background``). A send that follows the copy on the
        same thread has the copy hash each chunk from cache instead of reading the shard back first; a background send
        keeps the stall a copy and hashes on its thread."""
        layout = shard.layout
        staging, fresh = self._staging_buffer(layout.nbytes)
        release = functools.partial(self._free.append, staging)  # the buffer is free again: sent, or the save failed
        try:
            inline = not self._background or shard.enqueued  # the send follows the copy on the same thread
            sums = ChunkSums(self._chunk) if inline else None  # an inline send waits for the checksums anyway
            manifest = pb.Manifest(
                key=shard.key, world_size=self._world_size, nbytes=layout.nbytes, chunk_size=self._chunk, checksum_algo=CHECKSUM_ALGO,
                format_version=serialization.FORMAT_VERSION, metrics=shard.metrics, created_unix=time.time(),
                spill_codec=self._spill_codec, stripe=shard.stripe,
            )  # fmt: skip
            buf, view = staging
            staged = StagedShard(manifest, view[: layout.nbytes], sums, shard.floor, release)
            send = functools.partial(self._transfer.send, staged)
            into = Destination(
                target=buf, memory=staged.memory, finish=send if inline else functools.partial(self._sending().submit, send),
                abort=release, sums=sums, fault_ahead=fresh, register=True,  # a new buffer: its pages are faulted in beside the copy
            )  # fmt: skip
        except BaseException:
            release()
            raise
        job = self._captures.capture(layout, shard.device, into, shard.enqueued, shard.on_success, shard.skip_capacity)
        if job.handed_off is not None:
            self._sends.append(job.handed_off)
        return job

    def _staging_buffer(self, nbytes: int) -> tuple[tuple[torch.Tensor, memoryview], bool]:
        """A free staging buffer of at least ``nbytes`` with its bytes' view (kept between saves: its pages are faulted in
        once), and whether it is new. With background sends, at most two are in flight; a third save waits for the oldest."""
        while self._sends and (self._sends[0].done() or len(self._sends) >= MAX_BACKGROUND_SENDS):
            self._sends.popleft().exception()  # waits; its handle reports the outcome
        for i, (buf, _) in enumerate(self._free):
            if buf.numel() >= nbytes:
                return self._free.pop(i), False
        self._captures.unpin(*(buf for buf, _ in self._free))
        self._free.clear()  # too small for this state: let them go
        buf = empty_buffer(nbytes)
        return (buf, byte_view(buf, buf.numel())), True

    def _sending(self) -> ThreadPoolExecutor:
        """The thread background sends run on (made at the first)."""
        if self._sender is None:
            self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memstore-send")
        return self._sender

    def close(self) -> None:
        if self._sender is not None:
            self._sender.shutdown(wait=True)  # a background save in flight is finished, not dropped
            self._sender = None
