"""The restore protocol on many real stores: calls per rank and time of ``latest_step()`` and of a full restore.

One scenario, used by ``tests/integration/test_scale.py`` and ``benchmarks/restore_scale.py``:

1. ``hosts`` store processes on 127.0.0.1 (R replicas, small capacity), ``ranks_per_host`` ranks each. Ranks
   are threads of this process, each with its own ``CheckpointClient`` to its own host's store and its own
   member of one gloo process group (a HashStore rendezvous): the real collectives, without one torch
   process per rank. Every rank saves ``steps`` steps of a small state, keeping ``steps - 1``: the last save
   is measured too (``save``), since it is the first that makes every store's retention evict.
2. Every rank calls ``latest_step()`` at once, first without a group (each store lists every store), then
   with ``group=`` (each rank asks its store, which asks its placement group; three all-reduces).
3. A full restore: one host is killed and replaced (same id, empty memory), then every rank restores at once
   with ``load()`` (the no-group path) and again with ``latest_step(group=...)`` + ``load(step, group=...)``.

Calls are counted on the stores' side from their Prometheus counters (``memstore_rpcs_total`` by method), so
they include what the stores ask each other. Repair passes run every 10 minutes here so that they do not blur
the counts (a replacement's first pass at start-up is counted: a user pays it).

Membership gossip has its own scenario (``run_gossip``): ``hosts`` stores following a peers file each
(``gossip_cluster``), the Hello calls each store serves per second on an idle cluster once joining settled
(``hello_rate``), and how long a membership change that one store's source sees takes to reach every store
(``convergence``).

To add a measurement: write it as a function of a started ``LocalCluster`` that returns a dict (or a
``Phase`` from ``phase``-style before/after ``rpc_counts``), and call it from ``run`` or ``run_gossip`` under a
new key; ``tests/integration/test_scale.py`` and the benchmark scripts read the keys.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from memstore.testing import LocalCluster, wait_for
from tools.save_scale import store_counts
from tools.thread_ranks import on_every_rank

JOB = "scale"


@dataclass
class Phase:
    """One phase: every rank did the same thing at once."""

    seconds: float  # from the barrier until the last rank finished
    calls: dict[str, int]  # method -> calls the stores served during the phase for it
    ranks: int
    background: dict[str, int]  # calls that run whatever the ranks do (gossip's Hello, health checks) in the same time

    @property
    def calls_per_rank(self) -> float:
        return sum(self.calls.values()) / self.ranks

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "calls_per_rank": round(self.calls_per_rank, 2)}


def rpc_counts(cluster: LocalCluster) -> dict[str, int]:
    """Calls served by every live store of ``cluster``, summed per method."""
    total: dict[str, int] = {}
    for host, sp in cluster.stores.items():
        if not sp.alive:
            continue
        for method, value in store_counts(cluster, host).calls.items():
            total[method] = total.get(method, 0) + value
    return total


BACKGROUND = ("Hello", "Health")  # membership gossip (a fixed fan-out per store and interval) and health checks


def _delta(after: dict[str, int], before: dict[str, int], background: bool) -> dict[str, int]:
    return {m: after[m] - before.get(m, 0) for m in sorted(after) if after[m] - before.get(m, 0) and (m in BACKGROUND) == background}


def run(hosts: int = 32, ranks_per_host: int = 1, replicas: int = 2, state_kib: int = 256, steps: int = 3) -> dict[str, Any]:
    """The scenario above; returns its phases (seconds, calls by method, calls per rank) and the setup."""
    from trainer_client import CheckpointClient, Connection

    world = hosts * ranks_per_host

    def host(rank: int) -> str:
        return f"h{rank // ranks_per_host}"

    def state(rank: int, step: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(rank * 1000 + step)
        return {"w": torch.randn(state_kib * 256, generator=g), "step": step}

    out: dict[str, Any] = {"hosts": hosts, "ranks": world, "replicas": replicas, "state_kib": state_kib}
    cluster = LocalCluster(hosts=hosts, replicas=replicas, capacity="64MiB", keep=steps - 1, metrics=True,
                           extra_args=["--repair-interval", "600"])  # fmt: skip
    try:
        cluster.start(timeout=60 + 2 * hosts)

        def clients(run_id: str) -> list[CheckpointClient]:
            connections = [Connection(cluster.address(host(r)), timeout=60) for r in range(world)]
            return [CheckpointClient(JOB, r, world, connection=connections[r], run_id=run_id) for r in range(world)]

        def phase(name: str, fn: Callable[[int, Any], Any]) -> list[Any]:
            before = rpc_counts(cluster)
            results, seconds = on_every_rank(world, fn)
            failed = next((r for r in results if isinstance(r, BaseException)), None)
            if failed is not None:
                raise failed
            after = rpc_counts(cluster)
            out[name] = Phase(seconds, _delta(after, before, False), world, _delta(after, before, True)).to_dict()
            return results

        cs = clients("scale-run")
        try:
            for step in range(1, steps):
                for h in [c.save(step, state(c.rank, step)) for c in cs]:
                    h.wait(timeout=120)
            # The last save is measured: it is the first beyond --keep, so retention runs on every store.
            phase("save", lambda r, g: cs[r].save(steps, state(r, steps)).wait(timeout=120))
            assert phase("latest_step", lambda r, g: cs[r].latest_step()) == [steps] * world
            assert phase("latest_step_group", lambda r, g: cs[r].latest_step(group=g)) == [steps] * world
        finally:
            for c in cs:
                c.close()
        for name, agreed in (("restore", False), ("restore_group", True)):
            cluster.kill("h1")
            cluster.restart("h1")  # a replacement: same id, empty memory
            wait_for(lambda: cluster.stores["h1"].alive, timeout=30, what="h1 restarted")
            cs = clients(f"scale-{name}")
            try:

                def restore(r: int, g: Any, agreed: bool = agreed, cs: list[CheckpointClient] = cs) -> bool:
                    c = cs[r]
                    loaded = c.load(c.latest_step(group=g), group=g) if agreed else c.load()
                    return bool(torch.equal(loaded["w"], state(r, steps)["w"]))

                assert all(phase(name, restore))
                out[name]["replaced_host_sources"] = sorted({cs[r].stats().last_load_source for r in range(world) if host(r) == "h1"})
            finally:
                for c in cs:
                    c.close()
    finally:
        cluster.stop()
    return out


# -- membership gossip ----------------------------------------------------------------------------
DISCOVERY_INTERVAL = 0.5  # LocalCluster's --discovery-interval: the gossip round's period


def gossip_cluster(hosts: int) -> LocalCluster:
    """A cluster (not started) whose stores follow a peers file each (``peers-<host>.json``), so that a change
    written to one store's file reaches the others only by gossip."""
    return LocalCluster(hosts=hosts, replicas=2, capacity="16MiB", metrics=True, discovery="files",
                        extra_args=["--repair-interval", "600"])  # fmt: skip


def hello_rate(cluster: LocalCluster, seconds: float) -> dict[str, float]:
    """Hello calls served per store per second over ``seconds`` (and the total per second)."""
    live = sum(sp.alive for sp in cluster.stores.values())
    before = rpc_counts(cluster).get("Hello", 0)
    start = time.monotonic()
    time.sleep(seconds)
    after = rpc_counts(cluster).get("Hello", 0)
    elapsed = time.monotonic() - start
    total = (after - before) / elapsed
    return {"seconds": round(elapsed, 2), "hello_per_s": round(total, 2), "hello_per_store_per_s": round(total / live, 3)}


def table_versions(cluster: LocalCluster, timeout: float = 2.0) -> dict[str, int]:
    """Each live store's slot-table version, from its Hello (-1: no answer)."""
    from memstore.errors import StoreError
    from memstore.server.peers import Peer

    out: dict[str, int] = {}
    for h, sp in cluster.stores.items():
        if not sp.alive:
            continue
        peer = Peer(h, sp.address, cluster.credentials)
        try:
            out[h] = peer.hello(timeout).slots.version
        except StoreError:
            out[h] = -1
        finally:
            peer.close()
    return out


def hello_bytes(cluster: LocalCluster, host: str) -> dict[str, int]:
    """Bytes of ``host``'s Hello answer: in full (a client's ask) and to a gossip ask holding the same table."""
    from memstore.server.convert import slots_from_pb
    from memstore.v1 import store_pb2 as pb
    from memstore.v1.channel import store_stub

    channel, stub = store_stub(cluster.stores[host].address, cluster.credentials)
    try:
        full = stub.Hello(pb.HelloRequest(), timeout=10)
        table = slots_from_pb(full.slots)
        ask = pb.HelloRequest(known_slots_version=table.version, known_slots_digest=table.digest, asker_host_id=host)
        return {"full": full.ByteSize(), "gossip": stub.Hello(ask, timeout=10).ByteSize()}
    finally:
        channel.close()


def convergence(cluster: LocalCluster, leaving: str, seen_by: str, timeout: float = 120.0) -> dict[str, Any]:
    """Take ``leaving`` out of ``seen_by``'s peers file only; seconds (and gossip rounds) from ``seen_by``'s new table
    until every live store holds it."""
    before = table_versions(cluster)[seen_by]
    cluster.members.remove(leaving)
    cluster.write_endpoints(cluster.peers_file_of(seen_by))
    written = time.monotonic()
    target = before
    while target <= before:
        if time.monotonic() - written > timeout:
            raise TimeoutError(f"{seen_by} did not apply its new peers file within {timeout}s (slot table v{target}); its log "
                               f"ends:\n{cluster.log_tail(seen_by)}\nits threads:\n{cluster.thread_dump(seen_by)}")  # fmt: skip
        target = table_versions(cluster)[seen_by]
    changed = time.monotonic()
    holds: dict[str, float] = {}
    while len(holds) < sum(sp.alive for sp in cluster.stores.values()):
        if time.monotonic() - changed > timeout:
            late = sorted(set(cluster.stores) - set(holds))[:1]
            raise TimeoutError(f"only {sorted(holds)} hold slot table v{target} after {timeout}s; the threads of "
                               f"{late}:\n{''.join(cluster.thread_dump(h) for h in late)}")  # fmt: skip
        for h, v in table_versions(cluster).items():
            if v >= target and h not in holds:
                holds[h] = time.monotonic() - changed
    seconds = max(holds.values())
    return {"version": target, "seconds": round(seconds, 2), "rounds": round(seconds / DISCOVERY_INTERVAL, 1),
            "median_seconds": round(sorted(holds.values())[len(holds) // 2], 2)}  # fmt: skip


def run_gossip(hosts: int = 32, window: float = 10.0) -> dict[str, Any]:
    """Hello traffic and convergence on ``hosts`` real stores: Hellos counted right after joining (the join round
    with every member), the idle rate over ``window`` seconds after a settling pause, then one member removed from
    one store's peers file."""
    from memstore.server.discovery import GOSSIP_FANOUT
    from memstore.sim.save_path_model import gossip_rounds

    cluster = gossip_cluster(hosts)
    try:
        cluster.start(timeout=60 + 2 * hosts)
        out: dict[str, Any] = {"hosts": hosts, "fanout": GOSSIP_FANOUT, "interval": DISCOVERY_INTERVAL,
                               "hello_at_start": rpc_counts(cluster).get("Hello", 0)}  # fmt: skip
        time.sleep(4 * DISCOVERY_INTERVAL)  # joining settles: the last joiners' rounds end
        out["idle"] = hello_rate(cluster, window)
        out["hello_bytes"] = hello_bytes(cluster, "h1")
        out["convergence"] = convergence(cluster, leaving=f"h{hosts - 1}", seen_by="h0")
        out["modelled_rounds"] = gossip_rounds(hosts, GOSSIP_FANOUT)
        return out
    finally:
        cluster.stop()
