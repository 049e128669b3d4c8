"""Several ranks on one host: their saves at once on one store, and no control call held up behind a long wait.

The store answers each connection of its Unix control socket on its own thread, and a client's ``LocalStub`` runs
each call on its own connection: a ``WaitCommitted`` that blocks for seconds (``handle.wait()`` on another thread,
the floor agreement's watcher) never delays a save's ``Allocate``/``Commit``, of the same client or of another
rank. Rank processes are forked from a preloaded forkserver and reaped with a deadline (tests/harness/ranks.py).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from memstore.v1 import store_pb2 as pb
from tests.harness.inprocess import InProcessCluster
from tests.harness.ranks import forkserver_fixture, run_ranks
from trainer_client import CheckpointClient, Connection

pytestmark = pytest.mark.integration

MiB = 1 << 20
RANKS = 8
ROUNDS = 5
LONG_WAIT = 10.0  # what a serialized call would sit behind
QUICK = 2.0  # a call that is not held up returns well within this, even on a loaded 2-core machine


forkserver = forkserver_fixture(__name__)


def _state(rank: int, step: int) -> dict[str, Any]:
    """Rank ``rank``'s state at ``step``: random float32 and bf16 tensors, a non-contiguous one and plain values."""
    gen = torch.Generator().manual_seed(rank * 1000 + step)
    return {
        "w": torch.rand(64 * 1024, generator=gen),
        "bf16": torch.rand(4096, generator=gen).to(torch.bfloat16),
        "t": torch.rand(64, 32, generator=gen).t(),
        "meta": {"rank": rank, "step": step},
    }


def _assert_same(got: Any, want: Any) -> None:
    assert got["meta"] == want["meta"]
    for name in ("w", "bf16", "t"):
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert torch.equal(got[name], want[name]), name


def _rank(rank: int, address: str, barrier: Any) -> None:
    """One rank: ROUNDS saves at the same moments as the others, each one's ``wait()`` on a thread while the next
    save runs; then every step restored and compared bit for bit, and the agreed newest step."""
    with CheckpointClient("ranks", rank, RANKS, connection=Connection(address, timeout=30.0)) as client:
        waits: list[threading.Thread] = []
        errors: list[BaseException] = []
        superseded: set[int] = set()

        def wait(handle: Any) -> None:
            try:
                result = handle.wait(timeout=60)
                if result.superseded:  # the store was still hashing it when the next save came: newest wins
                    superseded.add(handle.step)
                else:
                    assert result.copies == 1, result
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        for step in range(1, ROUNDS + 1):
            barrier.wait(timeout=60)
            handle = client.save(step, _state(rank, step))
            waits.append(threading.Thread(target=wait, args=(handle,), daemon=True))
            waits[-1].start()
        for thread in waits:
            thread.join(timeout=90)
            assert not thread.is_alive(), f"rank {rank}: a wait() did not return"
        assert not errors, f"rank {rank}: {errors}"
        barrier.wait(timeout=60)  # every rank's saves committed
        assert ROUNDS not in superseded  # the newest save always commits
        for step in range(1, ROUNDS + 1):
            if step not in superseded:
                _assert_same(client.load(step), _state(rank, step))
        assert client.latest_step() == ROUNDS


@pytest.mark.usefixtures("forkserver")
def test_eight_ranks_save_at_once_on_one_store_and_every_step_restores_exactly(make_inprocess_cluster) -> None:
    import multiprocessing

    cluster: InProcessCluster = make_inprocess_cluster(hosts=1, replicas=1, capacity="256MiB", keep=ROUNDS)
    barrier = multiprocessing.get_context("forkserver").Barrier(RANKS)
    run_ranks(_rank, RANKS, cluster.address("h0"), barrier, timeout=120)


def test_a_long_wait_does_not_hold_up_the_same_clients_next_calls(make_inprocess_cluster) -> None:
    """A capture that stays unfinished (committed in marks, never ended) keeps a ``WaitCommitted`` of it blocked in the
    store; meanwhile the same client's save, its wait and a restore, all over the same control socket stub, finish."""
    cluster: InProcessCluster = make_inprocess_cluster(hosts=1, replicas=1, capacity="256MiB")
    store = cluster.servers["h0"].store
    waiting = threading.Event()
    real_wait = store.wait_committed

    def entered(*args: Any, **kwargs: Any) -> Any:
        waiting.set()  # the wait is in the store now
        return real_wait(*args, **kwargs)

    store.wait_committed = entered  # type: ignore[method-assign]
    with CheckpointClient("fast", 0, 1, connection=Connection(cluster.address("h0"))) as client:
        stub = client._link.local
        assert stub is not None
        slow = pb.ShardKey(job_id="slow", step=1, rank=0)
        lease = stub.Allocate(pb.AllocateRequest(key=slow, world_size=1, nbytes=MiB), timeout=10)
        stub.Commit(pb.CommitRequest(lease_id=lease.lease_id, format_version=1, captured_bytes=0), timeout=10)
        answer: dict[str, Any] = {}

        def long_wait() -> None:
            t0 = time.monotonic()
            answer["response"] = stub.WaitCommitted(pb.WaitCommittedRequest(key=slow, timeout_seconds=LONG_WAIT), timeout=LONG_WAIT + 10)
            answer["seconds"] = time.monotonic() - t0

        waiter = threading.Thread(target=long_wait, daemon=True)
        waiter.start()
        try:
            assert waiting.wait(timeout=10), "the WaitCommitted never reached the store"
            t0 = time.monotonic()
            saved = _state(0, 1)
            assert client.save(1, saved).wait(timeout=QUICK).copies == 1  # Allocate/Commit, then a WaitCommitted
            _assert_same(client.load(1), saved)  # Open, Release
            quick = time.monotonic() - t0
            assert waiter.is_alive() and "response" not in answer, "the long wait ended early: nothing was proven"
            assert quick < QUICK, f"the save, its wait and a restore took {quick:.1f}s beside a {LONG_WAIT:.0f}s wait"
            assert stub.connections >= 2  # the long wait's connection, and the one the other calls took
        finally:
            # The capture ends: the long wait returns at once, settled.
            stub.Commit(pb.CommitRequest(lease_id=lease.lease_id, format_version=1), timeout=10)
            waiter.join(timeout=LONG_WAIT + 15)
        assert answer["response"].done and answer["seconds"] < LONG_WAIT, answer
