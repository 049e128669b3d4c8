"""The recovery matrix's network faults: partitions, a slow peer, bit flips on the wire, a clock jump.

Links are real TCP connections through fault proxies (:mod:`.links`, ``Fault.proxied``): a partition first stalls
them (silent: connections stay open and nothing arrives, as when packets are dropped), then resets and refuses them
(as a firewall that rejects); a slow peer's links carry 1% of what they carry unthrottled, bit flips
change bits of the bulk bytes (the data channel) in both directions. A clock jump moves one store's wall clock
(:mod:`tools.clockshift` preloaded, its offset file rewritten while it runs; its monotonic clock does not
jump, as with an NTP step).
"""

from __future__ import annotations

import time
from pathlib import Path

from tools import clockshift
from tools.recovery_matrix.fault import R1, R1S, R2, R2S, R3, Fault, one_copy_lost
from tools.recovery_matrix.links import Link, set_links, unthrottled_rate
from tools.recovery_matrix.scenario import Scenario

PARTITION_SECONDS = 3.0  # how long a partition (or a slow or flipping link) lasts while every rank keeps saving
SLOW_KIB = 2048  # the slow-peer row's state per rank (about 3 MiB): a copy at 1% takes longer than a step
FLIP_EVERY = 256 << 10  # one bit flipped in every 256 KiB of a link: some copies of a 64 KiB-state row hit, others not


def _hold(seconds: float = PARTITION_SECONDS) -> None:
    """The fault lasts this long while the ranks keep saving (the runner stops them after inject)."""
    time.sleep(seconds)


# -- partitions -------------------------------------------------------------------------------------
def _partition(links: list[Link]) -> None:
    """Nothing crosses ``links`` (gRPC and data channel): first silently (connections hang, as when packets are
    dropped), then refused (the connections are reset and new ones refused, as when a firewall rejects them)."""
    set_links(links, "stall")
    _hold(PARTITION_SECONDS / 2)
    set_links(links, "cut")
    _hold(PARTITION_SECONDS / 2)


def _partition_h0(s: Scenario) -> None:
    """h0 and its peers stop reaching each other, both ways."""
    _partition(s.links.of_host("h0"))


def _partition_then_heal(s: Scenario) -> None:
    _partition_h0(s)
    set_links(s.links.of_host("h0"), "pass")


def _partition_then_lose_h0(s: Scenario) -> None:
    """h0 is lost (its RAM with it) while partitioned: what it alone held was never committed."""
    _partition_h0(s)
    s.cluster.kill("h0")


def _restart_h0(s: Scenario) -> None:
    s.cluster.restart("h0")


def _heal_and_restart_h0(s: Scenario) -> None:
    set_links(s.links.of_host("h0"), "pass")
    s.cluster.restart("h0")


def _client_partition(s: Scenario) -> None:
    """Rank 0 cannot reach its store (gRPC and data channel) while it saves; then the link heals."""
    _partition([s.links.clients[0]])
    set_links([s.links.clients[0]], "pass")


# -- a slow peer ------------------------------------------------------------------------------------
def _slow_peer_then_lose_h0(s: Scenario) -> None:
    """Every link into h1, h0's replica target, runs at 1% of what it carries unthrottled; then h0 is lost, and its
    restart pulls back over the slow link."""
    rate = max(1, unthrottled_rate() // 100)
    set_links([link for (a, b), link in s.links.stores.items() if b == "h1"], "slow", rate=rate)
    _hold()
    s.cluster.kill("h0")


# -- bit flips on the wire --------------------------------------------------------------------------
def _flip_bits_then_lose_h0(s: Scenario) -> None:
    """Bits flip on h0's data channel links, both ways, while every rank saves; then h0 is lost and its restart
    pulls its copies back over the same flipping links: every flipped copy must be refused by its checksums."""
    links = s.links.of_host("h0")
    set_links(links, "corrupt", every=FLIP_EVERY, direction="both", data_only=True)
    _hold()
    if not any(link.data is not None and link.data.corrupted for link in links):
        raise RuntimeError("no bit was flipped: no copy crossed h0's data channel links")
    s.cluster.kill("h0")


# -- a clock jump -----------------------------------------------------------------------------------
def _clock_file(s: Scenario) -> Path:
    return s.workdir / "h0.clock-offset"  # seconds h0's wall clock is off by


def _shiftable_clock(s: Scenario) -> None:
    """h0's store starts with its wall clock following a file (tools.clockshift), at 0 for now."""
    lib = clockshift.build(s.workdir)
    clockshift.set_offset(_clock_file(s), 0)
    s.cluster.stores["h0"].env.update(clockshift.preload_env(lib, _clock_file(s)))


def _jump_clock(s: Scenario) -> None:
    """h0's wall clock jumps 1 h ahead while every rank saves, then 2 h back (1 h behind); it stays there."""
    proc = s.cluster.stores["h0"].proc
    lib = Path(s.cluster.stores["h0"].env.get("LD_PRELOAD", "-"))
    if proc is None or not clockshift.loaded(proc.pid, lib):
        raise RuntimeError(f"the clock-jump library {lib} is not loaded in h0's store process: its clock cannot jump")
    for seconds in (3600, -3600):
        clockshift.set_offset(_clock_file(s), seconds)
        _hold(PARTITION_SECONDS / 2)


NETWORK_FAULTS: tuple[Fault, ...] = (
    Fault(
        id="store-partition",
        name="Store-to-store partition, healed",
        description=f"h0 and its peers cannot reach each other (every link between them, gRPC and data channel, stalls, then refuses) "
        f"for {PARTITION_SECONDS:g} s while every rank saves; then the partition heals",
        configs=(R2, R2S, R3),
        inject=_partition_then_heal,
        proxied=("stores",),
    ),
    Fault(
        id="store-partition-lost",
        name="Store-to-store partition, then the isolated host lost",
        description=f"h0 is partitioned from its peers for {PARTITION_SECONDS:g} s while every rank saves, then lost "
        "with its RAM while still cut off; it restarts empty once the network heals",
        configs=(R1S, R2, R2S, R3),
        inject=_partition_then_lose_h0,
        recover=_heal_and_restart_h0,
        max_rpo=one_copy_lost,
        proxied=("stores",),
    ),
    Fault(
        id="client-partition",
        name="Client-to-store partition",
        description=f"rank 0 saves over the network (no shared memory) and cannot reach its store (gRPC and data "
        f"channel stall, then refuse) for {PARTITION_SECONDS:g} s; then the link heals",
        configs=(R1, R2, R2S),
        inject=_client_partition,
        proxied=("clients",),
    ),
    Fault(
        id="slow-peer",
        name="Slow peer (1% bandwidth)",
        description=f"every link into h1, h0's replica target, carries 1% of what it carries unthrottled (measured "
        f"first) for {PARTITION_SECONDS:g} s while every rank saves a {SLOW_KIB} KiB state; then h0 is lost with its "
        "RAM and restarts over the slow link",
        configs=(R2, R2S, R3),
        inject=_slow_peer_then_lose_h0,
        recover=_restart_h0,
        max_rpo=one_copy_lost,
        proxied=("stores",),
        kib=SLOW_KIB,
    ),
    Fault(
        id="wire-bit-flip",
        name="Bit flip on the wire",
        description=f"one bit in every {FLIP_EVERY >> 10} KiB of the bulk bytes on h0's data channel links flips, "
        f"both ways, for {PARTITION_SECONDS:g} s of saves and through h0's loss and restart: its restore pulls over "
        "the flipping links",
        configs=(R2, R3),
        inject=_flip_bits_then_lose_h0,
        recover=_restart_h0,
        max_rpo=one_copy_lost,
        proxied=("stores",),
    ),
    Fault(
        id="clock-jump",
        name="Clock jump",
        description="h0's wall clock jumps 1 h ahead, then 2 h back, while every rank saves (an LD_PRELOAD library shifts "
        "CLOCK_REALTIME; its monotonic clock runs on, as with an NTP step)",
        configs=(R1, R2, R2S),
        inject=_jump_clock,
        setup=_shiftable_clock,
    ),
)
