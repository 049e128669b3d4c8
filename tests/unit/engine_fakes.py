"""Fakes of the store engine's ports, for the millisecond unit tests of its parts (tests/unit/test_engine_*.py).

Each part of the engine (``memstore.server.store`` builds them) takes its collaborators in its constructor; these
stand in for the segment pool, the peers and the events, in memory and without threads, files or sockets.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

from memstore.config import StoreConfig
from memstore.core.model import Manifest, ShardInfo, ShardKey, ShardState, TransferHeader
from memstore.errors import CapacityExceeded, DataChannelUnsupported, PeerUnavailable, StoreError
from memstore.server.engine.admission import Admission
from memstore.server.engine.arrivals import Arrivals
from memstore.server.engine.catalog import Catalog
from memstore.server.engine.entries import Entry
from memstore.server.engine.eviction import Eviction
from memstore.server.engine.room import Room
from memstore.server.events import StoreEvents
from memstore.server.membership import Membership
from memstore.server.memory.leftovers import Adoption, Sidecars
from memstore.server.memory.pool import Segment
from memstore.v1.integrity import StreamedChecksums, compute_checksums

KiB = 1024


def config(**flags: str) -> StoreConfig:
    """A store's config for host h0 (R=1, 64 KiB, chunks of 4 KiB, keep 2), ``flags`` on top."""
    cli = {"host_id": "h0", "replicas": "1", "capacity": "64KiB", "chunk_bytes": "4KiB", "keep": "2", "shm_dir": "", "discovery": "fed"}
    return StoreConfig.load({**cli, **flags}, env={})


class FakePool:
    """The segment pool: anonymous segments, exact accounting against ``capacity``, no files, no reserve thread."""

    def __init__(self, capacity: int, directory: str | None = "/fake/shm") -> None:
        self.capacity = capacity
        self.directory = directory
        self.used = 0
        self.released: list[Segment] = []
        self.unpooled: list[Segment] = []  # released with reuse=False: back to the kernel, never a spare
        self.streams: list[tuple[str, int] | None] = []  # the stream each acquire taught the reserve (None: none)
        self.described: dict[int, bytes] = {}
        self.adoptable: list[tuple[Segment, bytes]] = []  # what a previous incarnation left (adopt checks each)

    def acquire(
        self, nbytes: int, owner: str, what: str = "", quota: int = 0, preferred: str = "", ring: int = -1,
        stream: tuple[str, int] | None = None, **_: Any,
    ) -> Segment:  # fmt: skip
        self.streams.append(stream)
        if self.used + nbytes > self.capacity:
            raise CapacityExceeded(f"{what} needs {nbytes}", needed=nbytes, used=self.used, capacity=self.capacity)
        self.used += nbytes
        seg = Segment(f"{self.directory}/seg-{len(self.described)}-{self.used}" if self.directory else None, nbytes, mmap.mmap(-1, nbytes))
        seg.owner, seg.ring = owner, ring
        return seg

    @property
    def in_use_bytes(self) -> int:
        return self.used

    @contextlib.contextmanager
    def saving_into(self, owner: str, ring: int) -> Iterator[None]:
        yield

    def ring_full(self, owner: str, ring: int) -> int:
        return 0  # rings never fill here: every acquire makes a segment

    def count_growth(self, owner: str, ring: int, size: int) -> None:
        raise AssertionError("the fake pool's rings never fill")

    def release(self, seg: Segment, reuse: bool = True, written: bool = False) -> None:
        assert seg not in self.released, "a segment released twice"
        self.released.append(seg)
        if not reuse:
            self.unpooled.append(seg)
        self.used -= seg.size

    def describe(self, seg: Segment, meta: bytes) -> None:
        self.described[id(seg)] = meta

    def adopt(self, check: Callable[[Segment, bytes], bool]) -> list[tuple[Segment, bytes]]:
        kept = [(seg, meta) for seg, meta in self.adoptable if check(seg, meta)]
        self.used += sum(seg.size for seg, _ in kept)
        return kept

    def ring_paths(self, owner: str, ring: int) -> list[str]:
        return []


@dataclass
class FakePeer:
    """One peer store: takes pushes (or refuses them), serves its copies, answers Hello."""

    host_id: str
    held: dict[ShardKey, tuple[Manifest, bytes]] = field(default_factory=dict)
    refuse: str = ""  # push/pull fail with PeerUnavailable(refuse)
    refuse_push: str = ""  # only pushes fail (the peer answers Hello and listings)
    draining: bool = False
    pushes: list[ShardKey] = field(default_factory=list)
    data_channel: bool = False
    cached: set[ShardKey] = field(default_factory=set)  # held copies it lists as cached (pulled ahead of a restore)
    expected: list[tuple[str, int, int]] = field(default_factory=list)  # (job, rank, nbytes) announced to it (Expect)
    floors: list[tuple[int | None, str]] = field(default_factory=list)  # the restorable floor each push carried

    def push(self, header: TransferHeader, view: memoryview, timeout: float) -> None:
        if self.refuse or self.refuse_push:
            raise PeerUnavailable(self.refuse or self.refuse_push)
        self.pushes.append(header.manifest.key)
        self.floors.append((header.restorable_floor, header.restorable_floor_timeline))
        self.held[header.manifest.key] = (header.manifest, bytes(view))

    def push_data(
        self,
        header: TransferHeader,
        view: memoryview,
        timeout: float,
        control_timeout: float,
        streams: int = 1,
        sums: StreamedChecksums | None = None,
        ready: Callable[[int], None] | None = None,
        source_fd: int | None = None,  # never given here: fake segments have no file
    ) -> None:
        if not self.data_channel:
            raise DataChannelUnsupported(f"{self.host_id} has no data channel")
        if ready is not None:  # a capture still being written: the whole shard once its client finished it
            ready(len(view))
        if sums is not None:  # the checksums come with the chunks: the copy holds the true ones
            header = replace(header, manifest=replace(header.manifest, checksums=sums.complete(view)))
        self.push(header, view, timeout)

    def pull_data(
        self, key: ShardKey, into: Callable[[Manifest], memoryview], timeout: float, control_timeout: float, streams: int = 0,
        fresh: Callable[[], bool] = lambda: True,
    ) -> Manifest:  # fmt: skip
        raise DataChannelUnsupported(f"{self.host_id} has no data channel")

    def get(self, key: ShardKey, timeout: float) -> tuple[Manifest, Iterator[bytes], Any]:
        if self.refuse or key not in self.held:
            raise PeerUnavailable(self.refuse or f"{self.host_id} holds no {key}")
        manifest, data = self.held[key]
        chunks = [data[i : i + manifest.chunk_size] for i in range(0, len(data), manifest.chunk_size)]
        return manifest, iter(chunks), _Call()

    def hello(self, timeout: float, fresh: bool = False) -> SimpleNamespace:
        if self.refuse:
            raise PeerUnavailable(self.refuse)
        return SimpleNamespace(host_id=self.host_id, draining=self.draining)

    def listing(self) -> list[ShardInfo] | StoreError:
        if self.refuse:
            return PeerUnavailable(self.refuse)
        return [ShardInfo(m, ShardState.COMMITTED, True, "", 1, cached=m.key in self.cached) for m, _ in self.held.values()]


class _Call:
    def cancel(self) -> None:
        pass


class FakePeers:
    """The peer directory over ``FakePeer``s."""

    def __init__(self, *peers: FakePeer) -> None:
        self.peers = {p.host_id: p for p in peers}

    def __getitem__(self, host_id: str) -> FakePeer:
        return self.peers[host_id]

    def announce(self, hosts: Iterable[str], job_id: str, rank: int, nbytes: int, timeout: float) -> None:
        for h in hosts:
            if h in self.peers:
                self.peers[h].expected.append((job_id, rank, nbytes))

    def list_all(
        self, job_id: str, timeout: float, hosts: Iterable[str] | None = None, retrying: bool = True
    ) -> dict[str, list[ShardInfo] | StoreError]:
        out: dict[str, list[ShardInfo] | StoreError] = {}
        for h in self.peers if hosts is None else hosts:
            if h in self.peers:
                listing = self.peers[h].listing()
                mine = listing if isinstance(listing, StoreError) else [i for i in listing if job_id in ("", i.manifest.key.job_id)]
                out[h] = mine
        return out


class RecordingEvents(StoreEvents):
    """The engine's events, recorded as (hook, args) in call order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def named(self, hook: str) -> list[tuple[Any, ...]]:
        return [args for name, args in self.calls if name == hook]

    def saved(self, path: str, seconds: float) -> None:
        self.calls.append(("saved", (path, seconds)))

    def captured(self, registrations: int, fallbacks: int) -> None:
        self.calls.append(("captured", (registrations, fallbacks)))

    def pushed(self, nbytes: int) -> None:
        self.calls.append(("pushed", (nbytes,)))

    def replicated(self, seconds: float) -> None:
        self.calls.append(("replicated", (seconds,)))

    def settled(self, state: str) -> None:
        self.calls.append(("settled", (state,)))

    def fetched(self, source: str, seconds: float) -> None:
        self.calls.append(("fetched", (source, seconds)))

    def repaired(self, source: str, seconds: float) -> None:
        self.calls.append(("repaired", (source, seconds)))

    def pulled(self, source: str, nbytes: int) -> None:
        self.calls.append(("pulled", (source, nbytes)))


def membership(me: str = "h0", hosts: Iterable[str] = ("h0",), replicas: int = 1) -> Membership:
    """A slot table of ``hosts`` (in slot order), as this store ``me`` sees it."""
    m = Membership(me, "mixed", replicas)
    m.apply({h: (f"127.0.0.1:{i + 1}", "") for i, h in enumerate(hosts)})
    return m


def make_catalog(cfg: StoreConfig | None = None, pool: FakePool | None = None) -> tuple[Catalog, FakePool, threading.Event]:
    cfg = cfg or config()
    pool = pool or FakePool(cfg.capacity)
    stop = threading.Event()
    return Catalog(cfg.host_id, cfg, pool, stop, Sidecars(pool)), pool, stop  # type: ignore[arg-type]


def adoption_of(catalog: Catalog) -> Adoption:
    """The ``Adoption`` of ``catalog``'s leftovers, from its (fake) pool's ``adoptable``."""
    return Adoption(catalog.host_id, catalog, catalog.pool)  # type: ignore[arg-type]


def arrivals_of(catalog: Catalog, stop: threading.Event | None = None) -> Arrivals:
    """The ``Arrivals`` under ``catalog``'s lock, as the store builds it (``stop``: the one ``make_catalog`` made)."""
    return Arrivals(catalog, stop or threading.Event())


def room_of(catalog: Catalog, eviction: Eviction | None = None) -> Room:
    """The ``Room`` over ``catalog``'s (fake) pool, dropping through ``eviction`` (a new one over ``catalog`` by default)."""
    return Room(eviction or Eviction(catalog), catalog.pool, catalog.config)


def admission_of(cfg: StoreConfig) -> Admission:
    return Admission(cfg.host_id, cfg.max_streams_per_peer)


def manifest_of(key: ShardKey, data: bytes, owner: str = "h0", chunk: int = 4 * KiB, world_size: int = 1, created: float = 0.0) -> Manifest:
    checksums = tuple(compute_checksums(memoryview(data), len(data), chunk))
    return Manifest(key, world_size, len(data), chunk, checksums, owner, created_unix=created)


def captured(catalog: Catalog, key: ShardKey, data: bytes, owner: str = "h0") -> Entry:
    """An entry the way Saver.allocate makes it (CAPTURED, not in the catalog yet), holding ``data``."""
    seg = room_of(catalog).acquire(key, len(data))
    seg.view(len(data))[:] = data
    return Entry(key, 1, len(data), seg, owner, ShardState.CAPTURED)


def commit(catalog: Catalog, key: ShardKey, data: bytes) -> Entry:
    """Allocate, fill and commit ``key`` in the catalog (what the Saver does, without replication)."""
    lease = catalog.lease_allocation(captured(catalog, key, data), ahead=False)
    return catalog.commit_lease(lease, None, 0, {}, 1, "")


def settled(catalog: Catalog, key: ShardKey, data: bytes, created: float = 0.0) -> Entry:
    """``key`` committed, checksummed and settled (COMMITTED with R=1)."""
    entry = commit(catalog, key, data)
    if created:
        entry.created_unix = created
    catalog.take_up(entry)
    catalog.checksummed(entry, manifest_of(key, data, created=entry.created_unix))
    catalog.settle(entry, copies=catalog.config.replicas, errors=[])
    return entry
