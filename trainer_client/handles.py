"""What a client's calls hand back: :class:`SaveHandle` (one save in progress) and :class:`RestorePoint`."""

from __future__ import annotations

import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from typing import Protocol

from memstore.v1 import store_pb2 as pb
from trainer_client.capture.device_save import Capture
from trainer_client.errors import ReplicationError


class _Client(Protocol):
    """What a handle asks of the client that made it (``trainer_client.client.CheckpointClient``)."""

    rank: int

    def _wait_committed(self, step: int, timeout: float, timeline: str) -> tuple[pb.ShardInfo, bool]: ...


@dataclass(frozen=True)
class RestorePoint:
    """One restorable version of a step: every rank's shard of ``timeline`` at ``step``."""

    step: int
    world_size: int
    timeline: str


class SaveHandle:
    """Tracks one save. ``wait()`` returns once R verified copies exist, or raises why not."""

    def __init__(
        self, client: _Client, step: int, skipped_reason: str = "", timeline: str = "", sending: Future[None] | None = None,
        capture: Capture | None = None,
    ) -> None:  # fmt: skip
        self._client = client
        self._sending = sending  # a background send (remote_save="background") still to finish
        self._capture = capture  # capture="enqueued": the copies, then the commit or send, in the background
        self.step = step
        self.timeline = timeline
        self.skipped_reason = skipped_reason
        self._info: pb.ShardInfo | None = None
        self.stall_seconds = 0.0

    @property
    def superseded(self) -> bool:
        """True once ``wait()`` (or ``done()``) learned that the store dropped this save before replicating it because a
        newer save of this rank was captured first: saves came faster than replication could take them (newest wins)."""
        return self._info is not None and self._info.superseded

    @property
    def skipped(self) -> bool:
        """True when the store had no room and the client was told to skip rather than raise (with
        ``capture="enqueued"`` and no shared memory: known once the capture finished)."""
        if self._capture is not None and self._capture.skipped_reason:
            self.skipped_reason = self._capture.skipped_reason
        return bool(self.skipped_reason)

    def wait_captured(self, timeout: float | None = None, *, block: bool = False) -> None:
        """Return once the trainer may modify the saved state (at once unless the save used ``capture="enqueued"``).

        Waits for the copy of the CPU tensors; CUDA tensors' copies gate each device's current stream instead
        (later work on it, e.g. the optimizer step, runs after them; the host goes on). ``block=True`` waits
        on the host for the whole capture, commit or send included. Raises the capture's error, or TimeoutError.
        """
        if self._capture is not None:
            self._capture.wait_captured(timeout, block)

    def done(self) -> bool:
        if self._capture is not None and (not self._capture.done() or self._capture.failed()):
            return self._capture.done()
        if self.skipped:
            return True
        if self._sending is not None:
            if not self._sending.done():
                return False
            if self._sending.exception() is not None:
                return True
        info, done = self._client._wait_committed(self.step, 0.0, self.timeline)
        self._info = info
        return done

    def wait(self, timeout: float | None = None) -> pb.ShardInfo:
        """Block until the shard is committed (returns its info) or replication failed (raises ReplicationError);
        with ``capture="enqueued"``, until the capture is done first (raising its error, if any). A save superseded by
        a newer one of this rank before it was replicated returns (``superseded`` is then True): it holds no copy."""
        if self._capture is not None:
            self._capture.result(timeout)
        if self.skipped:
            raise ReplicationError(f"step {self.step} was skipped: {self.skipped_reason}")
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._sending is not None:
            try:
                self._sending.result(timeout=timeout)  # raises the send's own error (capacity, auth, ...)
            except FutureTimeoutError:
                raise TimeoutError(f"step {self.step} of rank {self._client.rank} still being sent after {timeout}s") from None
        while True:
            remaining = 10.0 if deadline is None else max(0.0, deadline - time.monotonic())
            info, done = self._client._wait_committed(self.step, min(10.0, remaining), self.timeline)
            self._info = info
            if done:
                if info.state == pb.SHARD_STATE_COMMITTED or info.superseded:
                    return info
                raise ReplicationError(
                    f"step {self.step} of rank {self._client.rank} did not reach R copies: {info.error or pb.ShardState.Name(info.state)}"
                )
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"step {self.step} of rank {self._client.rank} not committed after {timeout}s "
                    f"(state {pb.ShardState.Name(info.state)}, {info.copies} copies)"
                )
