"""``SaveHandle`` against a fake status query, and the ``SaveResult`` its ``wait()`` returns (not protobuf)."""

from __future__ import annotations

import dataclasses
import pickle
from concurrent.futures import Future

import pytest

from memstore.v1 import store_pb2 as pb
from trainer_client import ReplicationError, SaveHandle, SaveResult

pytestmark = pytest.mark.unit

TIMELINE = "r1.0"


def wire(state: int = pb.SHARD_STATE_COMMITTED, copies: int = 2, **fields: object) -> pb.ShardInfo:
    manifest = pb.Manifest(key=pb.ShardKey(job_id="j", step=3, rank=1, timeline=TIMELINE), nbytes=4096, owner_host="h0")
    return pb.ShardInfo(manifest=manifest, state=state, verified=True, copies=copies, **fields)  # type: ignore[arg-type]


class FakeStore:
    """Answers a handle's status queries from a script: one (ShardInfo, done) per call; records each wait asked for."""

    def __init__(self, *answers: tuple[pb.ShardInfo, bool]) -> None:
        self.answers = list(answers)
        self.waits: list[float] = []

    def __call__(self, wait: float) -> tuple[SaveResult, bool]:
        self.waits.append(wait)
        info, done = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return SaveResult.from_wire(info, 3, 1, TIMELINE), done


def test_the_result_is_a_small_frozen_dataclass_with_a_short_repr() -> None:
    result = SaveResult.from_wire(wire(), 3, 1, TIMELINE)
    assert (result.step, result.rank, result.timeline, result.state, result.copies) == (3, 1, TIMELINE, "committed", 2)
    assert (result.host, result.nbytes, result.superseded, result.error, result.committed) == ("h0", 4096, False, "", True)
    assert repr(result) == "SaveResult(step=3, rank=1, timeline='r1.0', state='committed', copies=2, host='h0', nbytes=4096)"
    assert "manifest" not in repr(result) and "\n" not in str(result)  # no protobuf text in a user's log
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.copies = 3  # type: ignore[misc]
    assert result == SaveResult(3, 1, TIMELINE, "committed", 2, host="h0", nbytes=4096)  # compares by value, not wire
    assert pickle.loads(pickle.dumps(result)) == result


def test_the_state_names_follow_the_wire_enum() -> None:
    states = {pb.SHARD_STATE_CAPTURED: "captured", pb.SHARD_STATE_REPLICATING: "replicating",
              pb.SHARD_STATE_UNDER_REPLICATED: "under_replicated", pb.SHARD_STATE_REPLICA: "replica"}  # fmt: skip
    for state, name in states.items():
        assert SaveResult.from_wire(wire(state), 3, 1, TIMELINE).state == name
    failed = SaveResult.from_wire(wire(pb.SHARD_STATE_UNDER_REPLICATED, 1, error="peer h1 refused"), 3, 1, TIMELINE)
    assert "error='peer h1 refused'" in repr(failed)


def test_the_protobuf_attributes_still_answer_for_one_release_with_a_warning() -> None:
    result = SaveResult.from_wire(wire(), 3, 1, TIMELINE)
    with pytest.warns(DeprecationWarning, match=r"SaveResult.manifest is deprecated.*\(host, nbytes"):
        assert result.manifest.owner_host == "h0"
    with pytest.warns(DeprecationWarning, match=r"SaveResult.verified is deprecated"):
        assert result.verified


def test_wait_returns_the_result_once_the_store_says_committed() -> None:
    store = FakeStore((wire(pb.SHARD_STATE_REPLICATING, 1), False), (wire(), True))
    handle = SaveHandle(3, TIMELINE, 1, store)
    assert not handle.done() and handle.last_status is not None and handle.last_status.state == "replicating"
    result = handle.wait(timeout=30)
    assert isinstance(result, SaveResult) and result.committed and result.copies == 2
    assert handle.last_status == result and not handle.superseded
    assert store.waits[0] == 0.0 and 0 < store.waits[1] <= 10.0  # done() does not block; wait() waits in bounded slices


def test_a_superseded_save_returns_and_says_so() -> None:
    handle = SaveHandle(3, TIMELINE, 1, FakeStore((wire(pb.SHARD_STATE_CAPTURED, 0, superseded=True), True)))
    assert handle.wait(timeout=5).superseded and handle.superseded


def test_a_failed_replication_raises_with_the_store_s_reason() -> None:
    handle = SaveHandle(3, TIMELINE, 1, FakeStore((wire(pb.SHARD_STATE_UNDER_REPLICATED, 1, error="peer h1: disk full"), True)))
    with pytest.raises(ReplicationError, match=r"step 3 of rank 1 did not reach R copies: peer h1: disk full"):
        handle.wait(timeout=5)
    handle = SaveHandle(3, TIMELINE, 1, FakeStore((wire(pb.SHARD_STATE_UNDER_REPLICATED, 1), True)))
    with pytest.raises(ReplicationError, match=r"did not reach R copies: under_replicated"):
        handle.wait(timeout=5)


def test_wait_times_out_naming_the_state_it_saw() -> None:
    handle = SaveHandle(3, TIMELINE, 1, FakeStore((wire(pb.SHARD_STATE_REPLICATING, 1), False)))
    with pytest.raises(TimeoutError, match=r"step 3 of rank 1 not committed after 0.0s \(state replicating, 1 copies\)"):
        handle.wait(timeout=0.0)


def test_a_skipped_save_never_asks_the_store() -> None:
    store = FakeStore((wire(), True))
    handle = SaveHandle(3, TIMELINE, 1, store, skipped_reason="store full")
    assert handle.skipped and handle.done()
    with pytest.raises(ReplicationError, match="step 3 was skipped: store full"):
        handle.wait()
    assert store.waits == []


def test_a_background_send_s_error_is_raised_by_wait() -> None:
    sending: Future[None] = Future()
    sending.set_exception(ConnectionResetError("store went away"))
    handle = SaveHandle(3, TIMELINE, 1, FakeStore((wire(), True)), sending=sending)
    assert handle.done()
    with pytest.raises(ConnectionResetError, match="store went away"):
        handle.wait(timeout=5)
