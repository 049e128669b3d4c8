"""The durable tier's view when its storage fails: a manifest that is corrupt or gone is left out, storage that does not
answer makes the view unknown (raised at once, not after trying every manifest), and the spill pass says so in status.

Over a local directory (``file://``) with failures injected per call (``FlakyDurable``).
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path

import pytest

from memstore.core.spill_policy import RetentionPolicy
from memstore.errors import SpillStorageError, SpillUnreachable
from memstore.spill import layout
from memstore.spill import spiller as spiller_module
from memstore.spill.spiller import Spiller
from memstore.spill.storage import Durable
from tests.harness.spill_source import FakeSource

pytestmark = pytest.mark.unit
JOB = "job"


class FlakyDurable(Durable):
    """A local Durable whose calls fail while ``down(op, path)`` says so (op: list, read, write), counting them."""

    def __init__(self, root: Path) -> None:
        super().__init__(f"file://{root}")
        self.down: Callable[[str, str], bool] = lambda op, path: False
        self.calls: list[tuple[str, str]] = []

    def _call(self, op: str, path: str) -> None:
        self.calls.append((op, path))
        if self.down(op, path):
            raise SpillUnreachable(f"{op} {path}: EndpointConnectionError: Could not connect to the endpoint URL")

    def list_files(self, prefix: str) -> dict[str, dict[str, object]]:
        self._call("list", prefix)
        return super().list_files(prefix)

    def read(self, path: str) -> bytes:
        self._call("read", path)
        return super().read(path)

    def write_stream(self, path: str, pieces: object) -> int:
        self._call("write", path)
        return super().write_stream(path, pieces)  # type: ignore[arg-type]


def Source() -> FakeSource:
    """Whole steps of one rank each (world size 1), every one this store's (h0) to spill."""
    return FakeSource("h0", duty={"h0"}, world_size=1, job=JOB)


def spiller_over(durable: Durable, source: Source | None = None, every_steps: int = 2, keep_last: int = 5) -> Spiller:
    """A fresh spiller (nothing cached) over ``durable``."""
    return Spiller(source or Source(), durable, every_steps=every_steps, every_seconds=0,  # type: ignore[arg-type]
                   retention=RetentionPolicy(keep_last=keep_last), codec="none", max_rate=0)  # fmt: skip


def spilled(tmp_path: Path, steps: tuple[int, ...]) -> FlakyDurable:
    """Durable storage at ``tmp_path`` holding ``steps`` spilled (one rank each)."""
    durable = FlakyDurable(tmp_path)
    source = Source()
    for step in steps:
        source.hold(step, data=bytes([step % 256]) * 2048)
    spiller_over(durable, source).run_once()
    assert {h.key.step for h in spiller_over(durable).holdings(JOB)} == set(steps)
    return durable


def manifest(tmp_path: Path, step: int) -> Path:
    return Path(layout.manifest_path(str(tmp_path), JOB, step, 0))


@pytest.mark.parametrize("how", ["corrupt", "missing"])
def test_a_step_none_of_whose_manifests_reads_is_left_out_and_the_others_stay_complete(tmp_path: Path, how: str) -> None:
    durable = spilled(tmp_path, (2, 4, 6))
    view = spiller_over(durable)
    listing = view.listing(JOB)
    if how == "corrupt":
        manifest(tmp_path, 4).write_bytes(b"{not json")
    else:
        manifest(tmp_path, 4).unlink()  # collected by another store after this one listed
    assert set(view.complete_steps(listing, JOB)) == {2, 6}  # no IndexError: the pass goes on for the other steps
    assert {h.key.step for h in view.holdings(JOB)} == {2, 6}


def test_a_spill_pass_with_an_unreadable_step_completes(tmp_path: Path) -> None:
    durable = spilled(tmp_path, (2, 4))
    manifest(tmp_path, 2).write_bytes(b"{not json")
    source = Source()
    source.hold(6, data=bytes([6]) * 2048)
    pass_ = spiller_over(durable, source, keep_last=1)
    pass_.run_once()
    assert pass_.status[JOB].consecutive_failures == 0 and pass_.status[JOB].last_spilled_step == 6
    assert not manifest(tmp_path, 4).exists()  # retention (keep 1) ran over the readable steps: 4 went, 6 stays
    assert manifest(tmp_path, 6).exists()


def test_storage_that_does_not_answer_makes_the_view_unknown_at_the_first_manifest(tmp_path: Path) -> None:
    durable = spilled(tmp_path, (2, 4, 6, 8))
    view = spiller_over(durable)
    view.listing(JOB)  # listed just before the outage (the listing is cached for a second)
    durable.down = lambda op, path: True
    durable.calls.clear()
    with pytest.raises(SpillUnreachable):
        view.holdings(JOB)
    assert durable.calls == [("read", durable.calls[0][1])]  # one manifest tried, not each of the four
    with pytest.raises(SpillUnreachable, match="not asked again"):
        view.holdings(JOB)  # within OUTAGE_SECONDS: at once, without asking the storage
    assert len(durable.calls) == 1


def test_the_view_is_whole_again_once_the_storage_answers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    durable = spilled(tmp_path, (2, 4))
    view = spiller_over(durable)
    durable.down = lambda op, path: op == "list"
    with pytest.raises(SpillUnreachable):
        view.holdings(JOB)
    durable.down = lambda op, path: False
    monkeypatch.setattr(spiller_module, "OUTAGE_SECONDS", 0.0)  # the outage's memory has run out
    assert {h.key.step for h in view.holdings(JOB)} == {2, 4}


def test_an_outage_only_the_manifests_reads_meet_fails_the_spill_pass_in_status(tmp_path: Path) -> None:
    durable = spilled(tmp_path, (2, 4))
    source = Source()
    source.hold(5, data=bytes([5]) * 2048)  # not due (every 2 steps): this pass spills nothing and collects garbage over the listing
    pass_ = spiller_over(durable, source, keep_last=1)
    durable.down = lambda op, path: op == "read"  # the listing answers, the manifests' reads do not
    pass_.run_once()
    st = pass_.status[JOB]
    assert st.consecutive_failures == 1 and "EndpointConnectionError" in st.last_error  # memstore status: FAILING
    assert manifest(tmp_path, 2).exists()  # retention deleted nothing it could not see


def test_a_step_marked_for_spilling_stays_protected_while_the_storage_does_not_answer(tmp_path: Path) -> None:
    durable = FlakyDurable(tmp_path)
    source = Source()
    for step in (3, 5):
        source.hold(step, data=bytes([step % 256]) * 2048)
        durable.write_small(layout.intent_path(durable.root, JOB, step), b"")  # other stores' timers marked them
    pass_ = spiller_over(durable, source, every_steps=0)
    durable.down = lambda op, path: op == "write" and "step-000000000003" in path  # the outage starts after step 5
    pass_.run_once()
    assert pass_.status[JOB].last_spilled_step == 5 and pass_.status[JOB].consecutive_failures == 1
    durable.down = lambda op, path: True
    assert pass_.protected_steps(JOB) == {3}  # the last listing's intent stands: retention keeps step 3 until spilled


class Failing:
    """A filesystem whose every read raises ``exc``."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def cat_file(self, path: str) -> bytes:
        raise self.exc


@pytest.mark.parametrize(
    "exc",
    [ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), TimeoutError("read timed out"),
     OSError(errno.EBUSY, "Please reduce your request rate.")],  # s3fs's 503 SlowDown once botocore's retries are spent
)  # fmt: skip
def test_a_missing_object_is_an_answer_and_a_refused_connection_is_none(tmp_path: Path, exc: Exception) -> None:
    durable = Durable(f"file://{tmp_path}")
    with pytest.raises(SpillStorageError) as missing:
        durable.read(f"{tmp_path}/{JOB}/step-000000000503/rank-000000.json")  # "503" in its path, yet it is missing
    assert type(missing.value) is SpillStorageError
    durable.fs = Failing(exc)  # type: ignore[assignment]
    with pytest.raises(SpillUnreachable):
        durable.read("anything")
