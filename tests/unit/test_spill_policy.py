"""Spill policy: triggers, retention (keep last K, keep best M) and what counts as debris."""

from __future__ import annotations

import pytest

from memstore.core.spill_policy import RetentionPolicy, due_by_steps, due_by_time, steps_to_delete, steps_to_keep
from memstore.errors import CodecError
from memstore.spill import codec
from memstore.spill.layout import LayoutError, SpilledManifest, manifest_path, shard_path
from memstore.spill.storage import parse_options

pytestmark = pytest.mark.unit


def test_triggers() -> None:
    assert [s for s in range(0, 11) if due_by_steps(s, 5)] == [5, 10]
    assert not any(due_by_steps(s, 0) for s in range(10))
    assert due_by_time(None, 100.0, 10) and due_by_time(80.0, 100.0, 10) and not due_by_time(95.0, 100.0, 10)
    assert not due_by_time(None, 100.0, 0)


def test_keep_last_and_best_exact_over_20_steps() -> None:
    losses = {s: 10.0 - (s % 7) * 0.5 + (0.01 * s) for s in range(1, 21)}  # best (lowest) at s=6, 13 and 20-ish
    complete = {s: {"loss": v} for s, v in losses.items()}
    policy = RetentionPolicy(keep_last=3, keep_best=2, metric="loss", higher_is_better=False)
    best_two = sorted(losses, key=lambda s: losses[s])[:2]
    assert steps_to_keep(complete, policy) == {18, 19, 20} | set(best_two)
    assert steps_to_delete(complete, [], policy) == set(range(1, 21)) - {18, 19, 20} - set(best_two)
    higher = RetentionPolicy(keep_last=1, keep_best=1, metric="acc", higher_is_better=True)
    assert steps_to_keep({1: {"acc": 0.9}, 2: {"acc": 0.5}, 3: {}}, higher) == {1, 3}


def test_incomplete_steps_are_debris_only_behind_k_complete_steps() -> None:
    policy = RetentionPolicy(keep_last=2)
    assert steps_to_delete({4: {}}, [3], policy) == set()  # step 3 may still be spilling elsewhere
    assert steps_to_delete({4: {}, 5: {}}, [3, 6], policy) == {3}  # 6 is newer: in progress


def test_policy_validation() -> None:
    with pytest.raises(ValueError, match="keep_last"):
        RetentionPolicy(keep_last=0)
    with pytest.raises(ValueError, match="metric"):
        RetentionPolicy(keep_best=1)


@pytest.mark.parametrize("name", codec.CODECS)
def test_codecs_round_trip(name: str) -> None:
    import numpy as np

    raw = np.random.default_rng(0).standard_normal(4096).astype(np.float32).tobytes()
    enc = codec.encode(name, memoryview(raw))
    assert bytes(codec.decode(name, bytes(enc), len(raw))) == raw
    with pytest.raises(CodecError):
        codec.decode(name, b"garbage" * 3, len(raw))


def test_layout_names_and_manifest_validation() -> None:
    assert shard_path("/r", "job.1", 5, 3) == "/r/job.1/step-000000000005/rank-000003.shard"
    assert manifest_path("s3-bucket/p", "j", 0, 0).endswith("step-000000000000/rank-000000.json")
    with pytest.raises(LayoutError):
        shard_path("/r", "../etc", 1, 0)
    m = SpilledManifest("j", 1, 0, 2, 10, 4, [1, 2, 3], "h0", stored_chunks=[4, 4, 2])
    assert SpilledManifest.decode(m.encode()) == m
    for bad in (b"not json", b'{"version": 99}', m.encode().replace(b'"rank":0', b'"rank":7')):
        with pytest.raises(LayoutError):
            SpilledManifest.decode(bad)


def test_spill_options() -> None:
    assert parse_options('{"anon": true}') == {"anon": True}
    assert parse_options("endpoint_url=http://127.0.0.1:1,use_ssl=false") == {"endpoint_url": "http://127.0.0.1:1", "use_ssl": False}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_options("nonsense")


def test_gc_sweeps_empty_step_dirs_left_by_any_store(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A step directory emptied by the last of several stores (or re-created by a late write) is removed by the next pass."""
    from memstore.core.spill_policy import RetentionPolicy
    from memstore.spill.spiller import Spiller, StepListing
    from memstore.spill.storage import Durable

    job = tmp_path / "job"
    (job / "step-000000000001").mkdir(parents=True)  # empty: everybody's files are gone
    (job / "step-000000000003").mkdir()
    (job / "step-000000000003" / ".metadata").write_bytes(b"x")  # still holds a file: stays
    (job / "step-000000000009").mkdir()  # newer than the newest spilled step: may be a spill starting now
    spiller = Spiller(object(), Durable(f"file://{tmp_path}"), every_steps=1, every_seconds=0,  # type: ignore[arg-type]
                      retention=RetentionPolicy(), codec="none", max_rate=0)  # fmt: skip
    spiller._sweep_empty_step_dirs("job", StepListing(), newest=5)
    assert sorted(p.name for p in job.iterdir()) == ["step-000000000003", "step-000000000009"]
