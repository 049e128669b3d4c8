"""The faults of the recovery matrix: one declarative entry each (:class:`.fault.Fault`). This module holds the
process faults (kills, crashes, drains, corrupted segments); :mod:`.faults_erasure`, :mod:`.faults_network` and
:mod:`.faults_environment` hold the others, and ``FAULTS`` is all of them, in the page's order.

A fault says what it does (``inject``, at the moment RTO starts, while every rank is saving), what the operator
or scheduler does afterwards (``recover``: the restarts), the configurations it runs in, and the RPO it promises
in each (``max_rpo``; None where losing the steps is the correct outcome, e.g. the only copy was in the RAM of a
host that is gone). Adding a fault is adding one ``Fault(...)`` to one of the four tuples.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from memstore.children import child_env
from tools.recovery_matrix.fault import EC41, R1, R1S, R2, R2S, R3, R3S, Fault, durable_only, one_copy_lost
from tools.recovery_matrix.faults_environment import ENVIRONMENT_FAULTS
from tools.recovery_matrix.faults_erasure import ERASURE_FAULTS
from tools.recovery_matrix.faults_network import NETWORK_FAULTS
from tools.recovery_matrix.scenario import Scenario, flip_every_page


# -- injections -------------------------------------------------------------------------------------
def _kill_trainer(s: Scenario) -> None:
    s.kill_worker(0)


def _kill_store(s: Scenario) -> None:
    s.cluster.kill("h0")


def _crash_store(s: Scenario) -> None:
    s.cluster.kill("h0", keep_memory=True)


def _lose_host(s: Scenario) -> None:
    s.cluster.kill("h0")
    s.kill_worker(0)


def _lose_r_hosts(s: Scenario) -> None:
    for h in s.hosts[: s.config.replicas]:
        s.cluster.kill(h)


def _lose_every_host(s: Scenario) -> None:
    for h in s.hosts:
        s.cluster.kill(h)


def _restart_h0(s: Scenario) -> None:
    s.cluster.restart("h0")


def _restart_dead(s: Scenario) -> None:
    for h in s.hosts:
        if not s.cluster.stores[h].alive:
            s.cluster.restart(h)


def _segments(s: Scenario, host: str) -> list[Path]:
    return sorted(Path(s.cluster.segment_dir(host)).glob("seg-*"))


def _flip_segment_bytes(s: Scenario) -> None:
    """XOR one byte of every 4 KiB page of every segment file of h0, under the running store (bit rot in RAM)."""
    for path in _segments(s, "h0"):
        flip_every_page(path)


def _crash_and_truncate(s: Scenario) -> None:
    """The store process of h0 crashes and its segment files lose their second half (a torn write-back)."""
    _crash_store(s)
    for path in _segments(s, "h0"):
        os.truncate(path, path.stat().st_size // 2)


def _sigterm_store(s: Scenario) -> None:
    """SIGTERM h0 (a pod deletion): it drains, giving what only it holds another copy, then exits."""
    sp = s.cluster.stores["h0"]
    assert sp.proc is not None
    sp.proc.send_signal(signal.SIGTERM)
    sp.proc.wait(timeout=60)


def _drain_during_repair(s: Scenario) -> None:
    """h1 loses its RAM and restarts; while it pulls its copies back (each pull stalled), h0 gets SIGTERM and drains."""
    s.cluster.kill("h1")
    s.cluster.restart("h1")
    _sigterm_store(s)


def _rolling_replacement(s: Scenario) -> None:
    """Every store in turn, while the ranks keep saving: SIGTERM (drain), then its replacement starts empty."""
    for h in s.hosts:
        sp = s.cluster.stores[h]
        assert sp.proc is not None
        sp.proc.send_signal(signal.SIGTERM)
        sp.proc.wait(timeout=60)
        s.cluster.restart(h)


def _duplicate_host_id(s: Scenario) -> None:
    """A second store starts with h0's host id, address and shm dir while h0 runs: it must refuse to serve."""
    sp = s.cluster.stores["h0"]
    dup = subprocess.run(sp.args, capture_output=True, text=True, timeout=60, env={**os.environ, **child_env()})
    if dup.returncode == 0:
        raise RuntimeError(f"a second store with host id h0 exited 0: {dup.stderr[-300:]}")
    if not sp.alive:
        raise RuntimeError("the first store with host id h0 died when a second one started")


def _replace_pod(s: Scenario) -> None:
    """A replaced pod on the same node: a new store with a new host id (new pod IP) takes h0's slot and the node's
    /dev/shm, where h0's segments still are; rank 0 now reaches it."""
    s.cluster.add_host("h0-new", replacing="h0")
    s.hosts[0] = "h0-new"


PROCESS_FAULTS: tuple[Fault, ...] = (
    Fault(
        id="trainer-sigkill",
        name="Trainer SIGKILL",
        description="rank 0's trainer process is SIGKILLed mid-save; the job restarts",
        configs=(R1, R2, R2S),
        inject=_kill_trainer,
    ),
    Fault(
        id="store-crash-adopt",
        name="Store SIGKILL, adopted",
        description="h0's store process is SIGKILLed; its restart (same host id) adopts the verified segments it left in /dev/shm",
        configs=(R1, R2, R2S),
        inject=_crash_store,
        recover=_restart_h0,
    ),
    Fault(
        id="store-sigkill",
        name="Store SIGKILL, memory lost",
        description="h0's store is SIGKILLed and its /dev/shm is lost; it restarts empty",
        configs=(R1, R1S, R2, R2S, R3),
        inject=_kill_store,
        recover=_restart_h0,
        max_rpo=one_copy_lost,
    ),
    Fault(
        id="host-loss",
        name="Host loss",
        description="host h0 is lost: its store (and its RAM) and its trainer; a replacement host starts "
        "(under ec:4+1 it rebuilds rank 0's shards from the four survivors)",
        configs=(R1S, R2, R2S, EC41),
        inject=_lose_host,
        recover=_restart_h0,
        max_rpo=one_copy_lost,
    ),
    Fault(
        id="group-loss",
        name="Group loss",
        description="both hosts of one placement group (h0, h1 of 4, R=2) are lost at once; its steps come back from the durable tier",
        configs=(R2S,),
        inject=_lose_r_hosts,
        recover=_restart_dead,
        max_rpo=durable_only,
        hosts=lambda c: 4,
    ),
    Fault(
        id="r-hosts-lost",
        name="R hosts lost at once",
        description="R of R+1 hosts are lost at once, every copy of some shards with them",
        configs=(R1S, R2, R2S, R3S),
        inject=_lose_r_hosts,
        recover=_restart_dead,
        max_rpo=durable_only,
        hosts=lambda c: c.replicas + 1,
    ),
    Fault(
        id="power-cycle",
        name="Every store restarted, /dev/shm lost",
        description="every host power-cycles at once: only the durable tier survives",
        configs=(R1S, R2, R2S),
        inject=_lose_every_host,
        recover=_restart_dead,
        max_rpo=durable_only,
    ),
    Fault(
        id="corrupt-segment-ram",
        name="Corrupted segment in RAM",
        description="one byte of every page of h0's segment files is flipped under the running store",
        configs=(R1, R1S, R2),
        inject=_flip_segment_bytes,
        max_rpo=one_copy_lost,
    ),
    Fault(
        id="truncated-segment",
        name="Truncated segment file",
        description="h0's store crashes and its segment files are cut in half; the restart must not adopt them",
        configs=(R1, R2),
        inject=_crash_and_truncate,
        recover=_restart_h0,
        max_rpo=one_copy_lost,
    ),
    Fault(
        id="sigterm-drain",
        name="SIGTERM drain during a save",
        description="h0's store gets SIGTERM mid-save, drains and exits; it restarts",
        configs=(R1, R2),
        inject=_sigterm_store,
        recover=_restart_h0,
    ),
    Fault(
        id="peer-stall",
        name="Peer stalled mid-transfer",
        description="h1 stalls 2 s on every copy it receives before registering it "
        "(MEMSTORE_FAULTS receive.before_register); h0 is lost while a copy to h1 is stalled",
        configs=(R2,),
        inject=_kill_store,
        recover=_restart_h0,
        store_env={"h1": {"MEMSTORE_FAULTS": "receive.before_register:*=stall:2"}},
    ),
    Fault(
        id="spill-failing",
        name="Spill target failing",
        description="every write to the durable tier fails (MEMSTORE_FAULTS spill.after_chunk=error: a fault point, run on any "
        "machine; a really full disk is spill-enospc); then h0 is lost with its RAM",
        configs=(R2S,),
        inject=_kill_store,
        recover=_restart_h0,
        store_env={h: {"MEMSTORE_FAULTS": "spill.after_chunk:*=error"} for h in ("h0", "h1")},
    ),
    Fault(
        id="drain-during-repair",
        name="Drain during a repair",
        description="h1 restarts empty and repairs from h0 (each pull stalled 0.3 s); h0 gets SIGTERM mid-repair, drains and restarts",
        configs=(R2,),
        inject=_drain_during_repair,
        recover=_restart_h0,
        store_env={"h1": {"MEMSTORE_FAULTS": "repair.after_pull:*=stall:0.3"}},
    ),
    Fault(
        id="rolling-replacement",
        name="Rolling replacement during saves",
        description="every store in turn gets SIGTERM, drains and is replaced by an empty one, while every rank keeps saving",
        configs=(R2, R3),
        inject=_rolling_replacement,
    ),
    Fault(
        id="replaced-pod-same-node",
        name="A replaced pod on the same node",
        description="h0's store is SIGKILLed (its segments stay in /dev/shm); a store with a new host id and address "
        "replaces it in the peers file and adopts them",
        configs=(R1, R2),
        inject=_crash_store,
        recover=_replace_pod,
        discovery="file",
    ),
    Fault(
        id="duplicate-host-id",
        name="A second store with the same host id",
        description="a second store starts with h0's host id, address and shm dir while h0 serves; it must refuse, h0 keeps serving",
        configs=(R1, R2),
        inject=_duplicate_host_id,
    ),
)

FAULTS: tuple[Fault, ...] = PROCESS_FAULTS + ERASURE_FAULTS + NETWORK_FAULTS + ENVIRONMENT_FAULTS
