"""A capture the store pushes while the client is still writing it (``CommitRequest.captured_bytes``).

For a large shard the client tells the store, as it copies, how far the shard's bytes are final; the replicator
sends each chunk once the mark has passed it, so the push overlaps the copy instead of following it. The last
chunk waits for the capture's end (the Commit without ``captured_bytes``): a group peer receives the whole shard,
and registers a copy, only once the client has finished it. A capture whose mark stops moving for
``CAPTURE_STALL_SECONDS`` (its client died, or lost the store) is abandoned: every wait on it raises
``CaptureAbandoned``, the pushes close their streams (the peers drop what they got) and the store drops the shard.
"""

from __future__ import annotations

import threading
import time

from memstore.errors import CaptureAbandoned

CAPTURE_STALL_SECONDS = 60.0  # the longest a capture's mark may stand still before the store gives it up


class CaptureProgress:
    """How far the bytes of one shard being captured are final: ``advance`` (the client's mark), ``finish``
    (the capture's end) or ``abandon``; pushes ``wait_for`` the chunk they send next."""

    def __init__(self, nbytes: int, stall: float | None = None) -> None:
        self.nbytes = nbytes
        self.stall = CAPTURE_STALL_SECONDS if stall is None else stall
        self.mark = 0  # bytes final; below nbytes until the capture is finished
        self.finished = False
        self.abandoned = ""  # why, once abandoned
        self._moved = time.monotonic()
        self._cond = threading.Condition()

    def advance(self, captured: int) -> None:
        """The client's mark: its first ``captured`` bytes are final (never the whole shard: ``finish`` says that)."""
        with self._cond:
            mark = min(captured, self.nbytes - 1)
            if mark > self.mark:
                self.mark = mark
            self._moved = time.monotonic()
            self._cond.notify_all()

    def finish(self) -> None:
        with self._cond:
            self.finished = True
            self.mark = self.nbytes
            self._cond.notify_all()

    def abandon(self, why: str) -> None:
        with self._cond:
            if not self.finished:
                self.abandoned = why
            self._cond.notify_all()

    def wait_for(self, end: int) -> None:
        """Until the first ``end`` bytes are final; CaptureAbandoned if the capture is given up meanwhile."""
        with self._cond:
            while self.mark < end and not self.abandoned:
                left = self._moved + self.stall - time.monotonic()
                if left <= 0:
                    self.abandoned = f"its client made no progress for {self.stall:.0f}s (at byte {self.mark} of {self.nbytes})"
                    self._cond.notify_all()
                    break
                self._cond.wait(left)
            if self.mark < end:
                raise CaptureAbandoned(f"the capture was abandoned: {self.abandoned}")

    def wait_finished(self) -> None:
        self.wait_for(self.nbytes)
