"""The background scrub: every held copy re-verified now and then, at a bounded rate (``--scrub-rate``).

A copy is verified when it lands (its checksums computed or checked) and again whenever a trainer opens it, so a
corrupt copy never reaches a trainer. What that leaves is a copy that rots while nobody reads it: memory with a bad
bit, a stray write into a mapping. Its replicas are the restore's second chance, and repair can only restore what
is found missing. The scrub finds it first: it walks the copies this store holds, hashes each chunk against the
checksums made at save time, and drops a copy whose chunk differs (the way ``Reader.open`` does), so the next repair
pass pulls it back from a copy that verifies. ``memstore status`` and the metrics count what it checked and found.

Under ``--redundancy ec:K+M`` it then walks the parity fragments this store keeps (``ParityKeeper.check``, block by
block against the checksums kept as contributions landed): a fragment that fails is dropped and the next repair pass
refills it from its data hosts while they are alive, before a loss would need it (it counts in ``ParityKeeper.corrupt``).

The rate bounds its cost: chunk by chunk, it sleeps so that no more than ``rate`` bytes a second are hashed (one
chunk at a time, on one thread). It skips copies younger than ``interval`` (verified when they landed) and waits
while the store's foreground is busy (saves, replication, restores, repairs: ``Store.foreground_busy``), as the
spill tier does. A pass over every copy is followed by ``interval`` seconds of rest.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from memstore.core.erasure_layout import BLOCK
from memstore.server.engine.catalog import Catalog
from memstore.server.engine.entries import Entry
from memstore.server.engine.parity import ParityKeeper
from memstore.v1.integrity import checksum, chunk_spans

log = logging.getLogger(__name__)

BUSY_WAIT_SECONDS = 0.1  # while the foreground is busy, how often the scrub looks again


class Scrubber:
    """Re-verifies held copies on the store's ``scrub`` thread (``loop``).

    Args:
        catalog: the store's shards (the copies to check; a corrupt one is dropped there).
        busy: whether the store's foreground moves bytes now (``Store.foreground_busy``): the scrub waits meanwhile.
        rate: bytes hashed per second at most (0: the scrub is off).
        interval: seconds of rest between passes.
        stop: set when the store closes.

    A dropped copy is pulled back by the repair loop's next pass (``--repair-interval``), from a copy that verifies.
    """

    def __init__(
        self, catalog: Catalog, busy: Callable[[], bool], rate: int, interval: float, stop: threading.Event,
        clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
    ) -> None:  # fmt: skip
        self.catalog = catalog
        self.busy = busy
        self.rate = rate
        self.interval = interval
        self._stop = stop
        self._clock = clock
        self._wall = wall
        self.scrubbed_bytes = 0  # bytes re-verified so far
        self.corrupt = 0  # copies and parity fragments found corrupt (and dropped) so far
        self.passes = 0  # passes completed
        self.parity: ParityKeeper | None = None  # set by the store under ec:K+M: its parity fragments are scrubbed too

    def loop(self) -> None:
        if self.rate <= 0:
            return
        while not self._stop.is_set():
            try:
                self.pass_once()
            except Exception:
                log.exception("scrub pass failed")
            self._stop.wait(self.interval)

    def pass_once(self) -> int:
        """Re-verify every copy held now (oldest first) and older than ``interval`` (a younger one was verified when it
        landed, and most of a save cadence's steps are evicted soon after); the copies found corrupt."""
        found = 0
        settled_before = self._wall() - self.interval
        for entry in sorted(self.catalog.settled_copies(), key=lambda e: e.created_unix):
            if self._stop.is_set():
                return found
            if entry.created_unix > settled_before:
                continue
            found += self.check(entry)
        if self.parity is not None:
            found += self.check_parity(self.parity, settled_before)
        self.passes += 1
        return found

    def check_parity(self, parity: ParityKeeper, settled_before: float) -> int:
        """Re-verify the blocks of every parity fragment created before ``settled_before`` (paced, as copies); the
        fragments found corrupt (each dropped by the keeper)."""
        found = 0
        for version, row, position in parity.blocks_held(settled_before):
            while self.busy() and not self._stop.is_set():
                self._stop.wait(BUSY_WAIT_SECONDS)
            if self._stop.is_set():
                return found
            started = self._clock()
            good = parity.check(version, row, position)
            if good is None:
                continue  # retired, or dropped at an earlier block
            self.scrubbed_bytes += BLOCK
            if not good:
                found += 1
                self.corrupt += 1
            self._pace(BLOCK, self._clock() - started)
        return found

    def check(self, entry: Entry) -> int:
        """Re-verify one copy chunk by chunk (paced); drop it if a chunk differs. 1 if it was found corrupt, else 0.

        The copy is pinned only while a chunk is hashed, so retention frees it at once when it goes; the scrub waits
        while the store's foreground is busy (a save copied in, a shard replicated, a restore or repair pulling)."""
        m = entry.manifest
        assert m is not None
        for index, (offset, length) in enumerate(chunk_spans(entry.nbytes, m.chunk_size)):
            while self.busy() and not self._stop.is_set():
                self._stop.wait(BUSY_WAIT_SECONDS)
            if self._stop.is_set() or not self.catalog.pin(entry):
                return 0  # stopping, or dropped meanwhile
            try:
                started = self._clock()
                good = checksum(entry.segment.view(entry.nbytes)[offset : offset + length]) == m.checksums[index]
                self.scrubbed_bytes += length
                if not good:
                    return self._corrupt(entry, index)
            finally:
                self.catalog.unpin(entry)
            self._pace(length, self._clock() - started)
        return 0

    def _corrupt(self, entry: Entry, chunk: int) -> int:
        if entry.dropped:  # evicted while it was hashed: its bytes are nobody's now
            return 0
        self.catalog.drop(entry, reason="copy failed verification in the background scrub")
        self.corrupt += 1
        log.warning("scrub: chunk %d of %s failed its checksum; dropped the copy (repair pulls one that verifies)", chunk, entry.key)
        return 1

    def _pace(self, nbytes: int, took: float) -> None:
        rest = nbytes / self.rate - took
        if rest > 0:
            self._stop.wait(rest)
