"""Interop: spilled DCP steps load with plain torch DCP (FileSystemReader), and ``memstore export`` writes torch.save files.

The DCP case saves with two real gloo ranks (forked from a forkserver, like test_dcp.py), each through its own store, so
the step's ``.metadata`` is assembled from the indexes two different stores wrote. The plain-DCP load runs in a fresh
interpreter that cannot import memstore or trainer_client (``-I -S``, with only site-packages on sys.path, so memstore's
editable install is not seen either).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from memstore import cli
from memstore.testing import LocalCluster, free_ports, wait_for
from tests.harness.ranks import forkserver_fixture, run_ranks
from tests.states import assert_same, rank_state
from trainer_client import CheckpointClient

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# DCP save with two gloo ranks
# ---------------------------------------------------------------------------------------------


def _full_state(step: int) -> dict[str, Any]:
    """Model + Adam state after one step (what every rank holds before sharding), plus non-tensor values."""
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 6))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(5, 8)).square().mean().backward()
    opt.step()
    odd = {
        "bf16": torch.randn(6, 3).to(torch.bfloat16),
        "nan_payload": torch.tensor([0x7FC00001, 0x7F800123], dtype=torch.int32).view(torch.float32),
    }
    return {"model": model.state_dict(), "optim": opt.state_dict(), "odd": odd, "extra": {"step": step, "name": f"run-{step}"}}


def _save_worker(rank: int, addrs: list[str], job: str, steps: list[int], port: int, out_dir: str, spill_root: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from trainer_client.dcp import MemStoreWriter

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        for step in steps:
            full = _full_state(step)
            # Matrices sharded by rows over the two ranks (each rank stores its half); the rest is replicated.
            model = {k: distribute_tensor(v, mesh, [Shard(0)]) if v.dim() == 2 else v for k, v in full["model"].items()}
            state = {**full, "model": model}
            writer = MemStoreWriter(job, step, store=addrs[rank])  # each rank through its own store: two spilling owners
            dcp.save(state, storage_writer=writer)
            writer.close()
            if rank == 0:
                torch.save(full, os.path.join(out_dir, f"expected-{step}.pt"))
                # the next step only once this one is exported: retention then has plain-DCP files to delete
                metadata = os.path.join(spill_root, job, f"step-{step:012d}", ".metadata")
                wait_for(lambda m=metadata: os.path.exists(m), timeout=30, what=f"step {step}'s .metadata")
            dist.barrier()
    finally:
        dist.destroy_process_group()


forkserver = forkserver_fixture(__name__)


PLAIN_DCP_LOAD = """
import sys
sys.path.append({site!r})
for name in ("memstore", "trainer_client"):
    try:
        __import__(name)
    except ImportError:
        pass
    else:
        raise SystemExit(name + " is importable: the check would prove nothing")
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

def blank(v):
    if isinstance(v, torch.Tensor):
        return torch.full_like(v, 123) if v.is_floating_point() else torch.zeros_like(v)
    if isinstance(v, dict):
        return type(v)((k, blank(x)) for k, x in v.items())
    if isinstance(v, list):
        return [blank(x) for x in v]
    if isinstance(v, str):
        return "blank"
    if isinstance(v, int) and not isinstance(v, bool):
        return -1
    return v

def same(a, b, path):
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            same(a[k], b[k], f"{{path}}[{{k!r}}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{{path}}[{{i}}]")
    else:
        assert a == b, (path, a, b)

expected = torch.load({expected!r}, weights_only=True)
loaded = blank(expected)
dcp.load(loaded, storage_reader=FileSystemReader({step_dir!r}))  # no process group: one process reads both ranks' files
same(expected, loaded, "state")
dcp_to_torch_save({step_dir!r}, {consolidated!r})
print("PLAIN-DCP-OK")
"""


def _as_dcp_sees_it(state: Any) -> Any:
    """Plain dicts with str keys, sorted: how a consolidated DCP state compares with the state that was saved."""
    if isinstance(state, dict):
        return {str(k): _as_dcp_sees_it(v) for k, v in sorted(state.items(), key=lambda kv: str(kv[0]))}
    if isinstance(state, list):
        return [_as_dcp_sees_it(v) for v in state]
    return state


def _export(*args: str) -> int:
    return cli.main(["export", *args])


def test_spilled_dcp_step_loads_with_plain_dcp_and_exports(make_inprocess_cluster, forkserver, tmp_path) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "spill"
    args = ["--spill", f"file://{root}", "--spill-every-steps", "1", "--spill-keep-last", "1"]
    cluster: LocalCluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="128MiB", extra_args=args)
    job = "interop-dcp"
    run_ranks(_save_worker, 2, [cluster.address("h0"), cluster.address("h1")], job, [1, 2], free_ports(1)[0], str(tmp_path), str(root))

    step_dir = root / job / "step-000000000002"
    wait_for(lambda: (step_dir / ".metadata").exists(), timeout=30, what="step 2's .metadata (written once both ranks' indexes exist)")
    names = {p.name for p in step_dir.iterdir()}
    assert {"__0_0.distcp", "__1_0.distcp", "dcp-index-000000.json", "dcp-index-000001.json", "rank-000000.json"} <= names, names
    assert not [n for n in names if ".tmp-" in n], names
    # keep-last 1: step 1 (exported before step 2 was saved) went, its plain-DCP files with it: the whole directory
    wait_for(lambda: not (root / job / "step-000000000001").exists(), timeout=30, what="step 1 deleted by retention, extras included")

    consolidated = tmp_path / "dcp_to_torch_save.pt"
    code = PLAIN_DCP_LOAD.format(
        site=sysconfig.get_paths()["purelib"],
        expected=str(tmp_path / "expected-2.pt"),
        step_dir=str(step_dir),
        consolidated=str(consolidated),
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-I", "-S", "-c", textwrap.dedent(code)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and "PLAIN-DCP-OK" in done.stdout, done.stdout + done.stderr

    # memstore export of the DCP step: the consolidated full state, identical to torch's own dcp_to_torch_save
    reference = torch.load(consolidated, weights_only=True)
    expected = torch.load(tmp_path / "expected-2.pt", weights_only=True)
    assert_same(_as_dcp_sees_it(expected), _as_dcp_sees_it(reference))
    from_store = tmp_path / "from-store.pt"
    assert _export("--store", cluster.address("h1"), "--job", job, "--to", str(from_store)) == 0  # --step latest
    assert_same(reference, torch.load(from_store, weights_only=True))

    cluster.stop()  # no store running: straight from durable storage
    from_disk = tmp_path / "from-disk.pt"
    assert _export("--spill", f"file://{root}", "--job", job, "--step", "2", "--to", str(from_disk)) == 0
    assert_same(reference, torch.load(from_disk, weights_only=True))


# ---------------------------------------------------------------------------------------------
# memstore export of CheckpointClient steps, and its errors
# ---------------------------------------------------------------------------------------------


def _save(cluster: LocalCluster, job: str, world: int, steps: range) -> None:
    clients = [CheckpointClient(job, r, world, store=cluster.address(f"h{r % 2}")) for r in range(world)]
    try:
        for step in steps:
            for handle in [c.save(step, rank_state(c.rank, step)) for c in clients]:
                handle.wait(timeout=30)
    finally:
        for c in clients:
            c.close()


def _complete(root: Path, job: str, step: int, world: int) -> bool:
    return all((root / job / f"step-{step:012d}" / f"rank-{r:06d}.json").exists() for r in range(world))


def test_export_plain_steps_from_cluster_and_durable_storage_and_errors(make_cluster, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "spill"
    cluster: LocalCluster = make_cluster(
        hosts=2, replicas=2, capacity="128MiB", extra_args=["--spill", f"file://{root}", "--spill-every-steps", "1"]
    )
    _save(cluster, "multi", 2, range(1, 3))
    _save(cluster, "single", 1, range(1, 3))
    addr, out = cluster.address("h0"), tmp_path / "out"
    out.mkdir()

    # W > 1: {rank: state}; W = 1: the state as saved. Bit-exact (types, dtypes, bytes) after torch.load(weights_only=True).
    assert _export("--store", addr, "--job", "multi", "--to", str(out / "multi.pt")) == 0
    assert "exported job multi step 2 (2 ranks" in capsys.readouterr().out
    assert_same({0: rank_state(0, 2), 1: rank_state(1, 2)}, torch.load(out / "multi.pt", weights_only=True))
    assert _export("--store", cluster.address("h1"), "--job", "single", "--step", "1", "--to", str(out / "single.pt")) == 0
    assert_same(rank_state(0, 1), torch.load(out / "single.pt", weights_only=True))
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as mp:  # a terminal shows a progress bar on stderr (forced here: no TTY)
        mp.setenv("MEMSTORE_PROGRESS", "1")
        assert _export("--store", addr, "--job", "multi", "--to", str(out / "bar.pt")) == 0
    assert "reading step 2 of multi" in capsys.readouterr().err

    def fails(*args: str, match: str) -> None:
        assert _export(*args) == 2
        err = capsys.readouterr().err
        assert err.startswith("memstore export: error: ") and match in err, err

    fails("--store", addr, "--job", "nope", "--to", str(out / "x.pt"), match="'nope'")
    fails("--store", addr, "--job", "multi", "--step", "99", "--to", str(out / "x.pt"), match="step 99 of job 'multi'")
    fails("--store", f"127.0.0.1:{free_ports(1)[0]}", "--timeout", "0.5", "--job", "multi", "--to", str(out / "x.pt"), match="unreachable")
    fails("--store", addr, "--job", "multi", "--to", str(out / "no-dir" / "x.pt"), match="does not exist")
    fails("--store", addr, "--job", "multi", "--to", str(out), match="is a directory")
    fails("--store", addr, "--job", "multi", "--to", "/proc/memstore-export.pt", match="/proc/memstore-export.pt")
    fails("--store", addr, "--job", "bad/job", "--to", str(out / "x.pt"), match="--job")
    before = (out / "single.pt").read_bytes()
    fails("--store", addr, "--job", "multi", "--to", str(out / "single.pt"), match="pass --force")
    assert (out / "single.pt").read_bytes() == before  # never clobbered without --force
    assert _export("--store", addr, "--job", "multi", "--step", "1", "--to", str(out / "single.pt"), "--force") == 0
    assert_same({0: rank_state(0, 1), 1: rank_state(1, 1)}, torch.load(out / "single.pt", weights_only=True))
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]  # no temporary files left behind by failures
    capsys.readouterr()

    # the real entry point: exit status 2 and the message on stderr
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "memstore", "export", "--store", addr, "--job", "multi", "--to", str(out / "multi.pt")],
                          env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and "exists; pass --force" in done.stderr, done.stderr

    # stores stopped: from durable storage (manifests, shards, checksums), same bytes
    wait_for(lambda: all(_complete(root, j, s, w) for j, w in (("multi", 2), ("single", 1)) for s in (1, 2)), timeout=30, what="spills")
    cluster.stop()
    spill = f"file://{root}"
    assert _export("--spill", spill, "--job", "multi", "--step", "1", "--to", str(out / "d-multi.pt")) == 0
    assert_same({0: rank_state(0, 1), 1: rank_state(1, 1)}, torch.load(out / "d-multi.pt", weights_only=True))
    assert _export("--spill", spill, "--job", "single", "--to", str(out / "d-single.pt")) == 0  # latest: step 2
    assert_same(rank_state(0, 2), torch.load(out / "d-single.pt", weights_only=True))
    capsys.readouterr()
    fails("--spill", spill, "--job", "nope", "--to", str(out / "x.pt"), match="job 'nope' has no spilled steps")
    fails("--spill", spill, "--job", "multi", "--step", "7", "--to", str(out / "x.pt"), match="step 7 of job 'multi' is not in")
    (root / "multi" / "step-000000000002" / "rank-000001.json").unlink()  # rank 1 unpublished: step 2 incomplete
    fails("--spill", spill, "--job", "multi", "--step", "2", "--to", str(out / "x.pt"), match="ranks [1] of 2 not published")
    shard = root / "multi" / "step-000000000001" / "rank-000000.shard"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    fails("--spill", spill, "--job", "multi", "--step", "1", "--to", str(out / "x.pt"), match="checksum")
    assert not (out / "x.pt").exists()


def test_export_hook_never_breaks_the_spill(tmp_path, caplog, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The spiller's interop calls log failures and go on; the DCP check is on the header bytes only."""
    from memstore.core.spill_policy import RetentionPolicy
    from memstore.errors import SpillUnreachable
    from memstore.interop import dcp_export
    from memstore.spill.spiller import Spiller
    from memstore.spill.storage import Durable
    from trainer_client import serialization

    dcp_shard = {"format": "memstore-dcp", "version": 1, "step": 3, "rank": 0, "world_size": 1, "items": {"w||": torch.ones(2)}}
    plain = {"note": "memstore-dcp", "format": "memstore-dcp-lookalike", "w": torch.ones(2)}
    assert dcp_export.looks_like_dcp(memoryview(serialization.encode(dcp_shard)))
    assert not dcp_export.looks_like_dcp(memoryview(serialization.encode(plain)))
    assert not dcp_export.looks_like_dcp(memoryview(b"MSTSHRD1" + bytes(4)))

    durable = Durable(f"file://{tmp_path}")
    spiller = Spiller(object(), durable, every_steps=1, every_seconds=0, retention=RetentionPolicy(), codec="none", max_rate=0,  # type: ignore[arg-type]
                      listeners=[dcp_export.DcpExport()])  # fmt: skip
    spiller._after_publish(SimpleNamespace(key="job/3/0"))  # type: ignore[arg-type]  # a source without pinned_bytes: logged only
    assert "spill listener DcpExport failed" in caplog.text

    def broken(prefix: str) -> dict[str, Any]:
        raise SpillUnreachable("storage down")

    monkeypatch.setattr(durable, "list_files", broken)
    assert spiller._interop_paths("job", 1, {0}) == []  # retention goes on with memstore's own files
    monkeypatch.setenv(dcp_export.ENV_MODE, "off")
    assert not dcp_export.enabled(durable)
