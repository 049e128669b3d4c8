"""The memstore CLI as users run it: serve, local-cluster, status, ls."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from memstore.testing import free_ports, wait_for
from tests.states import rank_state
from trainer_client import CheckpointClient

pytestmark = pytest.mark.integration

FIVE = ",".join(f"h{i}=127.0.0.1:{7070 + i}" for i in range(5))


def memstore(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memstore", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--host-id", "h0", "--capacity", "lots"], "--capacity"),
        (["--host-id", "h0", "--peers", "h1=127.0.0.1:1"], "missing"),
        (["--host-id", "h0", "--replicas", "3"], "larger than the number of hosts"),
        (["--host-id", "h/0"], "--host-id"),
        (["--host-id", "h0", "--replicas", "1", "--listen", "127.0.0.1:99999"], "--listen"),
        (["--host-id", "h0", "--replicas", "1", "--failure-domains", "h9=rack1"], "failure-domain labels"),
        (["--host-id", "h0", "--peers", FIVE, "--redundancy", "ec:4+1", "--replicas", "3"], "--replicas 3 and --redundancy ec:4+1"),
        (["--host-id", "h0", "--redundancy", "ec:4+1"], "--redundancy ec:4+1 needs at least 5 hosts (K+M), but --peers lists 1"),
        (["--host-id", "h0", "--redundancy", "ec:4"], "--redundancy 'ec:4' is invalid"),
    ],
)
def test_serve_rejects_bad_flags(args: list[str], message: str) -> None:
    proc = memstore("serve", *args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr


def test_local_cluster_endpoints_status_ls_and_clean_stop(tmp_path) -> None:  # type: ignore[no-untyped-def]
    endpoints = tmp_path / "endpoints.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "memstore", "local-cluster", "--hosts", "3", "--redundancy", "replicas:2", "--capacity", "64MiB",
         "--endpoints-file", str(endpoints), "--metrics"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        wait_for(endpoints.exists, timeout=60, what="endpoints file")
        hosts = json.loads(endpoints.read_text())["hosts"]
        assert proc.stdout is not None
        printed = json.loads(proc.stdout.readline())  # the endpoints, and with --metrics every store's /metrics URL
        assert printed["hosts"] == hosts and sorted(printed["metrics"]) == ["h0", "h1", "h2"]
        assert sorted(hosts) == ["h0", "h1", "h2"] and all(a.startswith("127.0.0.1:") for a in hosts.values())
        with CheckpointClient("cli-job", 0, 1, store=hosts["h2"]) as c:
            c.save(4, rank_state(0, 4)).wait(timeout=30)
        # Exit 0 once every store is ready: a store that just started is not until its first clean repair pass.
        answers = []
        wait_for(lambda: answers.append(memstore("status", "--store", hosts["h0"], "--json")) or answers[-1].returncode == 0,
                 timeout=30, what="status to report every store ready")  # fmt: skip
        status = answers[-1]
        assert all(h["ready"] for h in json.loads(status.stdout)["hosts"])
        assert {h["host"] for h in json.loads(status.stdout)["hosts"] if h["serving"]} == {"h0", "h1", "h2"}
        assert (json.loads(status.stdout)["redundancy"], json.loads(status.stdout)["replicas"]) == ("replicas:2", 2)
        assert "redundancy=replicas:2" in memstore("status", "--store", hosts["h1"]).stdout
        ls = memstore("ls", "--store", hosts["h2"], "--job", "cli-job", "--shards")
        assert "step=4" in ls.stdout and "committed" in ls.stdout
        import urllib.request

        scrape = urllib.request.urlopen(printed["metrics"]["h2"], timeout=10).read().decode()
        assert 'memstore_job_bytes{job_id="cli-job"}' in scrape
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0
    # every child store is gone: nothing listens on their ports any more (REUSEADDR tolerates TIME_WAIT)
    import socket

    for address in hosts.values():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", int(address.rsplit(":", 1)[1])))
            s.listen()


def test_status_of_unreachable_store() -> None:
    (port,) = free_ports(1)
    proc = memstore("status", "--store", f"127.0.0.1:{port}", "--timeout", "1")
    assert proc.returncode == 1 and "unreachable" in proc.stderr and "Point --store (or MEMSTORE_STORE)" in proc.stderr
