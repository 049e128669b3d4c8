"""The recovery matrix's erasure-coding faults (``--redundancy ec:4+1``, issue 42): two losses in one group, a loss
while contributions are in flight, a corrupted parity fragment. (A single host's loss under ec:4+1 is a configuration
of the catalogue's ``host-loss``.)

Each row runs one group of five stores, one rank per store. A rank's 64 KiB state is one block, which goes to the
first of its host's data rows: for h0, row 1, whose parity fragment h1 keeps; for h1..h4, row 0, whose parity h0 keeps
(``docs/erasure.md``). With M=1 a group survives one loss; a second one in the same row (another host, or its parity
found corrupt) loses the shards that row protected, which the restore must report as nothing restorable from RAM
(not a hang, not a wrong or partial step) and the durable tier then serves.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from memstore.server.memory.shm_dirs import sidecar_path
from memstore.testing import wait_for
from tools.recovery_matrix.fault import EC41, EC41S, Fault, durable_only, one_copy_lost
from tools.recovery_matrix.scenario import Scenario, flip_every_page

# h0 kills itself at its 8th contribution: step 8's, once the 6 steps the matrix waits for are committed
# (``run_row(steps=6)``, the default) and while the other stores' contributions of step 8 are on their way to it.
KILLED_AT_CONTRIBUTION = 8


def _lose_h0_h1(s: Scenario) -> None:
    """Two hosts of the one group, their RAM with them: rank 0's and rank 1's shards had no other copy."""
    s.cluster.kill("h0")
    s.cluster.kill("h1")


def _lose_h0_mid_contribution(s: Scenario) -> None:
    """Wait for h0's store to SIGKILL itself at the fault point, then lose its shared memory (the host is gone; a crash
    that kept it would be adopted, a different row)."""
    sp = s.cluster.stores["h0"]
    wait_for(lambda: not sp.alive, timeout=60, interval=0.05, what=f"h0 to die at its contribution {KILLED_AT_CONTRIBUTION}")
    shutil.rmtree(s.cluster.segment_dir("h0"), ignore_errors=True)


def _corrupt_parity_of_h1(s: Scenario) -> None:
    """Flip one byte of every 4 KiB page of every segment of h1 that holds no shard (no sidecar: its parity fragments,
    and spare segments, which are written whole before use), then lose h0, whose shards only that parity protects."""
    s.stop_workers()  # nothing is being written into h1's segments meanwhile
    for path in sorted(Path(s.cluster.segment_dir("h1")).glob("seg-*")):
        if os.path.exists(sidecar_path(str(path))):
            continue
        flip_every_page(path)
    s.cluster.kill("h0")


def _restart_dead(s: Scenario) -> None:
    for h in s.hosts:
        if not s.cluster.stores[h].alive:
            s.cluster.restart(h)


def _replace_h0(s: Scenario) -> None:
    """h0's replacement: empty, and without the fault point."""
    s.cluster.restart("h0", env={})


ERASURE_FAULTS: tuple[Fault, ...] = (
    Fault(
        id="ec-two-losses",
        name="Two hosts of one erasure-coded group lost",
        description="h0 and h1 of one ec:4+1 group are lost at once with their RAM: more than M=1, so rank 0's and rank 1's "
        "steps are reported unrestorable from RAM (nothing restorable, not a hang or a wrong step) and the durable tier serves",
        configs=(EC41, EC41S),
        inject=_lose_h0_h1,
        recover=_restart_dead,
        max_rpo=durable_only,
    ),
    Fault(
        id="ec-loss-during-parity",
        name="Host lost while parity is computed",
        description=f"h0's store SIGKILLs itself about to send its contribution of step 8 (MEMSTORE_FAULTS "
        f"contribute.before_send:{KILLED_AT_CONTRIBUTION}=kill) while the other four send theirs of step 8 to it; its RAM is "
        "lost and an empty replacement starts: step 7, the newest every rank committed, comes back, rank 0's shard rebuilt "
        "from the survivors",
        configs=(EC41,),
        inject=_lose_h0_mid_contribution,
        recover=_replace_h0,
        max_rpo=one_copy_lost,
        store_env={"h0": {"MEMSTORE_FAULTS": f"contribute.before_send:{KILLED_AT_CONTRIBUTION}=kill"}},
    ),
    Fault(
        id="ec-corrupt-parity",
        name="Corrupted parity fragment, then a host lost",
        description="one byte of every page of h1's parity fragments is flipped, then h0 is lost: rank 0's shards, which "
        "only that parity protects, are never rebuilt from it: read before the scrub's next pass reaches it (--scrub-interval, "
        "60 s), each fragment fails its block checksums and is dropped; nothing restorable from RAM (a second loss in the row "
        "for M=1), the durable tier serves",
        configs=(EC41, EC41S),
        inject=_corrupt_parity_of_h1,
        recover=_restart_dead,
        max_rpo=durable_only,
    ),
)
