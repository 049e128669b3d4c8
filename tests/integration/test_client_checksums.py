"""A save hashed by its client as it is copied (CommitRequest.chunk_checksums), against real in-process stores: the
owner never reads the shard back to hash it, its peer verifies every chunk against the client's checksums, and a
wrong checksum fails the push instead of making a wrong copy. Only with ``MEMSTORE_TRAINER_HASHING=on``: by default
the store hashes, and the trainer's stall stays a copy."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from memstore.server.engine import replication
from memstore.v1.integrity import compute_checksums
from tests.harness.inprocess import InProcessCluster
from tests.harness.shards import assert_same
from trainer_client import CheckpointClient, Connection, knobs, serialization
from trainer_client.errors import ReplicationError
from trainer_client.serialization import memory

pytestmark = pytest.mark.integration
JOB = "sums"


def state() -> dict[str, Any]:
    torch.manual_seed(5)
    return {"layers": [torch.randn(256 * 1024) for _ in range(6)], "half": [torch.randn(300, 7).to(torch.bfloat16) for _ in range(30)]}


@pytest.fixture(autouse=True)
def trainer_hashing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMSTORE_TRAINER_HASHING", "on")


def owner_manifest(cluster: InProcessCluster, step: int) -> Any:
    (info,) = [i for i in cluster.servers["h0"].store.catalog.list_shards(JOB) if i.manifest.key.step == step]
    return info


def test_a_save_hashed_as_it_is_copied_is_replicated_without_the_owner_hashing_it(make_inprocess_cluster, monkeypatch) -> None:
    def no_hashing(*args: object, **kwargs: object) -> None:
        raise AssertionError("the owner hashed a shard its client had hashed")

    cluster: InProcessCluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="256MiB", extra_args=["--chunk-bytes", "256KiB"])
    monkeypatch.setattr(replication, "StreamedChecksums", no_hashing)
    monkeypatch.setattr(replication, "compute_checksums", no_hashing)
    saved = state()
    with CheckpointClient(JOB, 0, 1, connection=Connection(cluster.address("h0"))) as c:
        assert c.stats().shared_memory
        assert c.save(1, saved).wait(timeout=30).copies == 2
    expected = serialization.encode(saved)
    info = owner_manifest(cluster, 1)
    assert info.manifest.chunk_size == 256 << 10 and len(info.manifest.checksums) > 4
    assert list(info.manifest.checksums) == compute_checksums(memoryview(expected), len(expected), 256 << 10)
    with CheckpointClient(JOB, 0, 1, connection=Connection(cluster.address("h1"))) as c:
        assert_same(c.load(1), saved)  # the replica, verified chunk by chunk against the client's checksums
        assert c.stats().last_load_source == "h1"


def test_a_wrong_client_checksum_fails_the_push_and_no_peer_keeps_a_copy(make_inprocess_cluster, monkeypatch) -> None:
    hashing = memory.memmove_hashing

    def one_wrong(*args: Any, **kwargs: Any) -> list[int]:
        values = hashing(*args, **kwargs)
        return [values[0] ^ 1, *values[1:]]

    cluster: InProcessCluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="256MiB")
    monkeypatch.setattr(memory, "memmove_hashing", one_wrong)
    monkeypatch.setattr(serialization.encoder, "memmove_hashing", one_wrong)
    saved = state()
    with CheckpointClient(JOB, 0, 1, connection=Connection(cluster.address("h0"))) as c:
        with pytest.raises(ReplicationError, match="checksum"):
            c.save(1, saved).wait(timeout=30)
        assert not [i for i in cluster.servers["h1"].store.catalog.list_shards(JOB)]
        monkeypatch.setattr(serialization.encoder, "memmove_hashing", hashing)
        assert c.save(2, saved).wait(timeout=30).copies == 2  # the next save, hashed right, is replicated


def test_by_default_the_trainer_copies_and_the_store_hashes(make_inprocess_cluster, monkeypatch) -> None:
    monkeypatch.delenv("MEMSTORE_TRAINER_HASHING")
    cluster: InProcessCluster = make_inprocess_cluster(hosts=2, replicas=2, capacity="256MiB")
    store = cluster.servers["h0"].store
    commit, seen = store.commit, []

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("checksums"))
        return commit(*args, **kwargs)

    store.commit = recording  # type: ignore[method-assign]
    saved = state()
    with CheckpointClient(JOB, 0, 1, connection=Connection(cluster.address("h0"))) as c:
        assert c.save(1, saved).wait(timeout=30).copies == 2
    expected = serialization.encode(saved)
    assert seen == [None]  # the Commit carried no checksums: the owner computed the manifest's
    assert list(owner_manifest(cluster, 1).manifest.checksums) == compute_checksums(memoryview(expected), len(expected), 4 << 20)


def test_trainer_hashing_follows_the_setting_and_refuses_a_bad_one(make_inprocess_cluster, monkeypatch) -> None:
    from trainer_client.errors import InvalidArgumentError

    assert knobs.trainer_hashing()
    monkeypatch.setenv("MEMSTORE_TRAINER_HASHING", "off")
    assert not knobs.trainer_hashing()
    monkeypatch.delenv("MEMSTORE_TRAINER_HASHING")
    assert not knobs.trainer_hashing()  # the default: the stall stays a copy
    monkeypatch.setenv("MEMSTORE_TRAINER_HASHING", "auto")
    with pytest.raises(InvalidArgumentError, match="MEMSTORE_TRAINER_HASHING='auto' is invalid: expected on or off"):
        knobs.trainer_hashing()
    cluster: InProcessCluster = make_inprocess_cluster(hosts=1, replicas=1, capacity="64MiB")
    with pytest.raises(InvalidArgumentError, match="MEMSTORE_TRAINER_HASHING"):  # a client refuses it when it starts
        CheckpointClient(JOB, 0, 1, connection=Connection(cluster.address("h0")))
