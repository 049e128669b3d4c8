"""The save paths' conformance suite: every path-level behaviour, one test body, run against both ``SavePath``s.

``SharedMemoryPath`` (segments of the rank's capture ring, committed over the store's socket) and ``RemotePath``
(staged here, hashed, sent over the data channel) promise the same things (``trainer_client/transport/save_path.py``):
a captured shard lands and reads back bit for bit and its handle reports it committed; a failure before the hand-over,
a refused or failed hand-over, and a full store commit nothing and give back the memory the save held; a full store
is a typed error. As torchft's ``run_multi_recovery_test`` runs one recovery test against each of its transports, the
``under`` fixture below builds each path on its own connection to one in-process store, and every test runs twice.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tests.harness.inprocess import InProcessCluster
from tests.states import assert_same, rank_state
from trainer_client import CheckpointClient, Connection, serialization
from trainer_client.capture import cuda, device_save
from trainer_client.capture.device_save import Captures
from trainer_client.errors import CapacityExceededError, MemstoreClientError, NotFoundError, StoreUnavailableError
from trainer_client.handles import SaveHandle
from trainer_client.transport import messages, remote_path
from trainer_client.transport.link import StoreLink, connect
from trainer_client.transport.remote_path import RemotePath
from trainer_client.transport.save_path import PlannedShard, SavePath
from trainer_client.transport.shared_memory_path import SharedMemoryPath

pytestmark = pytest.mark.integration

SHARED, REMOTE = "shared memory", "remote"
CAPACITY = 32 << 20


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """One store (R=1: a shard is committed once its owner holds it) for every test of the module; each test its own job."""
    cluster = InProcessCluster(hosts=1, replicas=1, capacity=f"{CAPACITY >> 20}MiB", workdir=tmp_path_factory.mktemp("save-paths"))
    cluster.start()
    try:
        yield cluster.address("h0")
    finally:
        cluster.stop()


@dataclass
class Under:
    """One save path under test, on a connection of its own, and what the tests need to know of it."""

    kind: str
    link: StoreLink
    path: SavePath
    routes: tuple[str, ...]  # what ``path.last_route`` may say after a save
    staged: list[torch.Tensor] = field(default_factory=list)  # RemotePath: the staging buffers it made

    def held(self) -> int:
        """Memory the path holds that no save in progress and no next save needs: ring leases neither committed nor
        reserved ahead (shared memory), staging buffers not given back (remote)."""
        if isinstance(self.path, SharedMemoryPath):
            ring = self.path.ring
            ring.wait_ahead()
            if ring._growing is not None:  # the ring's fill leases each new segment for a moment: let it finish
                ring._growing.result(timeout=60)
            return len(ring._leased) - (1 if ring.ahead_path() else 0)
        assert isinstance(self.path, RemotePath)
        return len(self.staged) - len(self.path._free)

    def break_hand_over(self, monkeypatch: pytest.MonkeyPatch, fail: Callable[[Any], None]) -> None:
        """Make the step that hands the bytes over (the Commit; the send) call ``fail`` with its request first."""
        if isinstance(self.path, SharedMemoryPath):
            real_commit = self.path.ring._commit
            assert real_commit is not None

            def commit(request: Any, what: str) -> Any:
                fail(request)
                return real_commit(request, what)

            monkeypatch.setattr(self.path.ring, "_commit", commit)
            return
        transfer = self.link.data
        real_put = transfer.put

        def put(header: Any, view: memoryview, what: str) -> str:
            fail(view)
            return real_put(header, view, what)

        monkeypatch.setattr(transfer, "put", put)


@pytest.fixture(params=[SHARED, REMOTE])
def under(request: pytest.FixtureRequest, store: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Under]:
    shared = request.param == SHARED
    link = connect(Connection(store, shared_memory=shared))
    captures = Captures()
    if shared:
        path: SavePath = SharedMemoryPath(link, captures, 0, 1, "", marking=False, hashing=False)
        under = Under(SHARED, link, path, ("shared memory",))
    else:
        path = RemotePath(link, captures, 1, "", background=False)
        under = Under(REMOTE, link, path, ("data channel", "grpc"))
        real_empty = remote_path.empty_buffer
        monkeypatch.setattr(remote_path, "empty_buffer", lambda n: _kept(under.staged, real_empty(n)))
    try:
        yield under
    finally:
        captures.close()
        path.close()
        link.close()


def _kept(made: list[torch.Tensor], buf: torch.Tensor) -> torch.Tensor:
    made.append(buf)
    return buf


@pytest.fixture
def job(request: pytest.FixtureRequest, under: Under) -> str:
    """One job per test and parameters (a step saves once per timeline)."""
    name = request.node.originalname.removeprefix("test_")[:60]
    return re.sub(r"[^A-Za-z0-9._-]", "-", f"{name}-{request.node.callspec.id}")


@pytest.fixture
def reader(store: str, under: Under, job: str) -> Iterator[CheckpointClient]:
    """A client of the same job reading back through the same kind of path (and asking how its saves stand)."""
    with CheckpointClient(job, 0, 1, connection=Connection(store, shared_memory=under.kind == SHARED)) as client:
        yield client


def planned(job: str, step: int, state: Any, *, enqueued: bool = False, on_success: Callable[[], None] | None = None) -> PlannedShard:
    key = messages.shard_key(job, step, 0, 1, f"{job}.0")
    layout = serialization.plan(state)
    return PlannedShard(
        key, layout, cuda.device_part(layout), {"loss": 0.5}, None, enqueued=enqueued, started=time.perf_counter(),
        floor=lambda: None, on_success=on_success,
    )  # fmt: skip


def handle_of(reader: CheckpointClient, shard: PlannedShard, job: Any) -> SaveHandle:
    """The handle ``CheckpointClient.save`` makes of what ``capture`` returned."""
    status = functools.partial(reader.save_status, shard.key.step, shard.key.timeline)
    if shard.enqueued:
        return SaveHandle(shard.key.step, shard.key.timeline, 0, status, capture=job)
    return SaveHandle(shard.key.step, shard.key.timeline, 0, status, sending=job.handed_off)


def assert_nothing_committed(reader: CheckpointClient, shard: PlannedShard) -> None:
    with pytest.raises(NotFoundError):
        reader.save_status(shard.key.step, shard.key.timeline)
    assert reader.restore_point(shard.key.step, group=False) is None


@pytest.mark.parametrize("enqueued", [False, True], ids=["copied", "enqueued"])
def test_a_capture_lands_reads_back_bit_exact_and_its_handle_reports_it_committed(
    under: Under, reader: CheckpointClient, job: str, enqueued: bool
) -> None:
    state = rank_state(0, 1, scale=8)
    succeeded: list[int] = []
    shard = planned(job, 1, state, enqueued=enqueued, on_success=lambda: succeeded.append(1))
    handle = handle_of(reader, shard, under.path.capture(shard))
    result = handle.wait(30)
    assert result.committed and result.copies == 1 and result.nbytes == shard.layout.nbytes and not handle.skipped
    assert succeeded == [1]  # the client's timeline moves on once, after the store took the shard
    assert under.path.last_route in under.routes
    assert_same(reader.load(1, timeline=shard.key.timeline), state)
    assert under.held() == 0


def test_a_failure_before_the_hand_over_commits_nothing_and_gives_the_memory_back(
    under: Under, reader: CheckpointClient, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_writer = device_save.host_writer

    def failing_writer(*args: Any, **kwargs: Any) -> Callable[[], None]:
        def write() -> None:
            raise RuntimeError("the host copy failed")

        return write

    monkeypatch.setattr(device_save, "host_writer", failing_writer)
    shard = planned(job, 1, rank_state(0, 1, scale=8))
    with pytest.raises(RuntimeError, match="the host copy failed"):
        under.path.capture(shard)
    assert under.held() == 0
    assert_nothing_committed(reader, shard)
    monkeypatch.setattr(device_save, "host_writer", real_writer)  # the path goes on: the next save lands
    state = rank_state(0, 2, scale=8)
    again = planned(job, 2, state)
    assert handle_of(reader, again, under.path.capture(again)).wait(30).committed
    assert_same(reader.load(2, timeline=again.key.timeline), state)


def test_a_full_store_is_a_typed_error_and_commits_nothing(under: Under, reader: CheckpointClient, job: str) -> None:
    shard = planned(job, 1, {"big": torch.ones((CAPACITY + (16 << 20)) // 4)})  # more than the store holds
    with pytest.raises(CapacityExceededError) as err:
        under.path.capture(shard)
    assert err.value.capacity == CAPACITY and err.value.needed > err.value.capacity
    assert under.held() == 0
    assert_nothing_committed(reader, shard)


def test_a_failed_hand_over_commits_nothing_and_gives_the_memory_back(
    under: Under, reader: CheckpointClient, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(_: Any) -> None:
        raise StoreUnavailableError("the store went away mid-save")

    under.break_hand_over(monkeypatch, fail)
    shard = planned(job, 1, rank_state(0, 1, scale=8))
    with pytest.raises(StoreUnavailableError, match="went away"):
        under.path.capture(shard)
    assert under.held() == 0
    assert_nothing_committed(reader, shard)


# The remote path only: through shared memory no bytes travel (the store hashes the segment it owns itself, or takes
# the trainer's checksums), so there is no send to corrupt.
@pytest.mark.parametrize("under", [REMOTE], indirect=True)
def test_a_corrupt_send_is_refused_and_not_committed(
    under: Under, reader: CheckpointClient, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:

    def corrupt(view: Any) -> None:  # after the checksums were computed: the store must notice
        view[4096] ^= 0xFF

    under.break_hand_over(monkeypatch, corrupt)
    shard = planned(job, 1, rank_state(0, 1, scale=8))
    with pytest.raises(MemstoreClientError):
        under.path.capture(shard)
    assert under.held() == 0
    assert_nothing_committed(reader, shard)
