"""The dev overlay's store container, run as processes: two "pods" on loopback IPs, started with exactly the
rendered args and env (kubelet's ``$(VAR)`` expansion, the ConfigMap's TOML, the generated Secret's tokens),
with each volume mount mapped to a directory, and the headless Service's name answered by a real DNS server.

They find each other, the gRPC probes turn SERVING, a trainer configured like the example Job saves through
``MEMSTORE_STORE`` over the shared-memory fast path with its job token, the step is committed on both stores
(data channel on the rendered --data-port), and the rendered preStop command drains a store, which then exits.
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from memstore.children import child_env
from memstore.testing import wait_for
from tests.harness.health import probe
from tests.k8s.manifests import DOWNWARD_API, EXAMPLE_STORES, argv, container, container_env, one, port_of, rendered, spec_of, store_setup
from tools.dns_server import DnsServer, ptr_name

pytestmark = [pytest.mark.k8s, pytest.mark.integration]

#: two "nodes"; a loopback block of this process's own, so ports in TIME_WAIT from an earlier run never collide
POD_IPS = tuple(f"127.{77 + os.getpid() % 150}.{os.getpid() // 150 % 250}.{n}" for n in (11, 12))


class Pod:
    """One store "pod": its container's mounts are directories under ``root``; its IP is a loopback address."""

    def __init__(self, objs: list[dict[str, Any]], ip: str, root: Path, dns_port: int) -> None:
        self.ds = one(objs, "DaemonSet", "memstore")
        self.c = container(self.ds, "memstore")
        self.ip, self.root = ip, root
        self.mounts = self._materialize(objs)
        downward = {**DOWNWARD_API, "status.podIP": ip}
        env = container_env(self.ds, self.c, downward)
        self.env = {k: self.remap(v) for k, v in env.items()}
        line = [self.remap(a) for a in argv(self.ds, self.c, downward)]
        # the cluster's DNS is ours: the rendered name, asked of the test's server
        self.argv = [f"{a}?server=127.0.0.1:{dns_port}" if a.startswith("--discovery=dns://") else a for a in line]
        self.proc: subprocess.Popen[bytes] | None = None

    def _materialize(self, objs: list[dict[str, Any]]) -> dict[str, Path]:
        """A directory per volume mount, filled from the rendered ConfigMap/Secret; mountPath -> directory."""
        volumes = {v["name"]: v for v in spec_of(self.ds)["volumes"]}
        mounts: dict[str, Path] = {}
        for m in self.c["volumeMounts"]:
            where = self.root / m["name"]
            where.mkdir(parents=True)
            volume = volumes[m["name"]]
            if "configMap" in volume:
                for key, value in one(objs, "ConfigMap", volume["configMap"]["name"])["data"].items():
                    (where / key).write_text(value)
            elif "secret" in volume:
                for key, value in one(objs, "Secret", volume["secret"]["secretName"])["data"].items():
                    (where / key).write_bytes(base64.b64decode(value))
            mounts[m["mountPath"]] = where
        return mounts

    def remap(self, text: str) -> str:
        """Container paths (alone, after ``--flag=`` or in quotes in a config file) -> where their mounts live here."""
        alternatives = "|".join(re.escape(m) for m in sorted(self.mounts, key=len, reverse=True))
        pattern = re.compile(rf'(^|=|")({alternatives})(?=/|"|$)')
        return pattern.sub(lambda m: m.group(1) + str(self.mounts[m.group(2)]), text)

    def start(self) -> None:
        for path in self.mounts.values():  # the config file names container paths too (shm_dir)
            for f in path.glob("*.toml"):
                f.write_text(self.remap(f.read_text()))
        log = (self.root / "store.log").open("ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "memstore", *self.argv], stdout=log, stderr=subprocess.STDOUT,
                                     env={**child_env(), **self.env})  # fmt: skip

    def probe(self, service: str) -> str:
        """What the kubelet's gRPC probe sees: SERVING, NOT_SERVING, or the error code's name."""
        if self.proc is not None and self.proc.poll() is not None:
            pytest.fail(f"the store of pod {self.ip} exited ({self.proc.returncode}):\n{self.log()}")
        return probe(f"{self.ip}:{port_of(self.argv_value('--health-listen'))}", service)

    def argv_value(self, flag: str) -> str:
        return next(a.partition("=")[2] for a in self.argv if a.startswith(flag + "="))

    def log(self) -> str:
        path = self.root / "store.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(timeout=10)


def _ports_free(ip: str, ports: list[int]) -> bool:
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store's servers bind
            try:
                s.bind((ip, port))
            except OSError:
                return False
    return True


@pytest.fixture
def pods(tmp_path: Path) -> Iterator[list[Pod]]:
    objs = rendered(EXAMPLE_STORES)
    setup = store_setup(objs, tmp_path)
    ports = [port_of(setup.config.listen), setup.config.data_port, port_of(setup.config.health_listen), setup.config.metrics_port]
    if not all(_ports_free(ip, ports) for ip in POD_IPS):
        pytest.skip(f"ports {ports} are taken on {POD_IPS}")
    dns = DnsServer()
    name = setup.config.discovery.removeprefix("dns://").rpartition(":")[0] + "."
    dns.zone.set(name, "A", *POD_IPS)  # publishNotReadyAddresses: listed before they are ready
    for ip in POD_IPS:
        dns.zone.set(ptr_name(ip), "PTR", f"{ip.replace('.', '-')}.{name}")  # as CoreDNS answers for a DaemonSet pod
    started = [Pod(objs, ip, tmp_path / ip, dns.port) for ip in POD_IPS]
    try:
        for pod in started:
            pod.start()
        yield started
    finally:
        for pod in started:
            pod.stop()
        dns.stop()


def test_rendered_store_runs_serves_a_trainer_and_drains(pods: list[Pod], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for pod in pods:
        wait_for(lambda pod=pod: pod.probe("") == "SERVING", timeout=60, interval=0.2, what=f"pod {pod.ip} live")  # type: ignore[misc]
        wait_for(lambda pod=pod: pod.probe("memstore.v1.Store") == "SERVING", timeout=60, interval=0.2, what=f"pod {pod.ip} ready")  # type: ignore[misc]

    # a trainer set up like the example Job on the first pod's node (its env, its job token, the same uid)
    job = one(rendered("example-ddp-job"), "Job")
    trainer_env = container_env(job, container(job, "trainer"), {**DOWNWARD_API, "status.hostIP": pods[0].ip})
    token = tmp_path / "job-token"
    jobs_json = (pods[0].mounts["/etc/memstore/auth"] / "jobs.json").read_text()
    token.write_text(json.loads(jobs_json)["ddp-example"])
    monkeypatch.setenv("MEMSTORE_STORE", trainer_env["MEMSTORE_STORE"])
    monkeypatch.setenv("MEMSTORE_AUTH_TOKEN_FILE", str(token))
    import torch

    from trainer_client import CheckpointClient

    with CheckpointClient("ddp-example", rank=0, world_size=1) as client:
        assert client.connection.address == f"{pods[0].ip}:7070"
        assert client.stats().shared_memory, "same machine, same uid, the segment directory at the same path: the fast path"
        info = client.save(1, {"w": torch.arange(1024, dtype=torch.float32)}).wait(timeout=60)
        assert info.copies >= 2, "committed on both stores (R=2) over the data channel"
        assert client.latest_step() == 1

    # Prometheus scrapes the rendered --metrics-port on the pod IP (the containerPort named "metrics")
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    port = next(p["containerPort"] for p in pods[0].c["ports"] if p["name"] == "metrics")
    with urllib.request.urlopen(f"http://{pods[0].ip}:{port}/metrics", timeout=5) as response:
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    held = {s.labels.get("job_id"): s.value for s in families["memstore_job_bytes"].samples}
    assert held.get("ddp-example", 0) >= 4096, "the job's shard shows in the pod's metrics"

    # deleting the pod: the rendered preStop command, in the container's env
    hook = [pods[0].remap(a) for a in pods[0].c["lifecycle"]["preStop"]["exec"]["command"]]
    assert hook[0] == "memstore"
    done = subprocess.run([sys.executable, "-m", "memstore", *hook[1:]], env={**child_env(), **pods[0].env},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr + pods[0].log()
    assert pods[0].proc is not None and pods[0].proc.wait(timeout=30) == 0, pods[0].log()
