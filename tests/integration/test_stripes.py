"""Stripe shards of a data-parallel replica group (issue 27) against real in-process stores: the stripe a Commit names
is refused when wrong, replicated, pulled and spilled with its shard, and `status`, `ls` and `inspect` count the job's
state once per replica group."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from memstore.cli import main as memstore_main
from memstore.testing import wait_for
from memstore.v1 import store_pb2 as pb
from memstore.v1 import store_pb2_grpc as pb_grpc
from memstore.v1.channel import insecure_channel
from memstore.v1.integrity import compute_checksums
from memstore.v1.streams import put_requests
from tests.harness.inprocess import InProcessCluster

pytestmark = pytest.mark.integration
GROUP = [0, 1, 2, 3]
STRIPE, OWN = 4096, 512  # each rank holds 1/4 of a 16 KiB replicated state, plus 512 bytes of its own
LOGICAL = STRIPE * len(GROUP)
SHARD = STRIPE + OWN


def stripe_of(rank: int, group: list[int] = GROUP, **changes: int) -> pb.Stripe:
    fields = {"group": group, "index": group.index(rank) if rank in group else 0, "logical_nbytes": LOGICAL, "stripe_nbytes": STRIPE}
    fields["slices_only"] = rank % 2 == 0  # said by some members (no own part), not by others: kept as each said it
    return pb.Stripe(**{**fields, **changes})  # type: ignore[arg-type]


@contextmanager
def stub_of(cluster: InProcessCluster, host: str) -> Iterator[pb_grpc.StoreStub]:
    with insecure_channel(cluster.address(host)) as ch:
        yield pb_grpc.StoreStub(ch)


def save(stub: pb_grpc.StoreStub, job: str, step: int, rank: int, world: int, stripe: pb.Stripe | None) -> None:
    """One rank's shard through the shared-memory path (Allocate, Commit naming the stripe), waited until committed."""
    key = pb.ShardKey(job_id=job, step=step, rank=rank)
    lease = stub.Allocate(pb.AllocateRequest(key=key, world_size=world, nbytes=SHARD), timeout=10)
    stub.Commit(pb.CommitRequest(lease_id=lease.lease_id, format_version=1, stripe=stripe), timeout=10)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done = stub.WaitCommitted(pb.WaitCommittedRequest(key=key, timeout_seconds=5), timeout=10)
        if done.done:
            assert done.info.state == pb.SHARD_STATE_COMMITTED and done.info.copies == 2, done.info
            return
    raise AssertionError(f"{key} was not committed in 30 s")


def listing(cluster: InProcessCluster, job: str) -> dict[str, list[pb.ShardInfo]]:
    out = {}
    for host in cluster.stores:
        with stub_of(cluster, host) as stub:
            out[host] = list(stub.List(pb.ListRequest(job_id=job), timeout=10).shards)
    return out


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    capsys.readouterr()
    assert memstore_main(list(args)) == 0
    return capsys.readouterr().out


@pytest.fixture
def cluster(make_inprocess_cluster) -> InProcessCluster:  # type: ignore[no-untyped-def]
    c: InProcessCluster = make_inprocess_cluster(hosts=3, replicas=2, capacity="64MiB")
    for host, ranks in (("h0", (0, 1)), ("h1", (2, 3))):
        with stub_of(c, host) as stub:
            for rank in ranks:
                save(stub, "dp", 1, rank, 4, stripe_of(rank))
    with stub_of(c, "h2") as stub:
        for rank in (0, 1):
            save(stub, "plain", 1, rank, 2, None)
    # h0's store, where members 0 and 1 save, pulls the group's other stripes (2, 3) as cached copies ahead of a restore
    # (memstore.server.engine.assembler), half a second after the saves settle. Every test starts once that is done, so what
    # it sees does not depend on how fast it runs.
    wait_for(lambda: cached(c, "dp") == {("h0", 2), ("h0", 3)}, timeout=30, what="h0 to pull stripes 2 and 3 ahead of a restore")
    return c


def cached(cluster: InProcessCluster, job: str) -> set[tuple[str, int]]:
    """(host, rank) of every cached copy of ``job`` (pulled ahead of a restore: not one of the R copies)."""
    return {(h, i.manifest.key.rank) for h, shards in listing(cluster, job).items() for i in shards if i.cached}


def test_stripes_are_replicated_and_pulled_with_their_shards(cluster: InProcessCluster) -> None:
    held = listing(cluster, "dp")
    copies = [i for shards in held.values() for i in shards]
    replicated = [i for i in copies if not i.cached]
    assert len(replicated) == 8 and {i.state for i in replicated} == {pb.SHARD_STATE_COMMITTED, pb.SHARD_STATE_REPLICA}
    for i in copies:
        assert i.manifest.stripe == stripe_of(i.manifest.key.rank), i  # the owner's copy, its replica and a cached one alike
    assert all(not i.manifest.HasField("stripe") for shards in listing(cluster, "plain").values() for i in shards)
    # A store that holds no copy of rank 1 pulls one from a peer (what repair and a restore do): the stripe comes along.
    host = next(h for h, shards in held.items() if all(i.manifest.key.rank != 1 for i in shards))
    with stub_of(cluster, host) as stub:
        fetched = stub.Fetch(pb.FetchRequest(key=pb.ShardKey(job_id="dp", step=1, rank=1)), timeout=30)
        assert fetched.source_host and fetched.manifest.stripe == stripe_of(1)
    assert [i.manifest.stripe for i in listing(cluster, "dp")[host] if i.manifest.key.rank == 1] == [stripe_of(1)]


def test_status_ls_and_inspect_count_the_state_once_per_replica_group(cluster: InProcessCluster, capsys) -> None:  # type: ignore[no-untyped-def]
    store = cluster.address("h0")
    jobs = {j["job"]: j for j in json.loads(cli(capsys, "status", "--store", store, "--json"))["jobs"]}
    dp, plain = jobs["dp"], jobs["plain"]
    # In RAM: R copies of each rank, and h0's cached copies of stripes 2 and 3, which are not among them.
    assert (dp["copies_bytes"], dp["cached_bytes"], dp["logical_bytes"], dp["copies_of_state"], dp["replica_groups"]) == (
        2 * 4 * SHARD + 2 * SHARD, 2 * SHARD, LOGICAL + 4 * OWN, 2.0, 1
    )  # fmt: skip
    assert (plain["copies_bytes"], plain["logical_bytes"], plain["copies_of_state"], plain["replica_groups"]) == (
        2 * 2 * SHARD, 2 * SHARD, 2.0, 0
    )  # fmt: skip
    table = cli(capsys, "status", "--store", store)
    assert "logical (once)" in table and "copies of state" in table and "2.00x" in table and "18.00 KiB" in table, table

    (step,) = json.loads(cli(capsys, "ls", "--store", store, "--job", "dp", "--json"))["jobs"]["dp"]
    assert (step["bytes"], step["logical_bytes"], step["replica_groups"]) == (4 * SHARD, LOGICAL + 4 * OWN, [GROUP])
    ls = cli(capsys, "ls", "--store", store, "--job", "dp")
    assert "replica groups" in ls and "ranks 0-3" in ls, ls
    shards = json.loads(cli(capsys, "ls", "--store", store, "--job", "dp", "--shards", "--json"))["shards"]
    assert {(r["rank"], r["stripe"]["index"]) for r in shards} >= {(0, 0), (1, 1)}
    assert all(r["stripe"] == {"group": GROUP, "index": r["rank"], "logical_bytes": LOGICAL, "stripe_bytes": STRIPE} for r in shards)
    raw = cli(capsys, "ls", "--store", store, "--job", "dp", "--shards")
    assert "stripe=1/4 of ranks 0-3: 4.00 KiB of 16.00 KiB" in raw, raw
    assert "stripe=" not in cli(capsys, "ls", "--store", store, "--job", "plain", "--shards")

    ranks = json.loads(cli(capsys, "inspect", "--store", store, "--job", "dp", "--step", "1", "--json"))["ranks"]
    assert [(r["rank"], r["stripe"]["index"], len([c for c in r["copies"] if not c["cached"]])) for r in ranks] == [
        (0, 0, 2), (1, 1, 2), (2, 2, 2), (3, 3, 2)
    ]  # fmt: skip
    assert {(c["host"], r["rank"]) for r in ranks for c in r["copies"] if c["cached"]} == {("h0", 2), ("h0", 3)}
    text = cli(capsys, "inspect", "--store", store, "--job", "dp", "--step", "1")
    assert "stripe" in text and "3/4 of ranks 0-3: 4.00 KiB of 16.00 KiB" in text, text
    plain_ranks = json.loads(cli(capsys, "inspect", "--store", store, "--job", "plain", "--step", "1", "--json"))["ranks"]
    assert [r["stripe"] for r in plain_ranks] == [None, None]


def refused(call: Any) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    return str(err.value.details())


def test_a_bad_stripe_is_refused_naming_the_field_and_nothing_stored_changes(cluster: InProcessCluster) -> None:
    before = listing(cluster, "dp")
    with stub_of(cluster, "h2") as stub:
        key = pb.ShardKey(job_id="dp", step=2, rank=1)
        lease = stub.Allocate(pb.AllocateRequest(key=key, world_size=4, nbytes=SHARD), timeout=10).lease_id
        for stripe, message in [
            (stripe_of(1, index=2), "stripe.group[2] (stripe.index) is rank 2, but the shard is rank 1"),
            (stripe_of(1, group=[0, 1, 1, 3]), "stripe.group names rank 1 twice"),
            (stripe_of(1, group=[0, 1, 2, 3, 4]), "stripe.group has 5 ranks: expected 1..world_size (4)"),
            (stripe_of(1, group=[0, 1, 9]), "stripe.group names rank 9"),
            (stripe_of(1, index=7), "stripe.index 7 is out of range"),
            (stripe_of(1, stripe_nbytes=SHARD + 1, logical_nbytes=LOGICAL), f"stripe.stripe_nbytes {SHARD + 1} is more than the shard's"),
            (stripe_of(1, logical_nbytes=STRIPE - 1), "stripe.stripe_nbytes 4096 is more than stripe.logical_nbytes 4095"),
        ]:
            assert message in refused(lambda s=stripe: stub.Commit(pb.CommitRequest(lease_id=lease, stripe=s), timeout=10))
        stub.Commit(pb.CommitRequest(lease_id=lease, stripe=stripe_of(1)), timeout=10)  # the lease was kept: a right one goes in

        data = bytes(SHARD)
        checksums = compute_checksums(memoryview(data), SHARD, 1024)
        manifest = pb.Manifest(key=pb.ShardKey(job_id="dp", step=3, rank=0), world_size=4, nbytes=SHARD, chunk_size=1024,
                               chunk_checksums=checksums, checksum_algo="xxh3_64", stripe=stripe_of(1))  # fmt: skip
        header = pb.PutHeader(manifest=manifest, origin=pb.PUT_ORIGIN_CLIENT)
        assert "stripe.group[1] (stripe.index) is rank 1, but the shard is rank 0" in refused(
            lambda: stub.Put(put_requests(header, memoryview(data)), timeout=10)
        )
    after = listing(cluster, "dp")
    for host, shards in before.items():
        assert [i for i in after[host] if i.manifest.key.step == 1] == shards  # step 1 as it was
        assert all(i.manifest.key.step != 3 for i in after[host])  # the refused Put left nothing


def test_a_spilled_stripe_is_read_back_with_its_stripe(make_inprocess_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "spill"
    cluster: InProcessCluster = make_inprocess_cluster(
        hosts=2, replicas=2, capacity="64MiB", extra_args=["--spill", f"file://{root}", "--spill-every-steps", "1"]
    )
    with stub_of(cluster, "h0") as stub:
        for rank in (0, 1):
            save(stub, "dps", 1, rank, 2, stripe_of(rank, group=[1, 0], logical_nbytes=2 * STRIPE))
    manifests = [root / "dps" / "step-000000000001" / f"rank-00000{r}.json" for r in (0, 1)]
    wait_for(lambda: all(p.exists() for p in manifests), timeout=30, what="both ranks spilled")
    assert json.loads(manifests[0].read_text())["stripe"] == {"group": [1, 0], "index": 1, "logical_nbytes": 2 * STRIPE,
                                                              "stripe_nbytes": STRIPE}  # fmt: skip
    for h in cluster.stores:
        cluster.kill(h)
        cluster.restart(h)
    with stub_of(cluster, "h1") as stub:
        key = pb.ShardKey(job_id="dps", step=1, rank=0)
        fetched = stub.Fetch(pb.FetchRequest(key=key, durable_known=True), timeout=30)
        assert fetched.manifest.stripe == stripe_of(0, group=[1, 0], logical_nbytes=2 * STRIPE), fetched
