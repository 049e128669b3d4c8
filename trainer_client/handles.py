"""What a client's calls hand back: :class:`SaveHandle` (one save in progress), the :class:`SaveResult` its ``wait()``
returns, :class:`RestorePoint`, and :class:`ClientStats` (``client.stats()``)."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field

from memstore.v1 import store_pb2 as pb
from trainer_client.agreement import AgreementStats
from trainer_client.capture.device_save import Capture
from trainer_client.capture.ring import CaptureStats
from trainer_client.errors import ReplicationError

#: What a handle asks of the client that made it: how the save stands in the store, waiting up to that many seconds
#: for it to settle; (its status, whether it settled). ``CheckpointClient.save_status`` bound to the save's step and timeline.
StatusQuery = Callable[[float], "tuple[SaveResult, bool]"]

_STATE_PREFIX = "SHARD_STATE_"


@dataclass(frozen=True, repr=False)
class SaveResult:
    """What ``handle.wait()`` returns: one rank's saved shard as its store sees it.

    Attributes:
        step: the step saved.
        rank: the rank that saved it.
        timeline: the save's timeline (``<run id>.<epoch>``, or the one passed to ``save``).
        state: ``"committed"`` (R verified copies; under ``--redundancy ec:K+M``, one verified copy whose contributions
            every parity host of its rows acknowledged, so a lost store rebuilds it) once ``wait()`` returns; on the way:
            ``"captured"``, ``"replicating"``; after a failed replication ``"under_replicated"``. Whether every rank's
            save of the step committed is what ``latest_step()`` answers.
        copies: verified copies acknowledged, the owner's own included.
        superseded: a newer save of this rank was captured before this one replicated (it holds no copy).
        host: the store that owns the shard (the trainer's local store).
        nbytes: the shard's size in bytes.
        logical_nbytes: with a replica group, the size of the group's whole replicated state, of which this shard holds a
            stripe of about ``1 / len(group)`` (0 for a shard that is not a stripe).
        error: why replication failed ("" unless it did).
    """

    step: int
    rank: int
    timeline: str
    state: str
    copies: int
    superseded: bool = False
    host: str = ""
    nbytes: int = 0
    error: str = ""
    logical_nbytes: int = 0
    _wire: pb.ShardInfo | None = field(default=None, compare=False)  # for the deprecated protobuf attributes, one release

    @classmethod
    def from_wire(cls, info: pb.ShardInfo, step: int, rank: int, timeline: str) -> SaveResult:
        name = pb.ShardState.Name(info.state) if info.state in pb.ShardState.values() else str(info.state)
        return cls(
            step=step, rank=rank, timeline=timeline, state=name.removeprefix(_STATE_PREFIX).lower(), copies=int(info.copies),
            superseded=bool(info.superseded), host=info.manifest.owner_host, nbytes=int(info.manifest.nbytes), error=info.error,
            logical_nbytes=int(info.manifest.stripe.logical_nbytes), _wire=info,
        )  # fmt: skip

    @property
    def committed(self) -> bool:
        return self.state == "committed"

    def __repr__(self) -> str:
        shown = [f"step={self.step}", f"rank={self.rank}", f"timeline={self.timeline!r}", f"state={self.state!r}", f"copies={self.copies}"]
        extra = ("superseded", "host", "nbytes", "logical_nbytes", "error")
        shown += [f"{name}={getattr(self, name)!r}" for name in extra if getattr(self, name)]
        return f"SaveResult({', '.join(shown)})"

    # -- one release: what the protobuf ShardInfo that wait() returned before offered beyond these fields -------------
    @property
    def manifest(self) -> pb.Manifest:
        """Deprecated: the protobuf manifest (``host`` and ``nbytes`` are its useful parts)."""
        return self._deprecated("manifest").manifest

    @property
    def verified(self) -> bool:
        """Deprecated: always True for a returned save (its copies are verified)."""
        return self._deprecated("verified").verified

    def _deprecated(self, name: str) -> pb.ShardInfo:
        warnings.warn(
            f"SaveResult.{name} is deprecated and will be removed in the next release (handle.wait() returned a protobuf "
            "ShardInfo before): use SaveResult's own fields (host, nbytes, copies, state)",
            DeprecationWarning,
            stacklevel=3,
        )
        return self._wire if self._wire is not None else pb.ShardInfo()


@dataclass(frozen=True)
class RestorePoint:
    """One restorable version of a step: every rank's shard of ``timeline`` at ``step``."""

    step: int
    world_size: int
    timeline: str


@dataclass(frozen=True)
class ClientStats:
    """What ``client.stats()`` returns: the path a client took and what its last calls did, as one snapshot.

    Attributes:
        store_host: the host id of the client's store.
        shared_memory: whether saves go into the store's shared memory (else they are staged here and sent).
        control_socket: whether the save path's calls use the store's Unix socket (else gRPC).
        capture: registrations for DMA made so far (none after warm-up), fallbacks to pageable memory, the last cause.
        last_save_route: how the last save's bytes travelled: ``"shared memory"``, ``"data channel"`` or ``"grpc"``.
        last_load_source: the host the last ``load``'s copy came from (``"durable"``: the durable tier).
        last_restore_note: why the last lookup of a restorable step found none, when a store said ("" otherwise).
        agreement: what the last ``latest_step``/``restore_point``/``load`` agreed over a group cost.
    """

    store_host: str
    shared_memory: bool
    control_socket: bool
    capture: CaptureStats
    last_save_route: str = ""
    last_load_source: str = ""
    last_restore_note: str = ""
    agreement: AgreementStats = field(default_factory=AgreementStats)


class SaveHandle:
    """Tracks one save. ``wait()`` returns once R verified copies exist, or raises why not."""

    def __init__(
        self, step: int, timeline: str, rank: int, status: StatusQuery, *, skipped_reason: str = "",
        sending: Future[None] | None = None, capture: Capture | None = None,
    ) -> None:  # fmt: skip
        self._status = status
        self.rank = rank
        self._sending = sending  # a background send (remote_save="background") still to finish
        self._capture = capture  # capture="enqueued": the copies, then the commit or send, in the background
        self.step = step
        self.timeline = timeline
        self.skipped_reason = skipped_reason
        self.last_status: SaveResult | None = None  # what the store said last (wait() or done())
        self.stall_seconds = 0.0

    @property
    def superseded(self) -> bool:
        """True once ``wait()`` (or ``done()``) learned that the store dropped this save before replicating it because a
        newer save of this rank was captured first: saves came faster than replication could take them (newest wins)."""
        return self.last_status is not None and self.last_status.superseded

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
        self.last_status, done = self._status(0.0)
        return done

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Block until the shard is committed (returns its :class:`SaveResult`) or replication failed (raises ReplicationError);
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
                raise TimeoutError(f"step {self.step} of rank {self.rank} still being sent after {timeout}s") from None
        while True:
            remaining = 10.0 if deadline is None else max(0.0, deadline - time.monotonic())
            info, done = self._status(min(10.0, remaining))
            self.last_status = info
            if done:
                if info.committed or info.superseded:
                    return info
                raise ReplicationError(f"step {self.step} of rank {self.rank} did not reach R copies: {info.error or info.state}")
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"step {self.step} of rank {self.rank} not committed after {timeout}s (state {info.state}, {info.copies} copies)"
                )
