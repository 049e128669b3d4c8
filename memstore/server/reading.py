"""Local reads: read leases for trainers on this host, and the bytes of a verified copy."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterator

from memstore.core.model import Manifest, ShardKey
from memstore.errors import (
    InvalidArgument,
    ShardNotFound,
)
from memstore.server.catalog import (
    READ_LEASE_SECONDS,
    Catalog,
    Entry,
    Lease,
)

log = logging.getLogger(__name__)


class Reading(Catalog):
    """Lends verified copies to readers (shared-memory mapping or stream) while keeping them pinned."""

    def open(self, key: ShardKey) -> tuple[str, Entry]:
        entry = self._readable(key)
        if entry.segment.path is None:
            raise InvalidArgument(f"store {self.host_id} has no shared-memory dir; read the shard with Get")
        if not self._pin(entry):
            raise ShardNotFound(f"shard {key} was evicted while opening it")
        entry.segment.exported = True
        lease_id = secrets.token_hex(16)
        with self._lock:
            self._read_leases[lease_id] = Lease(entry, time.monotonic() + READ_LEASE_SECONDS)
        return lease_id, entry

    def release(self, lease_id: str) -> None:
        with self._lock:
            lease = self._read_leases.pop(lease_id, None)
            alloc = self._alloc_leases.pop(lease_id, None)
        if lease is not None:
            self._unpin(lease.entry)
        elif alloc is not None:
            self.pool.release(alloc.entry.segment)

    def read(self, key: ShardKey) -> Iterator[tuple[Manifest, memoryview]]:
        """Context-style generator: yields (manifest, view) once with the entry pinned."""
        entry = self._readable(key)
        if not self._pin(entry):
            raise ShardNotFound(f"shard {key} was evicted while reading it")
        try:
            assert entry.manifest is not None
            yield entry.manifest, entry.segment.view(entry.nbytes)
        finally:
            self._unpin(entry)
