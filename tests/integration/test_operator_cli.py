"""`memstore status`, `ls`, `inspect` and `delete` against a live local cluster, as tables and as --json; JSON logs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from memstore.testing import LocalCluster, wait_for
from tests.states import rank_state
from trainer_client import CheckpointClient
from trainer_client.errors import MemstoreClientError

pytestmark = pytest.mark.integration

JOB, WORLD = "ops-job", 3


def memstore(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memstore", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})  # fmt: skip


def as_json(*args: str) -> Any:
    proc = memstore(*args, "--json")
    assert proc.stdout, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture
def cluster(make_cluster, tmp_path: Path) -> LocalCluster:
    spill = f"file://{tmp_path / 'durable'}"
    args = ["--log-format", "json", "--spill", spill, "--spill-every-steps", "2", "--repair-interval", "0.3"]
    c: LocalCluster = make_cluster(hosts=3, replicas=2, capacity="64MiB", extra_args=args)
    for rank in range(WORLD):
        with CheckpointClient(JOB, rank, WORLD, store=c.address(f"h{rank}"), timeout=20, run_id="run") as client:
            for step in (1, 2):
                assert client.save(step, rank_state(rank, step)).wait(timeout=30).copies == 2
    return c


def test_status_ls_inspect_tables_and_json(cluster: LocalCluster) -> None:
    store = cluster.address("h0")
    wait_for(lambda: as_json("status", "--store", store)["jobs"][0]["newest_spilled"] == 2, timeout=30, what="step 2 spilled")
    status = as_json("status", "--store", store)
    assert [(h["host"], h["slot"], h["ready"]) for h in status["hosts"]] == [("h0", 0, True), ("h1", 1, True), ("h2", 2, True)]
    assert all(h["used"] > 0 and h["capacity"] == 64 << 20 for h in status["hosts"])
    assert all(0 <= h["reserve"] <= h["pooled"] <= h["used"] for h in status["hosts"])
    (job,) = status["jobs"]
    assert (job["job"], job["newest_committed"], job["newest_restorable"], job["newest_spilled"], job["steps_in_ram"]) == (JOB, 2, 2, 2, 2)
    table = memstore("status", env={"MEMSTORE_STORE": store})  # no --store: MEMSTORE_STORE
    assert table.returncode == 0, table.stderr
    assert "cluster: 3 hosts in 3 slots" in table.stdout and table.stdout.count("ready") >= 3 and JOB in table.stdout

    steps = as_json("ls", "--store", store, "--job", JOB)["jobs"][JOB]
    assert [(s["step"], s["ranks"], s["min_copies"], s["restorable"]) for s in steps] == [(2, "3/3", 2, True), (1, "3/3", 2, False)]
    assert steps[0]["tiers"] == ["ram", "durable"] and steps[1]["tiers"] == ["ram"]
    ls = memstore("ls", "--store", store, "--job", JOB)
    assert ls.returncode == 0 and "2/2" in ls.stdout and "ram, durable" in ls.stdout, ls.stdout + ls.stderr

    ranks = as_json("inspect", "--store", store, "--job", JOB, "--step", "2")["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    for r in ranks:
        assert r["consistent"] and len(r["copies"]) == 2 and r["checksum"].startswith("xxh3_64:")
        assert {c["state"] for c in r["copies"]} == {"committed", "replica"} and r["owner"] == f"h{r['rank']}"
    assert as_json("inspect", "--store", store, "--job", JOB)["step"] == 2  # default: the newest restorable step
    text = memstore("inspect", "--store", store, "--job", JOB, "--step", "2").stdout
    assert all(r["checksum"] in text for r in ranks)
    missing = memstore("inspect", "--store", store, "--job", JOB, "--step", "9")
    assert missing.returncode == 1 and "no store holds step 9" in missing.stderr


def test_a_lost_host_shows_and_delete_empties_ram(cluster: LocalCluster) -> None:
    store = cluster.address("h0")
    cluster.kill("h2")
    down = memstore("status", "--store", store)
    assert down.returncode == 1 and "DOWN (UNAVAILABLE)" in down.stdout, down.stdout
    doc = as_json("status", "--store", store)
    assert next(h for h in doc["hosts"] if h["host"] == "h2")["error"] == "UNAVAILABLE"
    assert "h2" in as_json("ls", "--store", store, "--job", JOB)["unreachable_hosts"]

    refused = memstore("delete", "--store", store, "--job", JOB, "--step", "1")  # no terminal, no --yes
    assert refused.returncode == 2 and "--yes" in refused.stderr
    deleted = memstore("delete", "--store", store, "--job", JOB, "--step", "1", "--yes", "--json")
    doc = json.loads(deleted.stdout)
    assert deleted.returncode == 1 and isinstance(doc["deleted"]["h2"], str)  # h2 is down: said, not hidden
    assert doc["deleted"]["h0"] + doc["deleted"]["h1"] >= 3  # at least one copy of each rank of step 1
    assert [s["step"] for s in as_json("ls", "--store", store, "--job", JOB)["jobs"][JOB]] == [2]


def test_json_logs_carry_host_and_shard_fields(cluster: LocalCluster) -> None:
    cluster.kill("h2")
    with CheckpointClient(JOB, 1, WORLD, store=cluster.address("h1"), timeout=20, run_id="run2") as c:
        handle = c.save(3, rank_state(1, 3))  # h1 replicates to h2, which is gone: h1 logs the shard under-replicated
        with pytest.raises(MemstoreClientError):
            handle.wait(timeout=30)

    def records() -> list[dict[str, Any]]:
        lines = [ln for h in ("h0", "h1") for ln in cluster.log_tail(h, 400).splitlines() if ln.startswith("{")]
        return [json.loads(ln) for ln in lines]

    wait_for(lambda: any("job" in r for r in records()), timeout=30, what="a log line about a shard")
    docs = records()
    assert docs and all({"time", "level", "logger", "message", "host"} <= set(r) for r in docs)
    assert {r["host"] for r in docs} <= {"h0", "h1"}
    about = next(r for r in docs if "job" in r)
    assert (about["job"], about["step"], about["rank"], about["host"]) == (JOB, 3, 1, "h1"), about
