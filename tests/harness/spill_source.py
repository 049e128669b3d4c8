"""A spiller's ``ShardSource`` over shards held in memory, for unit tests of the spill tier."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from memstore.core.model import Manifest, ShardKey
from memstore.v1.integrity import compute_checksums


class FakeSource:
    """Shards held in memory; ``duty`` names the owners this store spills for now (every owner: ``None``)."""

    def __init__(self, host_id: str = "h1", duty: set[str] | None = None, world_size: int = 4, job: str = "job") -> None:
        self.host_id = host_id
        self.shards: dict[ShardKey, tuple[Manifest, bytes]] = {}
        self.duty = {host_id} if duty is None else duty
        self.world_size = world_size
        self.job = job

    def hold(self, step: int, rank: int = 0, owner: str | None = None, data: bytes | None = None) -> None:
        """Hold ``rank``'s shard of ``step`` (owned by ``owner``, default this host): ``data``, or bytes of its rank and step."""
        if data is None:
            data = bytes([rank + 1]) * 4096 + bytes([step % 256]) * 100
        key = ShardKey(self.job, step, rank, "t1")
        sums = tuple(compute_checksums(memoryview(data), len(data), 1024))
        manifest = Manifest(key, self.world_size, len(data), 1024, sums, owner or self.host_id, created_unix=float(step))
        self.shards[key] = (manifest, data)

    def spill_shards(self) -> list[Manifest]:
        return [m for m, _ in self.shards.values() if self.spills_for(m.owner_host)]

    def spills_for(self, owner_host: str) -> bool:
        return owner_host in self.duty

    @contextlib.contextmanager
    def pinned_bytes(self, key: ShardKey) -> Iterator[memoryview | None]:
        yield memoryview(self.shards[key][1]) if key in self.shards else None

    def foreground_busy(self) -> bool:
        return False

    def spilled(self) -> None:
        pass
