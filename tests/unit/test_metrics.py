"""The store's Prometheus metrics in-process: the state series from a snapshot, the event hooks, the repair pass's
under-replication count, the census, the /metrics server (and a port in use), over a real engine too."""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from memstore.config import StoreConfig
from memstore.core.model import Manifest, ShardInfo, ShardKey, ShardState
from memstore.core.slots import Slot, SlotTable
from memstore.core.status import DiscoveryReport, HealthReport, JobCensus, Orphan, job_census
from memstore.errors import ConfigError, PeerUnavailable, StoreError
from memstore.server.engine.recovery import count_under_replicated
from memstore.server.metrics import Snapshot, StoreMetrics, state_families
from memstore.server.store import Store
from memstore.spill.port import JobSpillStatus

pytestmark = pytest.mark.unit

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str) -> Samples:
    """name + labels -> value of every sample of a scrape."""
    return {(s.name, frozenset(s.labels.items())): s.value for family in text_string_to_metric_families(text) for s in family.samples}


def value(found: Samples, name: str, **labels: str) -> float | None:
    return found.get((name, frozenset(labels.items())))


class Fixed:
    """A collector of fixed families (state_families of one snapshot)."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot

    def collect(self):  # type: ignore[no-untyped-def]
        return state_families(self.snapshot)


def scrape(snapshot: Snapshot) -> str:
    registry = CollectorRegistry()
    registry.register(Fixed(snapshot))  # type: ignore[arg-type]
    return generate_latest(registry).decode()


def health(**changes: object) -> HealthReport:
    base: dict[str, object] = dict(
        serving=True, host_id="h0", used_bytes=300, capacity_bytes=1000, shards=3, replications_in_flight=1, repairs_in_flight=2,
        uptime_seconds=5.0, spill_url="", spill=(), orphans=(Orphan("/dev/shm/x", "hx", 64, 2),), adopted_shards=4,
        slots=SlotTable(7, (Slot(0, "h0", "a:1"), Slot(1, "", ""), Slot(2, "h2", "c:1"))),
        discovery=DiscoveryReport("peers-file x", 2, 1.0, "boom", 3),
    )  # fmt: skip
    base.update(changes)
    return HealthReport(**base)  # type: ignore[arg-type]


def snapshot(**changes: object) -> Snapshot:
    base: dict[str, object] = dict(
        health=health(), census=[], spill={}, under_replicated=0, retention_listings=0, unreachable_sources=(), replicas=2,
        placement="mixed", address="127.0.0.1:7070", now=1000.0,
    )  # fmt: skip
    base.update(changes)
    return Snapshot(**base)  # type: ignore[arg-type]


def test_state_series_of_a_snapshot() -> None:
    spill = {
        "a": JobSpillStatus(last_spilled_step=8, last_spill_time=940.0, consecutive_failures=2, bytes_written=77, listed_steps=2,
                            listed_shards=6),
        "never": JobSpillStatus(consecutive_failures=5),
    }  # fmt: skip
    census = [JobCensus("a", 1234, 3, 2, 10, floor=9), JobCensus("inflight", 9, 1, 1, -1)]
    found = samples(scrape(snapshot(census=census, spill=spill, under_replicated=2, retention_listings=5, unreachable_sources=("h1",))))
    assert value(found, "memstore_capacity_bytes") == 1000
    assert value(found, "memstore_used_bytes") == 300
    assert value(found, "memstore_replication_factor") == 2
    assert value(found, "memstore_replications_in_flight") == 1
    assert value(found, "memstore_repairs_in_flight") == 2
    assert value(found, "memstore_under_replicated_shards") == 2
    assert value(found, "memstore_peers_unreachable") == 1
    assert value(found, "memstore_adopted_shards") == 4
    assert value(found, "memstore_orphaned_shm_bytes") == 64
    assert value(found, "memstore_info", host_id="h0", version=__import__("memstore").__version__, placement="mixed",
                 address="127.0.0.1:7070") == 1  # fmt: skip
    # per job, RAM from the census
    assert value(found, "memstore_job_bytes", job_id="a") == 1234
    assert value(found, "memstore_shards", job_id="a", tier="ram") == 3
    assert value(found, "memstore_steps", job_id="a", tier="ram") == 2
    assert value(found, "memstore_newest_step", job_id="a", kind="committed") == 10
    assert value(found, "memstore_newest_step", job_id="inflight", kind="committed") is None, "no committed copy: no sample"
    assert value(found, "memstore_newest_step", job_id="a", kind="floor") == 9  # the ranks' restorable floor
    assert value(found, "memstore_newest_step", job_id="inflight", kind="floor") is None
    assert value(found, "memstore_retention_listings_total") == 5
    # per job, durable from the spill tier's status (what it listed last)
    assert value(found, "memstore_shards", job_id="a", tier="durable") == 6
    assert value(found, "memstore_steps", job_id="a", tier="durable") == 2
    assert value(found, "memstore_newest_step", job_id="a", kind="spilled") == 8
    assert value(found, "memstore_spill_age_seconds", job_id="a") == 60.0
    assert value(found, "memstore_spill_consecutive_failures", job_id="a") == 2
    assert value(found, "memstore_spill_written_bytes_total", job_id="a") == 77
    assert value(found, "memstore_spill_consecutive_failures", job_id="never") == 5
    assert value(found, "memstore_spill_age_seconds", job_id="never") is None, "never spilled: no age"
    assert value(found, "memstore_newest_step", job_id="never", kind="spilled") is None
    # membership
    assert value(found, "memstore_slots") == 3
    assert value(found, "memstore_slots_vacant") == 1
    assert value(found, "memstore_holds_slot") == 1
    assert value(found, "memstore_membership_version") == 7
    assert value(found, "memstore_members") == 2
    assert value(found, "memstore_discovery_consecutive_failures") == 3
    assert value(found, "memstore_ready") == 1
    assert value(found, "memstore_draining") == 0


def test_not_ready_draining_and_no_slot() -> None:
    found = samples(scrape(snapshot(health=health(not_ready="draining", draining=True, slots=SlotTable(), discovery=None))))
    assert value(found, "memstore_ready") == 0
    assert value(found, "memstore_draining") == 1
    assert value(found, "memstore_holds_slot") == 0
    assert value(found, "memstore_slots") == 0
    assert value(found, "memstore_members") == 0


def test_every_family_is_named_even_without_samples() -> None:
    names = {f.name for f in text_string_to_metric_families(scrape(snapshot()))}
    for name in ("job_bytes", "shards", "steps", "newest_step", "spill_age_seconds", "spill_consecutive_failures", "spill_written_bytes"):
        assert f"memstore_{name}" in names


def test_event_hooks_count_and_time() -> None:
    m = StoreMetrics()
    m.saved("shm", 0.002)
    m.saved("stream", 0.5)
    m.pushed(100)
    m.pushed(50)
    m.replicated(0.03)
    m.settled("committed")
    m.settled("under_replicated")
    m.fetched("peer", 0.2)
    m.repaired("durable", 1.5)
    m.pulled("durable", 64)
    m.shard_spilled("a", 0.7, 999)
    m.rpc("Allocate")
    m.rpc("Allocate")
    m.rpc_failed("Allocate", "INVALID_ARGUMENT")
    found = samples(generate_latest(m.registry).decode())
    assert value(found, "memstore_save_seconds_count", path="shm") == 1
    assert value(found, "memstore_save_seconds_count", path="stream") == 1
    assert value(found, "memstore_replicated_bytes_total") == 150
    assert value(found, "memstore_replication_seconds_count") == 1
    assert value(found, "memstore_replication_seconds_sum") == pytest.approx(0.03)
    assert value(found, "memstore_settled_shards_total", state="committed") == 1
    assert value(found, "memstore_settled_shards_total", state="under_replicated") == 1
    assert value(found, "memstore_fetch_seconds_count", source="peer") == 1
    assert value(found, "memstore_fetch_seconds_count", source="local") == 0, "fixed label values exist from the start"
    assert value(found, "memstore_repair_seconds_count", source="durable") == 1
    assert value(found, "memstore_pulled_bytes_total", source="durable") == 64
    assert value(found, "memstore_pulled_bytes_total", source="peer") == 0
    assert value(found, "memstore_spill_seconds_count") == 1
    assert value(found, "memstore_rpcs_total", method="Allocate") == 2
    assert value(found, "memstore_rpc_errors_total", method="Allocate", code="INVALID_ARGUMENT") == 1
    assert value(found, "process_resident_memory_bytes") is not None, "the store's process, from the same registry"


def test_two_stores_in_one_process_do_not_collide() -> None:
    a, b = StoreMetrics(), StoreMetrics()
    a.rpc("Hello")
    assert value(samples(generate_latest(b.registry).decode()), "memstore_rpcs_total", method="Hello") is None
    assert value(samples(generate_latest(a.registry).decode()), "memstore_rpcs_total", method="Hello") == 1


def test_job_census() -> None:
    k = ShardKey
    copies = [
        (k("a", 1, 0), 10, ShardState.COMMITTED),
        (k("a", 1, 1), 10, ShardState.REPLICA),
        (k("a", 2, 0), 10, ShardState.REPLICATING),
        (k("a", 2, 1), 5, ShardState.UNDER_REPLICATED),
        (k("b", 7, 0), 3, ShardState.CAPTURED),
    ]
    assert job_census(copies) == [JobCensus("a", 35, 4, 2, 1), JobCensus("b", 3, 1, 1, -1)]


# -- under-replication as the repair pass counts it --------------------------------------------------------------------
def info(job: str, step: int, rank: int, owner: str, state: ShardState = ShardState.COMMITTED, created: float = 0.0) -> ShardInfo:
    m = Manifest(ShardKey(job, step, rank), 1, 10, 10, (1,), owner, created_unix=created or float(step))
    return ShardInfo(m, state, state is not ShardState.CAPTURED)


SLOT_OF = {"h0": "s0", "h1": "s1", "h2": "s2"}.__getitem__
OWNERS = {"s0", "s1"}  # h0's group: slots 0 and 1


def count(listings: dict[str, list[ShardInfo] | StoreError], here: list[ShardInfo], keep: int = 2, replicas: int = 2) -> int:
    mine = [(i.manifest.key, i.manifest.owner_host, i.manifest.created_unix, bool(i.state and i.state.settled)) for i in here]
    return count_under_replicated(listings, mine, SLOT_OF, OWNERS, "h0", replicas, keep)


def test_every_copy_reachable_is_not_under_replicated() -> None:
    here = [info("j", 1, 0, "h0"), info("j", 1, 1, "h1", ShardState.REPLICA)]
    peer = [info("j", 1, 0, "h0", ShardState.REPLICA), info("j", 1, 1, "h1")]
    assert count({"h1": peer}, here) == 0


def test_a_peer_down_leaves_the_groups_recent_shards_under_replicated() -> None:
    here = [info("j", 1, 0, "h0"), info("j", 1, 1, "h1", ShardState.REPLICA), info("j", 2, 0, "h0")]
    assert count({"h1": PeerUnavailable("down")}, here) == 3


def test_only_recent_versions_of_this_slots_shards_count() -> None:
    here = [info("j", s, 0, "h0") for s in (1, 2, 3)] + [info("j", 3, 0, "h2", ShardState.REPLICA)]  # h2: another group
    assert count({"h1": []}, here, keep=2) == 2, "steps 2 and 3 of slot 0; step 1 is past keep, h2's copy is not this group's"


def test_a_copy_only_a_peer_holds_is_under_replicated_until_repair_pulls_it() -> None:
    assert count({"h1": [info("j", 5, 1, "h1")]}, []) == 1


def test_a_save_still_replicating_is_not_under_replicated_yet() -> None:
    assert count({"h1": []}, [info("j", 4, 0, "h0", ShardState.REPLICATING)]) == 0
    # the owner still replicating, the peer's copy registered: two verified copies
    assert count({"h1": [info("j", 4, 0, "h0", ShardState.REPLICA)]}, [info("j", 4, 0, "h0", ShardState.REPLICATING)]) == 0


def test_a_cached_copy_is_not_one_of_the_r() -> None:
    cached = ShardInfo(info("j", 6, 0, "h0", ShardState.REPLICA).manifest, ShardState.REPLICA, True, cached=True)
    assert count({"h1": [cached]}, [info("j", 6, 0, "h0")]) == 1  # pulled ahead of a restore: it may go at any time


# -- the /metrics server and a real engine ------------------------------------------------------------------------------
@pytest.fixture
def store(tmp_path) -> Iterator[Store]:  # type: ignore[no-untyped-def]
    config = StoreConfig.load(
        {"host_id": "solo", "replicas": "1", "capacity": "10MiB", "shm_dir": str(tmp_path / "shm"), "chunk_bytes": "1MiB",
         "peers": "solo=127.0.0.1:7070"},
        env={},
    )  # fmt: skip
    metrics = StoreMetrics()
    s = Store(config, events=metrics)
    metrics.watch(s)
    s.start()
    yield s
    s.close()


def test_metrics_of_a_real_engine_over_http(store: Store) -> None:
    metrics = store.events
    assert isinstance(metrics, StoreMetrics)
    key = ShardKey("job", 3, 0)
    lease, seg = store.allocate(key, 1, 4096)
    seg.view(4096)[:] = b"x" * 4096
    store.commit(lease, {}, 1)
    _, done = store.wait_committed(key, 5)
    assert done
    server = metrics.serve("127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as response:
            found = samples(response.read().decode())
    finally:
        server.close()
    assert value(found, "memstore_job_bytes", job_id="job") == 4096
    assert value(found, "memstore_shards", job_id="job", tier="ram") == 1
    assert value(found, "memstore_newest_step", job_id="job", kind="committed") == 3
    assert value(found, "memstore_save_seconds_count", path="shm") == 1
    assert value(found, "memstore_settled_shards_total", state="committed") == 1
    assert value(found, "memstore_replication_seconds_count") == 0, "R=1: nothing to replicate"
    assert value(found, "memstore_capacity_bytes") == 10 << 20
    assert value(found, "memstore_holds_slot") == 1


def test_a_metrics_port_in_use_is_a_config_error_naming_the_flag() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"--metrics-port {port}"):
            StoreMetrics().serve("127.0.0.1", port)
