"""Erasure-coded redundancy (``--redundancy ec:4+1``, issue 42) on five in-process stores, one rank per store.

Saves commit once their parity covers them, each store holds its own shards whole plus about a quarter of one in
parity per kept step, a replacement rebuilds its lost shards from the four survivors bit-exactly, and two losses in
one group are reported unrestorable from RAM instead of restoring a wrong or partial step.
"""

from __future__ import annotations

import threading

import pytest

from memstore import survey
from memstore.core.erasure_layout import BLOCK
from memstore.testing import LocalCluster, wait_for
from memstore.v1.integrity import first_mismatch
from tests.harness import erasure
from tests.harness.erasure import shm_bytes
from tests.states import assert_same, rank_state
from tools.thread_ranks import on_every_rank
from trainer_client import CheckpointClient, Connection
from trainer_client.errors import NoCheckpointError, NotFoundError
from trainer_client.serialization import decode

pytestmark = pytest.mark.integration

JOB = "ec-job"
HOSTS = WORLD = 5
KEEP = 2
SCALE = 230  # about 3.7 MB a rank: four blocks, one in each of its data rows, the last one short


def clients(cluster: LocalCluster, ranks: range | list[int] = range(WORLD)) -> list[CheckpointClient]:
    return erasure.clients(cluster, JOB, WORLD, ranks)


def lose_h2_then_restore(cluster, step: int) -> None:  # type: ignore[no-untyped-def]
    """SIGKILL-like loss of h2 and its replacement (same id and address, empty RAM); every rank restores ``step``
    bit-exactly, rank 2's shard rebuilt from the other four stores."""
    cluster.kill("h2")
    cluster.restart("h2")
    cs = clients(cluster)
    try:
        assert {c.latest_step() for c in cs} == {step}
        for c in cs:
            assert_same(c.load(), rank_state(c.rank, step, scale=SCALE))
    finally:
        for c in cs:
            c.close()


def save_steps(cluster: LocalCluster, steps: range) -> list[int]:
    return erasure.save_steps(cluster, JOB, WORLD, SCALE, steps)


def test_ec_saves_commit_hold_a_quarter_more_and_a_replacement_rebuilds(make_inprocess_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_inprocess_cluster(hosts=HOSTS, redundancy="ec:4+1", capacity="256MiB", keep=KEEP)
    sizes = save_steps(cluster, range(1, 4))
    state = max(sizes)
    assert state > 3 * BLOCK

    # After saves settle each store holds its kept steps' shards (its rank's capture ring: keep segments, the third save
    # took the first one's) and, per kept step, a quarter of a part in parity (here one block per row); no spare, no
    # parity spare and no reserve beside them (docs/erasure.md, "RAM"): about 2.6x here, within the bound of
    # 1.25 x keep + 0.75 (3.25x), which a ring keeping a spare for the next save (a whole shard more) breaks.
    bound = (1.25 * KEEP + 0.75) * state
    for host in cluster.stores:
        wait_for(lambda host=host: shm_bytes(cluster, host) <= bound, timeout=10, what=f"{host} to settle within {bound / state:.2f}x")
    recycled = [cluster.servers[h].store.recycler for h in cluster.stores]
    assert all(r is not None and r.recycled == 1 for r in recycled)  # each rank's step 1 went when its step 3 started

    # Status and ls say how the steps are protected: one copy of each rank and its parity from every parity host.
    seen = survey.take(cluster.address("h0"), timeout=5.0, job=JOB)
    (job,) = survey.jobs_of(seen)
    assert (job["redundancy"], job["parity_complete"], job["steps_in_ram"], job["copies_of_state"]) == ("ec:4+1", True, KEEP, 1.0)
    assert job["ram_multiple"] is not None and job["ram_bytes"] > job["copies_bytes"]  # the parity counts in RAM, not as copies
    steps = survey.steps_of(seen, JOB)
    assert [(r["step"], r["min_copies"], r["redundancy"], r["parity_complete"]) for r in steps] == [
        (3, 1, "ec:4+1", True),
        (2, 1, "ec:4+1", True),
    ]

    lose_h2_then_restore(cluster, 3)
    store = cluster.servers["h2"].store
    assert store.rebuilder is not None and store.rebuilder.rebuilt >= 1  # nobody held a copy of rank 2's shard: rebuilt
    # Repair rebuilds the replacement's other kept step and refills the parity fragments it keeps, without a client.
    wait_for(lambda: {k.step for k, _, _ in store.catalog.held(JOB) if k.rank == 2} >= {2, 3}, timeout=30, what="h2 to rebuild its steps")
    refilled = {(step, rank) for step in (2, 3) for rank in (0, 1, 3, 4)}  # h2 keeps row 2's parity: of h0, h1, h3 and h4
    wait_for(lambda: {(k.step, k.rank) for k, _ in store.parity.versions(JOB)} >= refilled, timeout=30, what="h2 to refill its parity")
    # Its parity is whole again: losing another store now loses nothing (the refilled fragment rebuilds with the rest).
    cluster.kill("h4")
    c = CheckpointClient(JOB, 4, WORLD, connection=Connection(cluster.address("h0"), timeout=20.0))
    try:
        assert_same(c.load(3), rank_state(4, 3, scale=SCALE))
    finally:
        c.close()


def test_a_restore_of_the_oldest_kept_step_keeps_its_segment_while_the_next_save_takes_another(make_inprocess_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_inprocess_cluster(hosts=HOSTS, redundancy="ec:4+1", capacity="256MiB", keep=KEEP)
    cs = clients(cluster)

    def save(step: int) -> None:
        for h in [c.save(step, rank_state(c.rank, step, scale=SCALE)) for c in cs]:
            assert h.wait(timeout=30).state == "committed"
        erasure.learnt(cluster, JOB, step)  # the next save may take step - 1's segment (no process group: listed)

    store = cluster.servers["h0"].store
    assert store.recycler is not None
    try:
        save(1)
        save(2)
        (one,) = [k for k, _, _ in store.catalog.held(JOB) if k.step == 1]
        lease, entry = store.open(one, transient=True)  # a restore of rank 0's step 1 reads it (its Open's lease)
        try:
            save(3)  # rank 0's ring is full: its step 1 is being read, so step 3 gets another segment
            (three,) = [k for k, _, _ in store.catalog.held(JOB) if k.step == 3]
            held = store.catalog.get(three)
            assert held is not None and held.segment is not entry.segment
            assert (store.recycler.recycled, store.recycler.refused) == (0, 1)
            # What the restore reads is still step 1, every chunk (retention may have dropped the step by now, once step
            # 3 committed: its segment stays until the lease ends).
            m = entry.manifest
            assert m is not None and first_mismatch(entry.segment.view(m.nbytes), m.nbytes, m.chunk_size, m.checksums) is None
            assert_same(decode(bytes(entry.segment.view(m.nbytes))), rank_state(0, 1, scale=SCALE))
        finally:
            store.release(lease)
        # The other ranks' step 3 took their step 1's segment.
        assert [cluster.servers[f"h{r}"].store.recycler.recycled for r in range(1, WORLD)] == [1] * (WORLD - 1)  # type: ignore[union-attr]
    finally:
        for c in cs:
            c.close()


def test_with_a_process_group_each_saves_allocate_carries_its_own_agreement_and_recycles(make_inprocess_cluster) -> None:  # type: ignore[no-untyped-def]
    # Ranks that share a process group (the default under torchrun) agree at each save on the newest step all of them
    # committed, and the save waits (briefly) for that agreement before its Allocate: step 3's Allocate says that every
    # rank committed step 2, so step 3 takes step 1's segment at once, with no wait between saves and no listing.
    cluster = make_inprocess_cluster(hosts=HOSTS, redundancy="ec:4+1", capacity="256MiB", keep=KEEP)
    floors: dict[str, list[tuple[int, int | None]]] = {h: [] for h in cluster.stores}
    for host in cluster.stores:
        store = cluster.servers[host].store
        allocate = store.allocate

        def spy(key, *args, allocate=allocate, seen=floors[host], **kwargs):  # type: ignore[no-untyped-def]
            seen.append((key.step, kwargs.get("restorable_floor")))  # (a reservation ahead names step 0)
            return allocate(key, *args, **kwargs)

        store.allocate = spy

    def saves(rank: int, group: object) -> None:
        connection = Connection(cluster.address(f"h{rank}"), timeout=20.0)
        with CheckpointClient(JOB, rank, WORLD, connection=connection, group=group) as c:
            for step in (1, 2, 3):
                assert c.save(step, rank_state(rank, step, scale=SCALE)).wait(timeout=30).state == "committed"

    results, _ = on_every_rank(WORLD, saves, timeout=60)
    assert [r for r in results if isinstance(r, BaseException)] == []
    assert all((3, 2) in floors[h] for h in cluster.stores), floors  # this save's agreement, not the one before
    assert [cluster.servers[h].store.recycler.recycled for h in cluster.stores] == [1] * WORLD  # type: ignore[union-attr]


def test_a_save_keeps_the_oldest_kept_step_while_another_ranks_save_of_the_newest_is_in_flight(make_inprocess_cluster, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Rank 0 committed step 3 and saves step 4 while rank 1's save of step 3 is still being encoded: step 2 is then the
    # newest step every rank can restore after a loss, so rank 0's step 4 must not take step 2's segment. Rank 1's store
    # is lost before its step 3 commits: every rank restores step 2 from RAM (rank 1's rebuilt from the survivors).
    cluster = make_inprocess_cluster(hosts=HOSTS, redundancy="ec:4+1", capacity="256MiB", keep=KEEP)
    save_steps(cluster, range(1, 3))
    erasure.learnt(cluster, JOB, 2)  # (without a process group) the next save may take step 1's segment
    release = threading.Event()
    encoder = cluster.servers["h1"].store.encoder
    send = encoder._send_one

    def held_back(s):  # type: ignore[no-untyped-def]
        if s.manifest.key.step == 3:
            release.wait(30)  # rank 1's contributions to step 3's parity wait (a slow or busy store)
        return send(s)

    monkeypatch.setattr(encoder, "_send_one", held_back)
    h0 = cluster.servers["h0"].store
    cs = clients(cluster)
    try:
        handles = [c.save(3, rank_state(c.rank, 3, scale=SCALE)) for c in cs]
        for rank, h in enumerate(handles):
            if rank != 1:
                assert h.wait(timeout=30).state == "committed"
        assert h0.recycler is not None and h0.recycler.recycled == 1  # step 3 took step 1's segment: step 2 restorable
        assert cs[0].save(4, rank_state(0, 4, scale=SCALE)).wait(timeout=30).state == "committed"
        assert h0.recycler.recycled == 1  # rank 0's step 3 is committed, rank 1's is not: step 2 stayed
        listed = h0.janitor.listings
        wait_for(lambda: h0.janitor.listings >= listed + 2, timeout=10, what="h0's retention to list the cluster since")
        assert {k.step for k, _, _ in h0.catalog.held(JOB)} == {2, 3, 4}  # nor did retention drop it
    finally:
        for c in cs:
            c.close()
    cluster.kill("h1")  # lost before its step 3 committed
    release.set()
    cluster.restart("h1")  # the replacement: same id and address, empty RAM
    cs = clients(cluster)
    try:
        assert {c.latest_step() for c in cs} == {2}
        for c in cs:
            assert_same(c.load(2), rank_state(c.rank, 2, scale=SCALE))  # rank 1's shard rebuilt from the other four stores
    finally:
        for c in cs:
            c.close()


def test_at_keep_1_a_store_settles_within_2x_and_every_rank_restores_the_newest_step_after_a_loss(make_inprocess_cluster) -> None:  # type: ignore[no-untyped-def]
    # --keep 1: the ring keeps no spare (docs/erasure.md, "RAM"). Each save takes a fresh segment beside the kept step,
    # which stays held until retention drops it (the new step committed); its segment then goes back to the kernel.
    # Settled: the kept step and its parity (about 1.27x here), within the 1.25 x keep + 0.75 = 2.0x, which a
    # spare segment (2.27x) breaks.
    cluster = make_inprocess_cluster(hosts=HOSTS, redundancy="ec:4+1", capacity="256MiB", keep=1)
    h0 = cluster.servers["h0"].store
    held_at_allocate: list[set[int]] = []
    allocate = h0.allocate

    def spy(key, *args, **kwargs):  # type: ignore[no-untyped-def]
        got = allocate(key, *args, **kwargs)
        held_at_allocate.append({k.step for k, _, _ in h0.catalog.held(JOB) if k.rank == 0 and k.step != key.step})
        return got

    h0.allocate = spy  # type: ignore[method-assign]
    cs = clients(cluster)  # connected throughout, as a trainer's: each maps its ring between saves
    try:
        sizes = []
        for step in (1, 2, 3):
            for h in [c.save(step, rank_state(c.rank, step, scale=SCALE)) for c in cs]:
                info = h.wait(timeout=30)
                assert (info.state, info.copies) == ("committed", 1)
                sizes.append(info.nbytes)
            for host in cluster.stores:  # retention drops the step before (a trainer's next save comes a training step later)
                store = cluster.servers[host].store
                wait_for(lambda store=store, step=step: {k.step for k, _, _ in store.catalog.held(JOB)} == {step}, timeout=10,
                         what=f"{host} to keep step {step} only")  # fmt: skip
        assert held_at_allocate == [set(), {1}, {2}]  # each save's segment came while the newest committed step was held
        state = max(sizes)
        bound = 2.0 * state
        for host in cluster.stores:
            wait_for(lambda host=host: shm_bytes(cluster, host) <= bound, timeout=10, what=f"{host} to settle within 2.0x")
        for host in cluster.stores:
            store = cluster.servers[host].store
            assert (store.recycler, store.pool.ring_limit, store.pool.ring_overflows) == (None, 1, 0)
    finally:
        for c in cs:
            c.close()

    lose_h2_then_restore(cluster, 3)


def test_two_losses_in_one_group_are_unrestorable_from_ram(make_inprocess_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_inprocess_cluster(hosts=HOSTS, redundancy="ec:4+1", capacity="256MiB", keep=KEEP)
    save_steps(cluster, range(1, 2))
    cluster.kill("h1")
    cluster.kill("h3")
    cs = clients(cluster, [0, 2, 4])
    try:
        for c in cs:
            assert c.latest_step() is None  # M=1: rank 1's and rank 3's shards are gone, not a wrong or partial step
            with pytest.raises(NoCheckpointError):
                c.load()
    finally:
        for c in cs:
            c.close()


def test_a_corrupt_parity_fragment_is_refilled_from_the_data_hosts_or_reported(make_inprocess_cluster) -> None:  # type: ignore[no-untyped-def]
    flags = ["--scrub-rate", "1GiB", "--scrub-interval", "0.1", "--repair-interval", "0.2"]
    cluster = make_inprocess_cluster(hosts=HOSTS, redundancy="ec:4+1", capacity="256MiB", keep=KEEP, extra_args=flags)
    save_steps(cluster, range(1, 3))
    keeper = cluster.servers["h0"].store.parity  # row 0's parity: the first block of h1, h2, h3 and h4

    def row0(step: int):  # type: ignore[no-untyped-def]
        return next(f for (v, row), f in keeper._fragments.items() if v[1] == step and row == 0 and not f.dropped)

    def covered(step: int) -> set[int]:
        return {i.manifest.key.rank for i in keeper.listing(JOB) if i.parity and i.parity.row == 0 and i.manifest.key.step == step}

    # A bit flips in h0's fragment while every data host is alive: the scrub finds it and drops it, repair refills it
    # from h1..h4, and it then rebuilds rank 1's shard bit-exactly.
    row0(2).block(0)[4242] ^= 0x04
    wait_for(lambda: keeper.corrupt == 1, timeout=10, what="the scrub to find the flipped bit")
    wait_for(lambda: covered(2) == {1, 2, 3, 4}, timeout=30, what="h0 to refill row 0")
    assert cluster.servers["h0"].store.scrubber.corrupt >= 1
    cluster.kill("h1")
    c = CheckpointClient(JOB, 1, WORLD, connection=Connection(cluster.address("h0"), timeout=20.0))
    try:
        assert_same(c.load(2), rank_state(1, 2, scale=SCALE))
    finally:
        c.close()

    # With h1 lost, a flip in its step 1's row 0 parity cannot be made good: the refill from h2..h4 lacks h1's
    # contribution. Once found, rank 1's step 1 is reported unrestorable from RAM instead of being rebuilt wrong.
    row0(1).block(0)[99] ^= 0x80
    wait_for(lambda: keeper.corrupt == 2, timeout=10, what="the scrub to find the second flip")
    wait_for(lambda: covered(1) == {2, 3, 4}, timeout=30, what="h0 to refill row 0 of step 1 from the data hosts alive")
    c = CheckpointClient(JOB, 1, WORLD, connection=Connection(cluster.address("h0"), timeout=20.0))
    try:
        with pytest.raises(NotFoundError, match=r"step 1 .* is not restorable"):
            c.load(1)
        assert c.latest_step() == 2  # the copy h0 kept of the restore above
    finally:
        c.close()
