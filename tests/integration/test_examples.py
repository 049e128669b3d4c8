"""Every script in examples/ runs against real stores, and resumes when run again, so none can rot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from memstore.testing import free_ports

pytestmark = pytest.mark.integration
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run(args: list[str]) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def torchrun(script: str, store: str, steps: int) -> str:
    (port,) = free_ports(1)
    return run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(port), str(EXAMPLES / script), "--store", store, "--steps", str(steps)])  # fmt: skip


@pytest.mark.slow  # two fresh processes that train and resume (~13 s of CPU); the client paths it uses are all in the default suite
def test_plain_loop(make_inprocess_cluster) -> None:
    store = make_inprocess_cluster(hosts=2, replicas=2, capacity="64MiB").address("h0")
    assert "done at step 6" in run([sys.executable, str(EXAMPLES / "plain_loop.py"), "--store", store, "--steps", "6"])
    out = run([sys.executable, str(EXAMPLES / "plain_loop.py"), "--store", store, "--steps", "10"])
    assert "resumed from step 6" in out and "done at step 10" in out


@pytest.mark.slow  # two torchrun launches of two ranks each (~35 s on 2 cores)
def test_ddp_torchrun(make_cluster) -> None:
    store = make_cluster(hosts=2, replicas=2, capacity="64MiB").address("h1")
    assert torchrun("ddp_torchrun.py", store, 4).count("done at step 4") == 2
    out = torchrun("ddp_torchrun.py", store, 7)
    assert out.count("resumed from step 4") == 2 and out.count("done at step 7") == 2


@pytest.mark.slow  # as above; DCP through memstore stays in the default suite (test_dcp, test_dcp_conformance)
def test_dcp_fsdp(make_cluster) -> None:
    store = make_cluster(hosts=2, replicas=2, capacity="64MiB").address("h0")
    assert torchrun("dcp_fsdp.py", store, 3).count("done at step 3") == 2
    out = torchrun("dcp_fsdp.py", store, 5)
    assert out.count("resumed from step 3") == 2 and out.count("done at step 5") == 2
