"""--metrics-port against real store processes: the series move with a save, a spill, a refused call, a lost host
and a restore from the survivors; the monitoring files reference only series a live store exports; a port in use
stops `memstore serve` with status 2."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from memstore.children import child_env
from memstore.testing import LocalCluster, free_ports, wait_for
from memstore.v1 import store_pb2 as pb
from memstore.v1.channel import store_stub
from tests.states import assert_same, rank_state
from trainer_client import CheckpointClient

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
JOB = "metrics-job"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape_text(cluster: LocalCluster, host: str) -> str:
    with urllib.request.urlopen(cluster.metrics_url(host), timeout=5) as response:
        assert response.status == 200
        return str(response.read().decode())


def scrape(cluster: LocalCluster, host: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(scrape_text(cluster, host))
        for s in family.samples
    }


def scrape_until(cluster: LocalCluster, host: str, ok: Callable[[Samples], bool], what: str, timeout: float = 15) -> Samples:
    """Scrape ``host`` until ``ok(samples)``; returns that scrape."""

    def attempt() -> Samples | None:
        found = scrape(cluster, host)
        return found if ok(found) else None

    result: Samples = wait_for(attempt, timeout=timeout, what=what)
    return result


def value(found: Samples, name: str, **labels: str) -> float:
    """The sample's value; 0 when it is absent (a counter or gauge not exported yet)."""
    return found.get((name, frozenset(labels.items())), 0.0)


def total(found: Samples, name: str, **labels: str) -> float:
    """Sum over every sample of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in found.items() if n == name and want <= ls)


def test_series_follow_a_save_a_spill_a_refused_call_a_lost_host_and_a_restore(make_inprocess_cluster, tmp_path: Path) -> None:
    spill = tmp_path / "spill"
    # 4 hosts, R=2: groups {h0, h1} and {h2, h3}. The trainer saves through h0; h2 restores after h0 is lost.
    cluster: LocalCluster = make_inprocess_cluster(
        hosts=4, replicas=2, capacity="64MiB", metrics=True, extra_args=["--spill", f"file://{spill}", "--spill-every-steps", "1"]
    )
    # ready once a first repair pass has confirmed the slot (serving comes a moment earlier)
    before = {h: scrape_until(cluster, h, lambda s: value(s, "memstore_ready") == 1, f"{h} ready") for h in ("h0", "h1", "h2")}
    assert value(before["h0"], "memstore_job_bytes", job_id=JOB) == 0
    assert value(before["h0"], "memstore_slots") == 4
    assert value(before["h0"], "memstore_slots_vacant") == 0
    assert value(before["h0"], "memstore_members") == 4
    assert value(before["h0"], "memstore_capacity_bytes") == 64 << 20

    # -- a save: bytes and shards held, a save timed, replication counted and timed ------------------------------
    state = rank_state(0, 1)
    with CheckpointClient(JOB, 0, 1, store=cluster.address("h0")) as client:
        client.save(1, state).wait(timeout=30)
    h0 = scrape(cluster, "h0")
    assert value(h0, "memstore_job_bytes", job_id=JOB) > 0
    assert value(h0, "memstore_shards", job_id=JOB, tier="ram") == 1
    assert value(h0, "memstore_steps", job_id=JOB, tier="ram") == 1
    assert value(h0, "memstore_newest_step", job_id=JOB, kind="committed") == 1
    assert total(h0, "memstore_save_seconds_count") == total(before["h0"], "memstore_save_seconds_count") + 1
    assert value(h0, "memstore_replicated_bytes_total") > value(before["h0"], "memstore_replicated_bytes_total")
    assert value(h0, "memstore_replication_seconds_count") == value(before["h0"], "memstore_replication_seconds_count") + 1
    assert value(h0, "memstore_settled_shards_total", state="committed") == 1
    assert value(h0, "memstore_rpcs_total", method="Allocate") >= 1
    assert value(h0, "memstore_rpcs_total", method="Commit") >= 1
    h1 = scrape(cluster, "h1")
    assert value(h1, "memstore_shards", job_id=JOB, tier="ram") == 1, "h0's group peer holds the replica"
    assert value(h1, "memstore_job_bytes", job_id=JOB) == value(h0, "memstore_job_bytes", job_id=JOB)

    # -- the spill (--spill-every-steps 1): the spilled step, its age, the durable tier's counts --------------------
    # The spilled step is read from the durable tier, where its manifest is published before the spill's timing is
    # recorded: wait for both (a scrape in between saw the step spilled and no spill timed yet).
    h0 = scrape_until(
        cluster,
        "h0",
        lambda s: value(s, "memstore_newest_step", job_id=JOB, kind="spilled") == 1 and value(s, "memstore_spill_seconds_count") >= 1,
        "step 1 spilled",
    )
    assert (("memstore_spill_age_seconds", frozenset({("job_id", JOB)}))) in h0
    assert 0 <= value(h0, "memstore_spill_age_seconds", job_id=JOB) < 60
    assert value(h0, "memstore_spill_seconds_count") >= 1
    assert value(h0, "memstore_spill_written_bytes_total", job_id=JOB) > 0
    assert value(h0, "memstore_spill_consecutive_failures", job_id=JOB) == 0
    h0 = scrape_until(cluster, "h0", lambda s: value(s, "memstore_shards", job_id=JOB, tier="durable") == 1, "the durable listing")
    assert value(h0, "memstore_steps", job_id=JOB, tier="durable") == 1

    # -- a refused call: counted by method and status code ----------------------------------------------------------
    errors_before = value(h0, "memstore_rpc_errors_total", method="Allocate", code="INVALID_ARGUMENT")
    channel, stub = store_stub(cluster.address("h0"))
    with channel, pytest.raises(grpc.RpcError) as refused:
        stub.Allocate(pb.AllocateRequest(key=pb.ShardKey(job_id="../escape", step=1, rank=0), world_size=1, nbytes=10), timeout=5)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    h0 = scrape(cluster, "h0")
    assert value(h0, "memstore_rpc_errors_total", method="Allocate", code="INVALID_ARGUMENT") == errors_before + 1

    # -- h0 lost: its group peer sees it unreachable and the group's shard under-replicated -------------------------
    cluster.kill("h0")
    h1 = scrape_until(cluster, "h1", lambda s: value(s, "memstore_under_replicated_shards") >= 1, "h1 to count h0's shard under-replicated")
    assert value(h1, "memstore_peers_unreachable") == 1
    assert value(h1, "memstore_ready") == 1, "a peer down does not make the survivor unready"

    # -- a restore from the survivors: h2 fetches the shard (from h1's RAM, or the durable tier) ---------------------
    h2_before = scrape(cluster, "h2")
    with CheckpointClient(JOB, 0, 1, store=cluster.address("h2")) as client:
        assert client.latest_step() == 1
        assert_same(client.load(), state)
    h2 = scrape(cluster, "h2")
    fetched = {src: value(h2, "memstore_fetch_seconds_count", source=src) for src in ("local", "peer", "durable")}
    assert fetched["peer"] + fetched["durable"] == 1, f"one fetch pulled from elsewhere: {fetched}"
    assert total(h2, "memstore_pulled_bytes_total") > total(h2_before, "memstore_pulled_bytes_total")
    assert value(h2, "memstore_job_bytes", job_id=JOB) == value(h1, "memstore_job_bytes", job_id=JOB)
    assert value(h2, "memstore_rpcs_total", method="Fetch") == value(h2_before, "memstore_rpcs_total", method="Fetch") + 1


# -- the monitoring files ----------------------------------------------------------------------------------------------
METRIC = re.compile(r"\bmemstore_[a-zA-Z0-9_]+\b")
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"), "gauge": ("",)}


def exported_names(text: str) -> set[str]:
    """Every series name a scrape offers, samples or not: a family with no sample yet (no job held) still has its
    HELP and TYPE; counters and histograms are queried by their suffixed names."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names |= {s.name for s in family.samples}
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
    return names


def alert_rules() -> list[dict[str, object]]:
    doc = yaml.safe_load((ROOT / "monitoring" / "alerts.yaml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    doc = json.loads((ROOT / "monitoring" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in doc["panels"] for t in panel.get("targets", [])]
    exprs += [v["query"] for v in doc["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_monitoring_files_parse_and_reference_only_exported_series(make_inprocess_cluster) -> None:
    rules = alert_rules()
    names = {r["alert"] for r in rules}
    expected = {"MemstoreDown", "MemstoreUnderReplicated", "MemstoreSpillStale", "MemstoreMemoryHigh", "MemstoreSlotVacant",
                "MemstoreNotReady", "MemstoreDiscoveryFailing"}  # fmt: skip
    assert expected <= names, f"missing alerts: {expected - names}"
    docs = (ROOT / "docs" / "metrics.md").read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", line.lstrip("#").strip().lower()).replace(" ", "-") for line in docs.splitlines()
               if line.startswith("#")}  # fmt: skip
    for rule in rules:
        assert rule.get("expr") and rule.get("for") and rule.get("labels", {}).get("severity"), rule  # type: ignore[union-attr]
        runbook = str(rule["annotations"]["runbook_url"])  # type: ignore[index]
        assert runbook.startswith("docs/metrics.md#") and runbook.partition("#")[2] in anchors, f"{rule['alert']}: {runbook}"
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    used = {m for e in [str(r["expr"]) for r in rules] + exprs for m in METRIC.findall(e)}

    cluster: LocalCluster = make_inprocess_cluster(hosts=1, replicas=1, capacity="16MiB", metrics=True)
    exported = exported_names(scrape_text(cluster, "h0"))
    assert used, "the files reference memstore series"
    assert used <= exported, f"referenced but not exported: {sorted(used - exported)}"


def test_a_metrics_port_in_use_stops_serve_with_status_2_naming_the_flag(tmp_path: Path) -> None:
    (listen,) = free_ports(1)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "memstore", "serve", "--host-id", "m0", "--listen", f"127.0.0.1:{listen}", "--replicas", "1",
             "--shm-dir", str(tmp_path / "shm"), "--metrics-port", str(port)],
            capture_output=True, text=True, timeout=60, env={**os.environ, **child_env()},
        )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"--metrics-port {port}" in done.stderr
