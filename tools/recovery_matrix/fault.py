"""What a fault of the recovery matrix is: one declarative :class:`Fault`, and the configurations and RPO promises
the catalogues (:mod:`.catalogue`, :mod:`.faults_network`, :mod:`.faults_environment`) build theirs from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tools.recovery_matrix.scenario import Config, Scenario

R1, R2, R3 = (Config(1, False), Config(2, False), Config(3, False))
R1S, R2S, R3S = (Config(1, True), Config(2, True), Config(3, True))
EC41, EC41S = (Config(1, False, "ec:4+1"), Config(1, True, "ec:4+1"))  # one group of five stores: parity survives one loss
# Steps the durable tier may trail RAM by: the spiller looks for new steps every 0.5 s, then writes them; at a step
# every 0.25 s (scenario.STEP_SECONDS) on a busy 2-core machine that has been up to 1.5 s.
SPILL_LAG = 6


def nothing(s: Scenario) -> None:
    return None


def anywhere() -> str | None:
    return None


class NotRunHere(Exception):
    """This machine lacks what a fault needs (root, a kernel feature): its rows are not run, and say why."""


def lossless(c: Config) -> int | None:
    return 0


def one_copy_lost(c: Config) -> int | None:
    """A fault that takes the RAM of one host: nothing lost while another copy or the parity exists (R >= 2, ec:K+M),
    else the durable tier's lag (R=1, spill on), else everything (R=1, spill off)."""
    if c.scheme.survives >= 1:
        return 0
    return SPILL_LAG if c.spill else None


def durable_only(c: Config) -> int | None:
    return SPILL_LAG if c.spill else None


def default_hosts(c: Config) -> int:
    """Two hosts, or one group of the configuration's scheme (R, or K+M)."""
    return max(2, c.scheme.group_size)


@dataclass(frozen=True)
class Fault:
    id: str
    name: str
    description: str
    configs: tuple[Config, ...]
    inject: Callable[[Scenario], None]
    recover: Callable[[Scenario], None] = nothing
    max_rpo: Callable[[Config], int | None] = lossless
    hosts: Callable[[Config], int] = default_hosts
    store_env: dict[str, dict[str, str]] = field(default_factory=dict)  # host -> its store's environment from the start
    discovery: str = "peers"  # how the stores learn their peers: a fixed list, or a peers file ("file": hosts can be replaced)
    # ... or a DNS server of the cluster's own ("dns": Scenario.dns)
    needs: Callable[[], str | None] = anywhere  # None if this machine can run the fault, else why not (e.g. "needs root")
    # Links through fault proxies (.links): "stores": every store-to-store link; "clients": every rank saves over the
    # network (no shared memory) through a link to its store. Its inject then acts on s.links.
    proxied: tuple[str, ...] = ()
    setup: Callable[[Scenario], None] = nothing  # before any process starts (e.g. the spill target on a tiny tmpfs)
    kib: int = 0  # each rank's state in KiB (0: scenario.KIB); a fault that needs bigger copies says so in its description
