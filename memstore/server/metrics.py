"""``--metrics-port``: Prometheus metrics of one store, served at ``http://<--listen host>:<port>/metrics``.

Two kinds of series (every name and its meaning: docs/metrics.md):

- **State**, read from the engine when Prometheus scrapes (:class:`StoreCollector`): memory, what is held per job
  and tier, the newest committed and spilled steps, replication and repair in flight, under-replicated shards,
  the spill tier's progress, membership, readiness. Nothing is kept up to date between scrapes for these, and
  the durable tier is never listed for them (its numbers are what the spill loop learnt last).
- **Events**, counted and timed where they happen (:class:`StoreMetrics`, the engine's
  :class:`~memstore.server.events.StoreEvents`): saves taken in, replication and its latency, fetches, repair
  pulls, spilled shards, RPCs and their failures by status code.

Each :class:`StoreMetrics` owns a :class:`CollectorRegistry` of its own (never the process-wide default), so
several stores in one process (tests, Ray actors) never collide. This is the only module of memstore that
imports ``prometheus_client`` (scripts/check_structure.py).

Labels are few and bounded: ``job_id`` (one per job a store holds; named ``job_id``, not ``job``, because
Prometheus sets ``job`` on every series to the scrape job), ``tier``, ``kind``, ``source``, ``path``, ``state``,
``method`` and ``code``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, PlatformCollector, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from memstore import __version__
from memstore.core.status import HealthReport, JobCensus
from memstore.errors import ConfigError
from memstore.server.events import FETCH_SOURCES, PULL_SOURCES, SAVE_PATHS, SETTLED, StoreEvents
from memstore.spill.port import JobSpillStatus

if TYPE_CHECKING:
    from memstore.server.store import Store

log = logging.getLogger(__name__)

PREFIX = "memstore_"
#: latency buckets (seconds) of every histogram: a small save's milliseconds up to a large spill's minutes
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass
class Snapshot:
    """What a scrape reads of a store, in one go: the inputs of :func:`state_families`."""

    health: HealthReport
    census: list[JobCensus]
    spill: Mapping[str, JobSpillStatus]
    under_replicated: int
    retention_listings: int  # retention passes that listed the cluster (a job without a restorable floor)
    unreachable_sources: tuple[str, ...]
    replicas: int
    placement: str
    address: str
    now: float = field(default_factory=time.time)


def snapshot_of(store: Store) -> Snapshot:
    durable = store.durable
    return Snapshot(
        health=store.health(),
        census=store.census(),
        spill=dict(durable.status) if durable is not None else {},
        under_replicated=store.under_replicated,
        retention_listings=store.janitor.listings,
        unreachable_sources=store.unreachable_sources,
        replicas=store.config.replicas,
        placement=store.config.placement,
        address=store.advertised_address,
    )


def _gauge(name: str, doc: str, value: float | None = None, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    labels = list(labels)
    if labels:
        return GaugeMetricFamily(PREFIX + name, doc, labels=labels)
    return GaugeMetricFamily(PREFIX + name, doc, value=value if value is not None else 0.0)


def state_families(s: Snapshot) -> list[Metric]:
    """Every state series of one store at one moment. Each family is there even with no sample (a store that holds
    no job yet), so one scrape names every series this store can export."""
    h = s.health
    info = _gauge(
        "info", "Constant 1; the store's identity and version in its labels.", labels=("host_id", "version", "placement", "address")
    )
    info.add_metric([h.host_id, __version__, s.placement, s.address], 1)
    out: list[Metric] = [
        info,
        _gauge("capacity_bytes", "RAM budget for shard bytes (--capacity).", h.capacity_bytes),
        _gauge("used_bytes", "Bytes of the shared-memory segments held, in use and pooled (counted against the capacity).", h.used_bytes),
        _gauge("pooled_bytes", "Part of used_bytes: free segments kept faulted in (job pools and the --prefault reserve).", h.pooled_bytes),
        _gauge("reserve_bytes", "Part of pooled_bytes: fresh pre-faulted segments of the reserve (--prefault).", h.reserve_bytes),
        _gauge("replication_factor", "Copies of each shard in RAM, counting the owner's (--replicas).", s.replicas),
        _gauge("replications_in_flight", "Owned shards being checksummed or pushed to group peers now.", h.replications_in_flight),
        _gauge("repairs_in_flight", "Missing shards the repair loop is pulling now.", h.repairs_in_flight),
        _gauge(
            "under_replicated_shards",
            "Recent shards of this store's slots with fewer than R reachable verified copies (last repair pass).",
            s.under_replicated,
        ),
        _gauge(
            "peers_unreachable",
            "Holders of this store's slots (group peers) that did not answer the last repair pass.",
            len(s.unreachable_sources),
        ),
        _gauge("adopted_shards", "Shards adopted at start from the segments a previous incarnation left in RAM.", h.adopted_shards),
        _gauge(
            "orphaned_shm_bytes",
            "Bytes of segment directories under --shm-dir that no running store owns "
            "(adopted by a successor, else reclaimed after --shm-reclaim-after).",
            sum(o.bytes for o in h.orphans),
        ),
    ]
    out += [
        CounterMetricFamily(
            PREFIX + "capture_registrations",
            "cudaHostRegister calls clients made for their captures into this store (0 after warm-up: each rank's ring "
            "of capture segments is registered once).",
            value=h.capture.registrations,
        ),
        CounterMetricFamily(
            PREFIX + "capture_fallbacks",
            "Client captures that went through pageable memory because registration failed (should stay 0).",
            value=h.capture.fallbacks,
        ),
        CounterMetricFamily(
            PREFIX + "retention_listings",
            "Retention passes that listed every store for the newest restorable step (a job whose clients have no group=).",
            value=s.retention_listings,
        ),
        CounterMetricFamily(
            PREFIX + "saves_superseded",
            "Saves dropped before replication because a newer save of the same rank came first (newest wins).",
            value=h.saves_superseded,
        ),
        CounterMetricFamily(PREFIX + "scrubbed_bytes", "Bytes of held copies the background scrub re-verified.", value=h.scrubbed_bytes),
        CounterMetricFamily(
            PREFIX + "scrub_corrupt",
            "Copies the background scrub found corrupt (each dropped, and pulled again from a copy that verifies).",
            value=h.scrub_corrupt,
        ),
    ]
    job_bytes = _gauge("job_bytes", "Shard bytes of a job held in this store's RAM (its own shards, replicas, saves in flight).",
                       labels=["job_id"])  # fmt: skip
    shards = _gauge("shards", "Shards of a job held per tier: ram (copies here), durable (published, as last listed).",
                    labels=["job_id", "tier"])  # fmt: skip
    steps = _gauge("steps", "Distinct steps of a job per tier: ram (copies here), durable (with a published rank, as last listed).",
                   labels=["job_id", "tier"])  # fmt: skip
    newest = _gauge("newest_step", "Newest step of a job: committed (a committed copy held here), spilled (published by this store), "
                    "floor (every rank saved it: the restorable floor its ranks agreed, retention keeps it and all above).",
                    labels=["job_id", "kind"])  # fmt: skip
    for c in s.census:
        job_bytes.add_metric([c.job_id], c.nbytes)
        shards.add_metric([c.job_id, "ram"], c.shards)
        steps.add_metric([c.job_id, "ram"], c.steps)
        if c.newest_committed >= 0:
            newest.add_metric([c.job_id, "committed"], c.newest_committed)
        if c.floor >= 0:
            newest.add_metric([c.job_id, "floor"], c.floor)
    failures = _gauge("spill_consecutive_failures", "Spill passes of a job that failed in a row (0 after a good one).", labels=["job_id"])
    age = _gauge("spill_age_seconds", "Seconds since this store last spilled a step of the job (absent until its first spill).",
                 labels=["job_id"])  # fmt: skip
    written = CounterMetricFamily(PREFIX + "spill_written_bytes", "Bytes this store spilled of the job.", labels=["job_id"])
    for job, st in sorted(s.spill.items()):
        shards.add_metric([job, "durable"], st.listed_shards)
        steps.add_metric([job, "durable"], st.listed_steps)
        if st.last_spilled_step >= 0:
            newest.add_metric([job, "spilled"], st.last_spilled_step)
        failures.add_metric([job], st.consecutive_failures)
        if st.last_spill_time is not None:
            age.add_metric([job], max(0.0, s.now - st.last_spill_time))
        written.add_metric([job], st.bytes_written)
    out += [job_bytes, shards, steps, newest, failures, age, written]

    slots = h.slots.slots
    discovery = h.discovery
    out += [
        _gauge("slots", "Slots of the cluster's placement (this store's slot table).", len(slots)),
        _gauge("slots_vacant", "Slots whose host is gone and that no host has taken over yet.", sum(1 for x in slots if not x.host_id)),
        _gauge("holds_slot", "1 if this store holds a slot of the placement.", 1 if any(x.host_id == h.host_id for x in slots) else 0),
        _gauge("membership_version", "Version of this store's slot table (goes up with every membership change).", h.slots.version),
        _gauge("members", "Members the discovery source listed in its last good answer.", discovery.members if discovery else 0),
        _gauge(
            "discovery_consecutive_failures",
            "Polls of the discovery source that failed in a row (the last good membership stays meanwhile).",
            discovery.consecutive_failures if discovery else 0,
        ),
        _gauge("draining", "1 while the store drains (leaves the cluster on purpose).", 1 if h.draining else 0),
        _gauge(
            "ready", "1 when the store is ready for saves (its readiness probe; memstore status says why not).", 0 if h.not_ready else 1
        ),
    ]
    return out


class StoreCollector:
    """Reads one store's state at every scrape (``registry.register(StoreCollector(store))``)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        yield from state_families(snapshot_of(self.store))


class StoreMetrics(StoreEvents):
    """The registry of one store: its event series (the hooks below) and, once :meth:`watch` is called, its state."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_cpu_seconds_total, ...
        PlatformCollector(registry=r)  # python_info
        self.save_seconds = Histogram(
            PREFIX + "save_seconds",
            "A client's save as the store sees it: Allocate to Commit (path=shm: the trainer's copy into shared "
            "memory), or the transfer's header to its last verified chunk (path=stream).",
            ["path"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.replication_seconds = Histogram(
            PREFIX + "replication_seconds",
            "From the store taking an owned shard in (Commit, or a client stream's end) to the last group peer's ack.",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.replicated_bytes = Counter(
            PREFIX + "replicated_bytes", "Bytes of owned shards group peers acknowledged (one count per peer copy).", registry=r
        )
        self.settled_shards = Counter(
            PREFIX + "settled_shards", "Owned shards whose replication ended, by the state it left them in.", ["state"], registry=r
        )
        self.fetch_seconds = Histogram(
            PREFIX + "fetch_seconds",
            "Fetch (a restore asks the store for a verified copy), by where the copy came from.",
            ["source"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.repair_seconds = Histogram(
            PREFIX + "repair_seconds", "One missing shard pulled back by the repair loop, by source.",
            ["source"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.pulled_bytes = Counter(
            PREFIX + "pulled_bytes", "Bytes of copies pulled in (fetches and repairs), by source.", ["source"], registry=r
        )
        self.spill_seconds = Histogram(
            PREFIX + "spill_seconds", "Writing one shard and its manifest to durable storage.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.rpcs = Counter(PREFIX + "rpcs", "gRPC calls served, by method.", ["method"], registry=r)
        self.rpc_errors = Counter(PREFIX + "rpc_errors", "gRPC calls failed, by method and status code.", ["method", "code"], registry=r)
        for path in SAVE_PATHS:  # the fixed label values exist from the start: rate() sees the first event
            self.save_seconds.labels(path)
        for state in SETTLED:
            self.settled_shards.labels(state)
        for source in FETCH_SOURCES:
            self.fetch_seconds.labels(source)
        for source in PULL_SOURCES:
            self.repair_seconds.labels(source)
            self.pulled_bytes.labels(source)

    def watch(self, store: Store) -> None:
        """Export ``store``'s state too (once: call it when the store exists)."""
        self.registry.register(StoreCollector(store))  # type: ignore[arg-type]

    def serve(self, host: str, port: int) -> MetricsServer:
        """Serve /metrics on ``host``:``port`` (a thread of its own); a port that cannot be bound is a ConfigError."""
        return MetricsServer(self.registry, host, port)

    # -- StoreEvents ------------------------------------------------------------------------------
    def saved(self, path: str, seconds: float) -> None:
        self.save_seconds.labels(path).observe(seconds)

    def pushed(self, nbytes: int) -> None:
        self.replicated_bytes.inc(nbytes)

    def replicated(self, seconds: float) -> None:
        self.replication_seconds.observe(seconds)

    def settled(self, state: str) -> None:
        self.settled_shards.labels(state).inc()

    def fetched(self, source: str, seconds: float) -> None:
        self.fetch_seconds.labels(source).observe(seconds)

    def repaired(self, source: str, seconds: float) -> None:
        self.repair_seconds.labels(source).observe(seconds)

    def pulled(self, source: str, nbytes: int) -> None:
        self.pulled_bytes.labels(source).inc(nbytes)

    def shard_spilled(self, job_id: str, seconds: float, nbytes: int) -> None:
        self.spill_seconds.observe(seconds)

    def rpc(self, method: str) -> None:
        self.rpcs.labels(method).inc()

    def rpc_failed(self, method: str, code: str) -> None:
        self.rpc_errors.labels(method, code).inc()


class MetricsServer:
    """The HTTP server of /metrics (prometheus_client's), stoppable. ``port`` is the bound one."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        bind = host.strip("[]") or "0.0.0.0"
        try:
            self._httpd, self._thread = start_http_server(port, addr=bind, registry=registry)
        except OSError as exc:
            raise ConfigError(f"--metrics-port {port}: cannot serve metrics on {host}:{port} ({exc.strerror or exc})") from None
        self.port: int = self._httpd.server_port
        self.address = f"{host}:{self.port}"
        log.info("Prometheus metrics on http://%s/metrics", self.address)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if isinstance(self._thread, threading.Thread):
            self._thread.join(timeout=5)
