"""Data-parallel replica groups on a GPU: what each member's capture costs at D = 1, 2 and 4, and the restore.

    python benchmarks/data_parallel_gpu.py [--device cuda] [--layers 12] [--dim 2048] [--saves 5] [--json out.json]

One process plays the D members of a replica group (``CheckpointClient(replica_group=[0..D-1])``), each with its own
client to its own store of a 4-host, R=2 local cluster on 127.0.0.1, all on one device: the state is the transformer
and AdamW of ``benchmarks/gpu_capture.py`` (``--state model``: bf16, 48 tensors a layer). Members save one after the
other, so each stall is one member's alone (on separate GPUs they run at once). For each D it reports, per member:
the bytes captured and the ``save()`` stall (``capture="copied"``: returns once the bytes are in the store's memory),
first save and steady median; the D2H floor of the whole state (a ``copy_`` of every tensor into one pinned buffer);
the bytes the stores hold for a step over the state's size; and ``load(map_location=device)`` by each member
(checked bit for bit), first and second. D=1 is today's path (no replica group).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_capture import Transformer

from memstore.testing import LocalCluster
from memstore.v1 import store_pb2 as pb
from memstore.v1.channel import store_stub
from trainer_client import CheckpointClient, Connection, serialization


def model_state(layers: int, dim: int, device: torch.device) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Transformer(layers, dim, max(1, dim // 128), 1024).to(device=device, dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in tensors(v)]
    if isinstance(state, list | tuple):
        return [t for v in state for t in tensors(v)]
    return []


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def d2h_floor(state: Any) -> float:
    device = tensors(state)[0].device
    ts = tensors(state)
    total = sum(t.numel() * t.element_size() for t in ts)
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    times = []
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        offset = 0
        for t in ts:
            n = t.numel() * t.element_size()
            pinned[offset : offset + n].view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
            offset += n
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def listing(cluster: LocalCluster, host: str, job: str, step: int) -> list[Any]:
    channel, stub = store_stub(cluster.address(host))
    try:
        return [s for s in stub.List(pb.ListRequest(job_id=job), timeout=30).shards if s.manifest.key.step == step]
    finally:
        channel.close()


def ram_bytes(cluster: LocalCluster, job: str, step: int) -> int:
    """The bytes of ``step`` the stores hold as its R copies (copies cached ahead of a restore not counted)."""
    return sum(s.manifest.nbytes for h in cluster.members for s in listing(cluster, h, job, step) if not s.cached)


def wait_assembled(cluster: LocalCluster, job: str, d: int, step: int, timeout: float = 20.0) -> bool:
    """Wait until each member's store holds all D stripes of ``step`` (its assembler pulled the others ahead)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all({s.manifest.key.rank for s in listing(cluster, f"h{r}", job, step)} >= set(range(d)) for r in range(d)):
            return True
        time.sleep(0.1)
    return False


def same(a: Any, b: Any) -> bool:
    ta, tb = tensors(a), tensors(b)
    pairs = zip(ta, tb, strict=True) if len(ta) == len(tb) else iter([(torch.zeros(1), torch.ones(1))])
    return all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.cpu(), y.cpu()) for x, y in pairs)


def run_group(cluster: LocalCluster, state: Any, d: int, saves: int, device: torch.device, job: str) -> dict[str, Any]:
    group = None if d == 1 else list(range(d))
    clients = [CheckpointClient(job, r, d, connection=Connection(cluster.address(f"h{r}")), run_id=f"run-{d}", replica_group=group)
               for r in range(d)]  # fmt: skip
    stalls: list[list[float]] = [[] for _ in range(d)]
    for c in clients:  # what a trainer would do once: the first save then makes no call and touches no fresh memory
        c.prepare(state)
    captured = [0] * d
    try:
        for step in range(1, saves + 1):
            for r, c in enumerate(clients):
                sync(device)
                t0 = time.perf_counter()
                handle = c.save(step, state)
                stalls[r].append(time.perf_counter() - t0)
                captured[r] = handle.wait(120).nbytes
        held = ram_bytes(cluster, job, saves)
        t0 = time.perf_counter()
        assembled = wait_assembled(cluster, job, d, saves)
        assembly_s = time.perf_counter() - t0
        loads: list[list[float]] = [[] for _ in range(d)]
        for _ in range(2):
            for r, c in enumerate(clients):
                sync(device)
                t0 = time.perf_counter()
                out = c.load(saves, map_location=device)
                sync(device)
                loads[r].append(time.perf_counter() - t0)
                assert same(out, state), f"D={d} rank {r}: restored state differs"
                del out
        stats = [c.stats().capture for c in clients]
        fresh = fresh_restore(cluster, job, d, saves, device)
    finally:
        for c in clients:
            c.close()
    return {
        "stalls_s": stalls, "assembled_ahead": assembled, "assembly_wait_s": assembly_s,
        "registrations": [s.registrations for s in stats], "fallbacks": [s.fallbacks for s in stats],
        "fresh_process_restore_s": fresh,
        "d": d, "captured_bytes": captured, "first_stall_s": [s[0] for s in stalls],
        "steady_stall_s": [statistics.median(s[1:]) if len(s) > 1 else s[0] for s in stalls],
        "ram_bytes": held, "restore_first_s": [x[0] for x in loads], "restore_second_s": [x[1] for x in loads],
    }  # fmt: skip


FRESH = """
import sys, time, torch
from trainer_client import CheckpointClient, Connection
address, job, d, step, device = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
torch.empty(1, device=device)  # the CUDA context, as a restarted trainer has it before it restores
with CheckpointClient(job, 0, d, connection=Connection(address), run_id="fresh") as c:
    t0 = time.perf_counter(); out = c.load(step, map_location=device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    print(time.perf_counter() - t0)
"""


def fresh_restore(cluster: LocalCluster, job: str, d: int, step: int, device: torch.device) -> float:
    """Rank 0's restore in a new process (a trainer restarted after a crash), onto ``device``."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", FRESH, cluster.address("h0"), job, str(d), str(step), str(device)],
                         capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--groups", default="1,2,4", help="the group sizes to run, in order (default 1,2,4)")
    args = p.parse_args()
    device = torch.device(args.device)
    state = model_state(args.layers, args.dim, device)
    logical = serialization.plan(state).nbytes
    floor = d2h_floor(state) if device.type == "cuda" else float("nan")
    cap = max(1 << 30, 10 * logical)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
                           "state_bytes": logical, "tensors": len(tensors(state)), "d2h_floor_s": floor, "groups": []}  # fmt: skip
    print(f"state: {len(tensors(state))} tensors, {logical / 2**30:.2f} GiB on {out['device']}; D2H floor {floor * 1e3:.1f} ms", flush=True)
    with LocalCluster(hosts=4, replicas=2, capacity=f"{cap >> 20}MiB", workdir=Path(tempfile.mkdtemp())) as cluster:
        for i, d in enumerate(int(x) for x in args.groups.split(",")):
            g = run_group(cluster, state, d, args.saves, device, f"dp{d}-{i}")
            for host in cluster.members:  # each group size on empty stores: the next one's assembly has its room
                channel, stub = store_stub(cluster.address(host))
                try:
                    stub.Delete(pb.DeleteRequest(job_id=f"dp{d}-{i}", step=-1, rank=-1), timeout=60)
                except grpc.RpcError as err:
                    if err.code() != grpc.StatusCode.NOT_FOUND:  # a store that never held the job
                        raise
                finally:
                    channel.close()
            out["groups"].append(g)
            print(f"D={d}: captured/rank {max(g['captured_bytes']) / logical:.3f} of the state; stall first "
                  f"{max(g['first_stall_s']) * 1e3:.1f} ms, steady {statistics.median(g['steady_stall_s']) * 1e3:.1f} ms "
                  f"({statistics.median(g['steady_stall_s']) / floor:.2f}x the state's D2H floor); RAM {g['ram_bytes'] / logical:.2f}x "
                  f"the state; restore onto {device} first {max(g['restore_first_s']) * 1e3:.0f} ms, "
                  f"second {max(g['restore_second_s']) * 1e3:.0f} ms (max over members), in a new process "
                  f"{g['fresh_process_restore_s'] * 1e3:.0f} ms; registrations after prepare {g['registrations']}, "
                  f"fallbacks {g['fallbacks']}; assembled ahead {g['assembled_ahead']} after {g['assembly_wait_s']:.2f} s; "
                  f"stalls (ms) {[[round(x * 1e3, 1) for x in s] for s in g['stalls_s']]}",
                  flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
