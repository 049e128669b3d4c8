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
from memstore.v1.integrity import CHECKSUM_ALGO, DEFAULT_CHUNK_BYTES, compute_checksums
from trainer_client import serialization
from trainer_client.capture.device_save import Capture, Captures, DevicePart, HostPart
from trainer_client.serialization import ChunkSums
from trainer_client.transport.link import StoreLink
from trainer_client.transport.remote import VERIFY_THREADS, byte_view, empty_buffer
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
        self._free: list[torch.Tensor] = []  # staging buffers no save uses
        self._sends: collections.deque[Future[None]] = collections.deque()
        self._sender: ThreadPoolExecutor | None = None
        self.last_route = ""  # how the last save travelled: "data channel" or "grpc"

    def prepare(self, key: pb.ShardKey, nbytes: int, pin: bool) -> None:
        """Make the staging buffer now (registered with ``pin``)."""
        buf, _ = self._staging_buffer(nbytes)
        if pin:
            self._captures.copier.pin_buffer(buf)
        self._free.append(buf)

    def capture(self, shard: PlannedShard) -> Capture:
        """Stage the shard (device copies and host part into a staging buffer), then send it: inline, or on the sending
        thread (``background``). A send that follows the copy on the same thread has the copy hash each chunk from cache
        instead of reading the shard back first; a background send keeps the stall a copy and hashes on its thread."""
        destination = functools.partial(self._staged, shard)
        return self._captures.capture(shard.layout, destination, shard.enqueued, shard.on_success, shard.skip_capacity)

    def _staged(self, shard: PlannedShard, device: DevicePart) -> _StagedSave:
        """The save's staging buffer (registered for CUDA copies when ``device.pin``)."""
        buf, fresh = self._staging_buffer(shard.layout.nbytes)
        try:
            if device.pin:
                self._captures.copier.pin_buffer(buf)
            return _StagedSave(self, shard, buf, fresh)
        except BaseException:
            self._free.append(buf)
            raise

    def _staging_buffer(self, nbytes: int) -> tuple[torch.Tensor, bool]:
        """A free staging buffer of at least ``nbytes`` (kept between saves: its pages are faulted in once), and
        whether it is new. With background sends, at most two are in flight; a third save waits for the oldest."""
        while self._sends and (self._sends[0].done() or len(self._sends) >= MAX_BACKGROUND_SENDS):
            self._sends.popleft().exception()  # waits; its handle reports the outcome
        for i, buf in enumerate(self._free):
            if buf.numel() >= nbytes:
                return self._free.pop(i), False
        self._captures.unpin(*self._free)
        self._free.clear()  # too small for this state: let them go
        return empty_buffer(nbytes), True

    def _send_later(self, send: _StagedSave) -> Future[None]:
        if self._sender is None:
            self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memstore-send")
        future = self._sender.submit(send.send)
        self._sends.append(future)
        return future

    def close(self) -> None:
        if self._sender is not None:
            self._sender.shutdown(wait=True)  # a background save in flight is finished, not dropped
            self._sender = None


class _StagedSave:
    """One staged save (a :class:`~trainer_client.capture.device_save.Destination`): its buffer, its checksums, its send."""

    def __init__(self, path: RemotePath, shard: PlannedShard, buf: torch.Tensor, fresh: bool) -> None:
        self._path = path
        self._shard = shard
        self._inline = not path._background or shard.enqueued  # the send follows the copy on the same thread
        self.target = buf
        self.memory = byte_view(buf, shard.layout.nbytes)
        self.sums = ChunkSums(path._chunk) if self._inline else None  # an inline send waits for the checksums anyway
        self.host = HostPart(sums=self.sums, fault_ahead=fresh)  # a new buffer: its pages are faulted in beside the copy
        self._created = time.time()

    def send(self) -> None:
        """Hash (unless the copy did), send, and give the buffer back for the next save."""
        path, shard = self._path, self._shard
        nbytes, chunk = shard.layout.nbytes, path._chunk
        done = self.sums.values if self.sums is not None else None
        checksums = done if done is not None else compute_checksums(self.memory, nbytes, chunk, workers=VERIFY_THREADS)
        header = _put_header(shard, path._world_size, chunk, checksums, self._created, path._spill_codec)
        try:
            path.last_route = path._transfer.put(header, self.memory, f"put step {shard.key.step}")
        finally:
            self.abort()  # the buffer is free again, sent or not

    def finish(self) -> Future[None] | None:
        """Send now (inline) or on the sending thread: its future, which the save's handle waits for."""
        if self._inline:
            self.send()
            return None
        return self._path._send_later(self)

    def abort(self) -> None:
        """Give the staging buffer back for the next save."""
        self._path._free.append(self.target)


def _put_header(
    shard: PlannedShard, world_size: int, chunk_size: int, checksums: list[int], created: float, spill_codec: str
) -> pb.PutHeader:
    """What precedes ``shard``'s bytes sent to the store: its manifest (``chunk_size``-byte chunks with ``checksums``,
    made at ``created``) and who sends it."""
    key = shard.key
    manifest = pb.Manifest(
        key=key, world_size=world_size, nbytes=shard.layout.nbytes, chunk_size=chunk_size, chunk_checksums=checksums,
        checksum_algo=CHECKSUM_ALGO, format_version=serialization.FORMAT_VERSION, metrics=shard.metrics, created_unix=created,
        spill_codec=spill_codec, stripe=shard.stripe,
    )  # fmt: skip
    return pb.PutHeader(
        manifest=manifest,
        origin=pb.PUT_ORIGIN_CLIENT,
        sender_host=f"client-rank-{key.rank}",
        restorable_floor=shard.restorable_floor(),
    )
