"""Local reads: read leases for trainers on this host, the bytes of a verified copy, and the durable tier's reads."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator

from memstore.core.model import Manifest, ShardKey
from memstore.errors import (
    ChecksumMismatch,
    InvalidArgument,
    ShardNotFound,
)
from memstore.server.engine.catalog import Catalog
from memstore.server.engine.entries import Entry
from memstore.v1.integrity import first_mismatch

log = logging.getLogger(__name__)

VERIFY_WORKERS = max(1, min(4, os.cpu_count() or 1))  # threads hashing a shard a trainer opens (xxhash lets go of the GIL)
ARRIVAL_CHECK_SECONDS = 5.0  # a copy pulled in with every chunk verified this recently is lent once without hashing it again


class Reader:
    """Lends verified copies to readers (shared-memory mapping or stream) while keeping them pinned."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.host_id = catalog.host_id

    def open(self, key: ShardKey, transient: bool = False, reader_verifies: bool = False) -> tuple[str, Entry]:
        """Lend the verified local copy of ``key`` to a reader on this machine, checked chunk by chunk now.

        ``transient``: the reader copies the bytes out and unmaps before it releases the lease (a restore onto a
        device), so the segment stays recyclable (a segment of a capture ring stays in its ring). Otherwise the
        reader may keep a copy-on-write mapping for as long as it likes, so the segment is never reused.

        The store verifies, not the reader: its own mapping of the segment is faulted in already, so a
        restore pays for hashing the bytes and nothing else, and the reader maps only what it touches. A copy
        that fails is dropped and DATA_LOSS tells the reader to ask again (the store then pulls another).
        A copy pulled in for a restore had every chunk verified as it landed: its first reader within
        ``ARRIVAL_CHECK_SECONDS`` gets it without a second pass over the same bytes; every later one hashes it.
        ``reader_verifies``: the reader hashes every chunk beside its copy (a restore onto a device, whose copies then
        need not wait for a pass over the whole shard first): the store lends the copy as it is.
        """
        entry = self.catalog.readable(key)
        if entry.segment.path is None:
            raise InvalidArgument(f"store {self.host_id} has no shared-memory dir; read the shard with Get")
        if not self.catalog.pin(entry):
            raise ShardNotFound(f"shard {key} was evicted while opening it")
        m = entry.manifest
        assert m is not None
        just_checked = reader_verifies or time.monotonic() - entry.arrived_verified < ARRIVAL_CHECK_SECONDS
        if not reader_verifies:
            entry.arrived_verified = 0.0  # once
        bad = None if just_checked else first_mismatch(entry.segment.view(entry.nbytes), entry.nbytes, m.chunk_size, m.checksums,
                                                       workers=VERIFY_WORKERS)  # fmt: skip
        if bad is not None:
            self.catalog.unpin(entry)
            self.catalog.drop(entry, reason="local copy failed verification when a trainer opened it")
            log.warning("local copy of %s failed verification (chunk %d) when opened; dropped it", key, bad)
            raise ChecksumMismatch(f"chunk {bad} of {key} failed its checksum on store {self.host_id}; the copy was dropped, ask again")
        if not transient:
            entry.segment.exported = True
        return self.catalog.lease_reader(entry), entry

    def open_many(
        self, key: ShardKey, also: list[ShardKey], transient: bool = False, reader_verifies: bool = False
    ) -> list[tuple[str, Entry] | None]:
        """``open`` of ``key`` (raising as it does) and, in the same call, of more shards of its job (a replica group's
        other stripes): the leases in that order, None for one of ``also`` this store does not hold or whose copy failed
        its check (the reader fetches that one instead)."""
        wrong = next((k for k in also if k.job_id != key.job_id), None)
        if wrong is not None:
            raise InvalidArgument(f"Open also= names a shard of job {wrong.job_id!r}: only shards of {key.job_id!r} opened with {key}")
        opened: list[tuple[str, Entry] | None] = [self.open(key, transient, reader_verifies)]
        try:
            for k in also:
                try:
                    opened.append(self.open(k, transient, reader_verifies))
                except (ShardNotFound, ChecksumMismatch):
                    opened.append(None)
        except BaseException:
            for lease in opened:  # nothing answered: no lease outlives the call
                if lease is not None:
                    self.release(lease[0])
            raise
        return opened

    def release(self, lease_id: str) -> None:
        """End a read lease, or give back an allocation that was never committed."""
        self.catalog.release_lease(lease_id)

    def read(self, key: ShardKey) -> Iterator[tuple[Manifest, memoryview]]:
        """Context-style generator: yields (manifest, view) once with the entry pinned."""
        entry = self.catalog.readable(key)
        if not self.catalog.pin(entry):
            raise ShardNotFound(f"shard {key} was evicted while reading it")
        try:
            assert entry.manifest is not None
            yield entry.manifest, entry.segment.view(entry.nbytes)
        finally:
            self.catalog.unpin(entry)

    @contextlib.contextmanager
    def pinned_bytes(self, key: ShardKey) -> Iterator[memoryview | None]:
        """The bytes of the copy of ``key`` held, pinned while the caller reads them (None: not held): the durable
        tier's reads (``memstore.spill.port.ShardSource``, through the ``Store``)."""
        entry = self.catalog.get(key)
        if entry is None or not self.catalog.pin(entry):
            yield None
            return
        view = entry.segment.view(entry.nbytes)
        try:
            yield view
        finally:
            view.release()
            self.catalog.unpin(entry)
