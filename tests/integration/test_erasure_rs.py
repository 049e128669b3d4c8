"""Reed-Solomon redundancy (``--redundancy ec:4+2``, issue 42) on six in-process stores, one rank per store.

Two parities per row: saves commit once both cover them, each store holds its own shards whole plus about half of one
in parity per kept step, any two stores of the group may be lost (one after the other, or together) and every rank
still restores bit-exactly, and a third loss is reported unrestorable from RAM. A parity fragment that is corrupt is
never used: dropped when its own checksums fail, set aside by the rebuild when it passes them but solves a shard that
fails the manifest's. (``ec:4+1`` and its XOR parity: ``test_erasure.py``.)
"""

from __future__ import annotations

import pytest

from memstore.core.erasure_layout import BLOCK
from memstore.testing import LocalCluster, wait_for
from memstore.v1.integrity import checksum
from tests.harness import erasure
from tests.harness.erasure import shm_bytes
from tests.states import assert_same, rank_state
from trainer_client import CheckpointClient
from trainer_client.errors import NoCheckpointError

pytestmark = pytest.mark.integration

JOB = "rs-job"
HOSTS = WORLD = 6
KEEP = 2
SCALE = 230  # about 3.7 MB a rank: four blocks, one in each of its four data rows, the last one short
REDUNDANCY = "ec:4+2"


def clients(cluster: LocalCluster, ranks: range | list[int] = range(WORLD), via: str = "") -> list[CheckpointClient]:
    return erasure.clients(cluster, JOB, WORLD, ranks, via)


def save_steps(cluster: LocalCluster, steps: range) -> list[int]:
    return erasure.save_steps(cluster, JOB, WORLD, SCALE, steps)


def restores(cluster: LocalCluster, step: int, ranks: dict[int, str]) -> None:
    """Every rank in ``ranks`` (rank -> the store its client talks to) restores ``step`` bit-exactly."""
    for rank, host in ranks.items():
        (c,) = clients(cluster, [rank], via=host)
        try:
            assert c.latest_step() == step
            assert_same(c.load(), rank_state(rank, step, scale=SCALE))
        finally:
            c.close()


def fragment(cluster: LocalCluster, host: str, step: int, row: int):  # type: ignore[no-untyped-def]
    """``host``'s parity fragment of ``row`` of ``step``."""
    keeper = cluster.servers[host].store.parity
    ((_, f),) = [(v, f) for (v, r), f in keeper._fragments.items() if v[0] == JOB and v[1] == step and r == row]
    return f


def test_ec_4_2_survives_two_losses_one_after_the_other_and_together(make_inprocess_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_inprocess_cluster(hosts=HOSTS, redundancy=REDUNDANCY, capacity="256MiB", keep=KEEP)
    assert all(cluster.servers[h].store.heap_tuned for h in cluster.stores)  # Reed-Solomon: freed blocks stay in the heap
    state = max(save_steps(cluster, range(1, 4)))
    assert state > 3 * BLOCK

    # Each store holds its kept steps' shards (its rank's ring: keep segments, the next save takes the oldest's) and per
    # kept step two fragments of a quarter each (counted as the bench counts: test_erasure.shm_bytes): keep + keep/2.
    fragment_bytes = -(-state // (4 * BLOCK)) * BLOCK
    bound = KEEP * state + KEEP * 2 * fragment_bytes + 0.05 * state
    for host in cluster.stores:
        wait_for(lambda host=host: shm_bytes(cluster, host) <= bound, timeout=10, what=f"{host} to settle within {bound / state:.2f}x")

    # One loss, replaced: the replacement rebuilds its kept steps and refills the two fragments it keeps (rows 0 and 1,
    # whose data hosts are 2, 3, 4, 5 and 0, 3, 4, 5), without a client.
    cluster.kill("h1")
    cluster.restart("h1")
    store = cluster.servers["h1"].store
    wait_for(lambda: {k.step for k, _, _ in store.catalog.held(JOB) if k.rank == 1} >= {2, 3}, timeout=30, what="h1 to rebuild its steps")
    refilled = {(step, rank, row) for step in (2, 3) for row, ranks in ((0, (2, 3, 4, 5)), (1, (0, 3, 4, 5))) for rank in ranks}
    wait_for(
        lambda: {(k.step, k.rank, i.parity.row) for i in store.parity.listing(JOB) if i.parity for k in [i.manifest.key]} >= refilled,
        timeout=30,
        what="h1 to refill its parity",
    )
    assert store.rebuilder is not None and store.rebuilder.rebuilt >= 2

    # Then two more at once: every row lost two of its six columns, which its two parities solve (the refilled ones too).
    cluster.kill("h4")
    cluster.kill("h5")
    restores(cluster, 3, {0: "h0", 1: "h1", 2: "h2", 3: "h3", 4: "h0", 5: "h2"})
    assert cluster.servers["h0"].store.rebuilder.rebuilt >= 1 and cluster.servers["h2"].store.rebuilder.rebuilt >= 1


def test_three_losses_in_an_ec_4_2_group_are_unrestorable_from_ram(make_inprocess_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_inprocess_cluster(hosts=HOSTS, redundancy=REDUNDANCY, capacity="256MiB", keep=KEEP)
    save_steps(cluster, range(1, 2))
    for host in ("h1", "h3", "h5"):
        cluster.kill(host)
    cs = clients(cluster, [0, 2, 4])
    try:
        for c in cs:
            assert c.latest_step() is None  # M=2: three shards gone, not a wrong or partial step
            with pytest.raises(NoCheckpointError):
                c.load()
    finally:
        for c in cs:
            c.close()


def test_a_corrupt_parity_is_never_used_by_an_ec_4_2_rebuild(make_inprocess_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_inprocess_cluster(hosts=HOSTS, redundancy=REDUNDANCY, capacity="256MiB", keep=KEEP)
    save_steps(cluster, range(1, 2))
    # Rank 2's four blocks lie in rows 0, 3, 4, 5 at position 0. Row 0's first parity (on h0) goes wrong under valid
    # checksums (as if a contribution was made from bytes that changed after they were checksummed); row 3's first
    # parity (on h3) has a bit flip its own checksums catch.
    wrong = fragment(cluster, "h0", 1, 0)
    block = wrong.block(0)
    block[100] ^= 0x01
    wrong.sums[0] = checksum(block)
    fragment(cluster, "h3", 1, 3).block(0)[200] ^= 0x10

    cluster.kill("h2")
    restores(cluster, 1, {2: "h1"})  # rebuilt on h1 from the other parities, bit-exact
    rebuilder = cluster.servers["h1"].store.rebuilder
    assert rebuilder.rebuilt == 1 and rebuilder.set_aside == 1  # row 0 solved again with h1's parity
    assert cluster.servers["h3"].store.parity.corrupt == 1  # h3 dropped its fragment when it was read: repair refills it
    # The dropped fragment comes back from row 3's data hosts that are alive (h0, h1, h5; h2's slot is vacant) and verifies.
    keeper = cluster.servers["h3"].store.parity
    wait_for(lambda: len([i for i in keeper.listing(JOB) if i.parity and i.parity.row == 3]) == 3, timeout=30, what="h3 to refill row 3")
    contributors, _ = keeper.read((JOB, 1, wrong.version[2]), 3, 0, 1)
    assert sorted(i.manifest.key.rank for i in contributors) == [0, 1, 5]
