"""The recovery matrix's faults of the machine's services: S3 throttling and outage, DNS outage and flapping, OOM kill, ENOSPC.

Each injects the real thing: a real S3 server (moto) behind an HTTP proxy that answers 503 SlowDown or refuses
connections (:mod:`tools.s3_proxy`); a real DNS server the stores discover each other through, which stops
answering or flaps (:mod:`tools.dns_server`); the kernel's OOM killer enforcing a memory cgroup's limit
(:mod:`tools.memcg`); a tmpfs too small for the durable tier. The last two need root: where this machine
cannot, the fault's ``needs`` says why and its rows are not run (``NotRunHere``).
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from memstore.testing import wait_for
from tools.recovery_matrix.fault import R1, R1S, R2, R2S, R3, Fault, durable_only, one_copy_lost
from tools.recovery_matrix.scenario import Scenario

MIB = 1 << 20
SAVES_DURING = 2  # steps every rank must still commit while the service is failing (saves do not depend on it)


def _keep_saving(s: Scenario, steps: int = SAVES_DURING, timeout: float = 30.0) -> None:
    """The ranks go on committing while the fault lasts: ``steps`` more steps, or the row fails."""
    s.wait_committed(s.committed() + steps, timeout=timeout)


def _wait_logged(s: Scenario, text: str, what: str, timeout: float = 15.0) -> None:
    """Until a store's log shows ``text``: the fault reached the stores (else the row did not test it, and fails)."""
    wait_for(lambda: any(text in s.cluster.log_tail(h, 10_000) for h in s.cluster.stores), timeout=timeout, what=what)


def _lose_every_store(s: Scenario) -> None:
    for h in s.hosts:
        s.cluster.kill(h)


def _restart_dead(s: Scenario) -> None:
    for h in s.hosts:
        if not s.cluster.stores[h].alive:
            s.cluster.restart(h)


# -- S3: moto behind a fault proxy ---------------------------------------------------------------------------
def _s3(s: Scenario) -> None:
    """The durable tier is S3 (moto on 127.0.0.1), reached through an HTTP fault proxy."""
    from tools.s3_proxy import S3FaultProxy
    from tools.s3_server import MotoServer, s3_env

    moto = MotoServer(s.workdir)
    s.on_close(moto.stop)
    moto.start(bucket="ckpt")
    proxy = S3FaultProxy(("127.0.0.1", moto.port)).start()
    s.on_close(proxy.close)
    s.services["s3"] = proxy
    s.use_spill("s3://ckpt/matrix", s3_env(proxy.endpoint))


def _throttle_then_power_cycle(s: Scenario) -> None:
    """S3 answers every 2nd request 503 SlowDown from now on; the ranks go on saving (and the stores spilling) through
    it, then every store is lost with its RAM: the restore reads S3, still throttled."""
    proxy = s.services["s3"]
    proxy.set("throttle", every=2)
    _keep_saving(s)
    _lose_every_store(s)
    if proxy.answered_503 == 0:
        raise RuntimeError("no S3 request was throttled: the row did not test throttling")


def _s3_down_then_lose_h0(s: Scenario) -> None:
    """S3 refuses connections; the ranks go on saving, then h0 is lost with its RAM and its replacement starts, S3
    still down."""
    s.services["s3"].set("down")
    _keep_saving(s)
    _wait_logged(s, "Could not connect to the endpoint URL", "a spill to fail on the S3 outage")
    s.cluster.kill("h0")
    s.cluster.restart("h0")


def _s3_back(s: Scenario) -> None:
    s.services["s3"].set("pass")


# -- DNS: the stores discover each other through a DNS server of the row's own ---------------------------------
def _dns_down_then_replace_h0(s: Scenario) -> None:
    """The DNS server stops answering (every query times out); the ranks go on saving; h0 is lost with its RAM and its
    replacement starts while DNS is still down: it waits for DNS."""
    assert s.dns is not None
    s.dns.zone.answering = False
    _keep_saving(s)
    _wait_logged(s, "membership discovery failed", "a store to see DNS fail")
    s.cluster.kill("h0")
    s.cluster.restart("h0", wait=False)
    wait_for(lambda: "waiting for --discovery" in s.cluster.log_tail("h0"), timeout=30, what="h0's replacement to wait for DNS")


def _dns_back(s: Scenario) -> None:
    assert s.dns is not None
    s.dns.zone.answering = True
    s.cluster.wait_healthy("h0", timeout=60)


FLAP_SECONDS = 0.3  # one answer, then the next
FLAPS_DURING_SAVES = 12  # about 4 s of saves under flapping: several discovery polls (every 0.5 s) see each answer


def _flap_dns(s: Scenario) -> None:
    """The DNS answer changes every 0.3 s, round and round: every store, all but the last, none (NXDOMAIN), only the
    first. The ranks go on saving through 12 changes; the flapping goes on through the restore, until the row ends."""
    hosts = list(s.hosts)
    answers = [hosts, hosts[:-1], [], hosts[:1]]
    stop = threading.Event()
    flips: list[int] = []
    failures: list[str] = []

    def flap() -> None:
        try:
            while True:
                s.cluster.publish_dns(answers[len(flips) % len(answers)])
                flips.append(1)
                if stop.wait(FLAP_SECONDS):
                    return
        except Exception as exc:
            failures.append(f"{type(exc).__name__}: {exc}")

    t = threading.Thread(target=flap, name="dns-flapper", daemon=True)

    def stop_flapping() -> None:
        stop.set()
        t.join(timeout=10)

    t.start()
    s.on_close(stop_flapping)
    _keep_saving(s, steps=4, timeout=60)
    wait_for(lambda: len(flips) >= FLAPS_DURING_SAVES or failures, timeout=30, what=f"{FLAPS_DURING_SAVES} DNS answers")
    if failures:
        raise RuntimeError(f"the DNS flapper failed: {failures[0]}")


# -- the kernel's OOM killer: h0's store in a memory cgroup of its own -----------------------------------------
BALLAST_MIB = 96  # a save this large needs a new segment of its size in h0's store
OOM_HEADROOM_MIB = 32  # what h0's store may still allocate once its cgroup limit is set


def _memcg_available() -> str | None:
    from tools.memcg import available

    return available()


def _oom_kill_h0(s: Scenario) -> None:
    """h0's store is moved into a memory cgroup whose limit leaves it 32 MiB; a 96 MiB save arrives (another job on
    its host) and the store's allocation for it exceeds the limit: the kernel's OOM killer SIGKILLs the store. Its
    segments stay in /dev/shm."""
    import torch

    from tools.memcg import MemoryCgroup
    from trainer_client import CheckpointClient, Connection

    sp = s.cluster.stores["h0"]
    assert sp.proc is not None
    cg = MemoryCgroup.create(f"memstore-matrix-{os.getpid()}-{s.workdir.name}"[:120])
    s.on_close(cg.remove)
    cg.add(sp.proc.pid)
    cg.limit(cg.usage() + OOM_HEADROOM_MIB * MIB)
    try:
        with CheckpointClient("ballast", 0, 1, connection=Connection(sp.address, timeout=10)) as client:
            client.save(1, {"ballast": torch.ones(BALLAST_MIB * MIB // 4)}).wait(timeout=30)
    except Exception:
        pass  # the store died under the save
    try:
        code = sp.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"h0's store survived a {BALLAST_MIB} MiB save with {OOM_HEADROOM_MIB} MiB under its cgroup limit") from None
    if code != -9 or cg.oom_kills() < 1:
        raise RuntimeError(f"h0's store exited with {code}, {cg.oom_kills()} OOM kills in its cgroup: not the kernel's OOM killer")


def _restart_h0(s: Scenario) -> None:
    s.cluster.restart("h0")


# -- the spill target really full: a tiny tmpfs ----------------------------------------------------------------
SPILL_FS_MIB = 8


def _can_mount_tmpfs() -> str | None:
    if os.geteuid() != 0:
        return f"mounting a tmpfs needs root (uid {os.geteuid()})"
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return "no mount/umount command"
    probe = tempfile.mkdtemp(prefix="memstore-tmpfs-probe-")
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", probe], capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            return f"mount -t tmpfs failed: {done.stderr.strip()[:200]}"
        subprocess.run(["umount", probe], capture_output=True, timeout=30, check=True)
        return None
    finally:
        os.rmdir(probe)


def _small_spill_fs(s: Scenario) -> None:
    """The durable tier (file://) is a tmpfs of 8 MiB of its own."""
    s.durable.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SPILL_FS_MIB}m", "tmpfs", str(s.durable)], check=True, timeout=30)

    def unmount() -> None:
        subprocess.run(["umount", "-l", str(s.durable)], check=True, timeout=30)

    s.on_close(unmount)


def _fill(path: Path) -> int:
    """Write zeros to ``path`` until the filesystem has no space left (ENOSPC); the bytes written."""
    written = 0
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                written += f.write(b"\0" * MIB)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                return written


def _fill_spill_fs_then_lose_h0(s: Scenario) -> None:
    """The spill target fills up (ENOSPC for every write from now on); the ranks go on saving; then h0 is lost with its RAM."""
    _fill(s.durable / "filler")
    _keep_saving(s)
    _wait_logged(s, "No space left on device", "a spill to fail with ENOSPC")
    s.cluster.kill("h0")


ENVIRONMENT_FAULTS: tuple[Fault, ...] = (
    Fault(
        id="s3-throttling",
        name="S3 throttling (503 SlowDown)",
        description="the durable tier is S3 (moto behind an HTTP proxy); every 2nd request is answered 503 SlowDown while "
        "the stores spill, then every store is lost with its RAM and the restore reads S3, still throttled",
        configs=(R1S, R2S),
        inject=_throttle_then_power_cycle,
        recover=_restart_dead,
        max_rpo=durable_only,
        setup=_s3,
    ),
    Fault(
        id="s3-outage",
        name="S3 outage, then a host lost",
        description="the durable tier is S3 (moto behind a proxy); the endpoint refuses connections while saves go on, "
        "then h0 is lost with its RAM and restarts; S3 comes back",
        configs=(R1S, R2S),
        inject=_s3_down_then_lose_h0,
        recover=_s3_back,
        max_rpo=one_copy_lost,
        setup=_s3,
    ),
    Fault(
        id="dns-outage",
        name="DNS outage",
        description="the stores discover each other through a DNS server, which stops answering while saves go on; h0 is "
        "lost with its RAM and its replacement waits for DNS, which comes back",
        configs=(R1S, R2, R3),
        inject=_dns_down_then_replace_h0,
        recover=_dns_back,
        max_rpo=one_copy_lost,
        hosts=lambda c: max(2, c.replicas),
        discovery="dns",
    ),
    Fault(
        id="dns-flapping",
        name="DNS flapping",
        description="the stores discover each other through a DNS server whose answer changes every 0.3 s (every store, "
        "all but one, none, only one) while saves go on and through the restore",
        configs=(R1, R2, R3),
        inject=_flap_dns,
        discovery="dns",
    ),
    Fault(
        id="store-oom-kill",
        name="Store OOM-killed by its cgroup limit",
        description="h0's store runs in a memory cgroup (needs root); a 96 MiB save exceeds its limit and the kernel's OOM "
        "killer SIGKILLs the store; it restarts and adopts its segments",
        configs=(R1, R2),
        inject=_oom_kill_h0,
        recover=_restart_h0,
        needs=_memcg_available,
    ),
    Fault(
        id="spill-enospc",
        name="Spill target full (ENOSPC)",
        description="the durable tier is a tmpfs of 8 MiB (needs root); it fills up (ENOSPC) while saves go on, then h0 is "
        "lost with its RAM and restarts",
        configs=(R1S, R2S),
        inject=_fill_spill_fs_then_lose_h0,
        recover=_restart_h0,
        max_rpo=one_copy_lost,
        needs=_can_mount_tmpfs,
        setup=_small_spill_fs,
    ),
)
