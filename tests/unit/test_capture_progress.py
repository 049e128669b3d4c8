"""CaptureProgress: pushes wait for the bytes they send next; the last ones wait for the capture's end; a capture that
stops moving is abandoned and every wait on it raises."""

from __future__ import annotations

import threading
import time

import pytest

from memstore.errors import CaptureAbandoned
from memstore.server.engine.progress import CaptureProgress

pytestmark = pytest.mark.unit


def test_waits_end_when_the_mark_passes_and_the_last_byte_needs_the_finish() -> None:
    p = CaptureProgress(100, stall=30)
    p.advance(40)
    p.wait_for(40)  # final already: no wait
    p.advance(100)  # a mark never says the whole shard: only finish does
    assert p.mark == 99 and not p.finished
    got: list[int] = []
    t = threading.Thread(target=lambda: (p.wait_for(100), got.append(1)))
    t.start()
    t.join(0.05)
    assert got == []  # still waiting for the end of the capture
    p.finish()
    t.join(5)
    assert got == [1] and p.mark == 100


def test_a_capture_that_stops_moving_is_abandoned_for_every_waiter() -> None:
    p = CaptureProgress(100, stall=0.05)
    p.advance(10)
    t0 = time.monotonic()
    with pytest.raises(CaptureAbandoned, match="no progress"):
        p.wait_for(50)
    assert time.monotonic() - t0 < 5
    with pytest.raises(CaptureAbandoned):
        p.wait_finished()
    p.wait_for(10)  # what was final stays final


def test_abandon_wakes_a_waiter_at_once() -> None:
    p = CaptureProgress(100, stall=30)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            p.wait_finished()
        except CaptureAbandoned as exc:
            errors.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    p.abandon("the store is closing")
    t.join(5)
    assert len(errors) == 1 and "closing" in str(errors[0])
