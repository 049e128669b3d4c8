"""The background scrub on real stores (in-process, real gRPC): a bit flipped in a held copy that nobody reads is found,
the copy dropped and pulled again by repair from its replica, the store's health counts it, and a restore gets the
saved bytes."""

from __future__ import annotations

import pytest
import torch

from memstore.testing import wait_for
from trainer_client import CheckpointClient, Connection

pytestmark = pytest.mark.integration


def test_a_rotten_copy_is_found_dropped_and_repaired_before_anyone_reads_it(make_inprocess_cluster) -> None:  # type: ignore[no-untyped-def]
    flags = ["--scrub-rate", "1GiB", "--scrub-interval", "0.1", "--repair-interval", "0.2"]
    cluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="64MiB", extra_args=flags)
    state = {"w": torch.arange(1 << 18, dtype=torch.float32)}
    with CheckpointClient("scrubbed", 0, 1, connection=Connection(cluster.address("h0")), run_id="r1") as client:
        assert client.save(1, state).wait(60).copies == 2
    store = cluster.servers["h0"].store
    (entry,) = [e for e in store.catalog.settled_copies() if e.key.job_id == "scrubbed"]
    entry.segment.view()[entry.nbytes // 2] ^= 0x10  # a bit flips in h0's RAM

    def corrupt_found() -> int:
        health = cluster.health("h0")
        return health.scrub_corrupt if health is not None else 0

    wait_for(lambda: corrupt_found() == 1, 30, what="the scrub to find the flipped bit")
    assert cluster.health("h0").scrubbed_bytes > 0
    wait_for(lambda: (e := store.catalog.get(entry.key)) is not None and e is not entry and e.verified, 30,
             what="repair to pull the copy again")  # fmt: skip
    with CheckpointClient("scrubbed", 0, 1, connection=Connection(cluster.address("h0")), run_id="r2") as client:
        assert torch.equal(client.load(1)["w"], state["w"])
        assert client.stats().last_load_source == "h1"  # h0's local copy, as repair pulled it from h1's replica
