"""The background scrub alone (``memstore.server.engine.scrub``): held copies re-verified at a bounded rate; a corrupt one is
dropped (repair pulls it again), a sound one, a copy in flight and a copy evicted meanwhile are left alone."""

from __future__ import annotations

import threading

import pytest

from memstore.core.model import ShardKey
from memstore.server.engine.scrub import BUSY_WAIT_SECONDS, Scrubber
from tests.unit.engine_fakes import commit, make_catalog, settled

pytestmark = pytest.mark.unit
DATA = bytes(range(256)) * 64  # 16 KiB: 4 chunks of 4 KiB


def test_a_pass_drops_the_corrupt_copy_and_keeps_the_sound_ones() -> None:
    catalog, pool, stop = make_catalog()
    sound = settled(catalog, ShardKey("job", 1, 0), DATA, created=1.0)
    rotten = settled(catalog, ShardKey("job", 2, 0), DATA, created=2.0)
    rotten.segment.view()[3 * 4096 + 7] ^= 0x01  # one bit of its last chunk, flipped in RAM
    in_flight = commit(catalog, ShardKey("job", 3, 0), DATA)  # committed, not checksummed yet: the scrub leaves it alone
    in_flight.segment.view()[0] ^= 0x01
    scrub = Scrubber(catalog, catalog.busy, rate=1 << 40, interval=60.0, stop=stop)
    assert scrub.pass_once() == 1
    assert catalog.get(rotten.key) is None and rotten.segment in pool.released
    assert catalog.get(sound.key) is sound and sound.pins == 0
    assert catalog.get(in_flight.key) is in_flight
    assert scrub.corrupt == 1 and scrub.passes == 1
    assert scrub.scrubbed_bytes == len(DATA) + 4 * 4096  # the sound copy whole, the rotten one up to its bad chunk


def test_the_rate_bounds_the_bytes_hashed_per_second() -> None:
    catalog, _, stop = make_catalog()
    settled(catalog, ShardKey("job", 1, 0), DATA, created=1.0)
    waits: list[float] = []

    class Recording(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            waits.append(timeout or 0.0)
            return False

    scrub = Scrubber(catalog, catalog.busy, rate=4096 * 100, interval=60.0, stop=Recording(), clock=lambda: 0.0)  # hashing takes no time
    assert scrub.pass_once() == 0
    assert waits == pytest.approx([0.01] * 4)  # each 4 KiB chunk at 400 KiB/s
    stop.set()


def test_a_copy_evicted_while_it_is_hashed_is_not_counted_corrupt() -> None:
    catalog, _, stop = make_catalog()
    entry = settled(catalog, ShardKey("job", 1, 0), DATA, created=1.0)
    entry.segment.view()[0] ^= 0x01

    def evicted_meanwhile() -> float:
        if catalog.get(entry.key) is not None:
            catalog.drop(entry, "evicted by retention")  # retention took it: its bytes are nobody's now
        return 0.0

    scrub = Scrubber(catalog, catalog.busy, rate=1 << 40, interval=60.0, stop=stop, clock=evicted_meanwhile)
    assert scrub.pass_once() == 0 and scrub.corrupt == 0


def test_rate_zero_is_off() -> None:
    catalog, _, stop = make_catalog()
    rotten = settled(catalog, ShardKey("job", 1, 0), DATA, created=1.0)
    rotten.segment.view()[0] ^= 0x01
    Scrubber(catalog, catalog.busy, rate=0, interval=0.01, stop=stop).loop()  # returns at once
    assert catalog.get(rotten.key) is rotten


def test_it_waits_while_the_foreground_is_busy() -> None:
    catalog, _, _ = make_catalog()
    settled(catalog, ShardKey("job", 1, 0), DATA[:4096], created=1.0)  # one chunk
    busy = iter([True, True, False])
    waits: list[float] = []

    class Recording(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            waits.append(timeout or 0.0)
            return False

    Scrubber(catalog, lambda: next(busy), rate=1 << 40, interval=60.0, stop=Recording()).pass_once()
    assert waits[:2] == [BUSY_WAIT_SECONDS, BUSY_WAIT_SECONDS]  # a save was being copied in: it hashed nothing then


def test_a_copy_younger_than_the_interval_waits_for_a_later_pass() -> None:
    catalog, _, stop = make_catalog()
    rotten = settled(catalog, ShardKey("job", 1, 0), DATA, created=1000.0)
    rotten.segment.view()[0] ^= 0x01
    scrub = Scrubber(catalog, catalog.busy, rate=1 << 40, interval=60.0, stop=stop, wall=lambda: 1030.0)
    assert scrub.pass_once() == 0 and scrub.scrubbed_bytes == 0  # verified when it landed, 30 s ago
    scrub = Scrubber(catalog, catalog.busy, rate=1 << 40, interval=60.0, stop=stop, wall=lambda: 1061.0)
    assert scrub.pass_once() == 1
