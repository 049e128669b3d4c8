"""Stripes of a replica group's state (trainer_client.stripes): the assembled bytes are the logical shard's, exactly."""

from __future__ import annotations

import collections
import dataclasses
import mmap

import numpy as np
import pytest
import torch

from memstore.core.model import Stripe
from trainer_client import serialization, stripes
from trainer_client.errors import CorruptShardError, InvalidArgumentError
from trainer_client.serialization import Span
from trainer_client.serialization.spec import SMALL_COPY
from trainer_client.stripes import (
    StripeCopy,
    assemble,
    assemble_copies,
    bounds,
    decode_stripe,
    is_stripe,
    merge,
    split_state,
    stripe_state,
    whole_state,
)


def mixed_state() -> dict:
    g = torch.Generator().manual_seed(3)
    state = {
        "model": {f"w{i}": torch.randn(37 * i + 1, 5, generator=g).to(torch.bfloat16) for i in range(20)},
        "optim": {"state": {i: {"exp_avg": torch.randn(100, generator=g), "step": torch.tensor(3.0)} for i in range(5)}, "lr": 0.1},
        "array": np.arange(1000, dtype=np.int32), "raw": b"hello" * 300,
        "conj": torch.randn(8, 8, dtype=torch.complex64, generator=g).conj(), "neg": torch.randn(16, generator=g).neg()._neg_view(),
        "strided": torch.randn(64, 64, generator=g)[:, ::2], "empty": torch.empty(0), "scalar": torch.tensor(5),
        "ordered": collections.OrderedDict(a=1, b=[1.5, None, "x"]), "param": torch.nn.Parameter(torch.randn(33, generator=g)),
    }  # fmt: skip
    if hasattr(torch, "float8_e4m3fn"):
        state["fp8"] = torch.randn(300, generator=g).to(torch.float8_e4m3fn)
    return state


def roundtrip(plan_state: dict) -> dict:
    """A stripe as a restore reads it: saved as an ordinary shard, decoded."""
    decoded = serialization.decode(serialization.encode(plan_state))
    assert is_stripe(decoded)
    return decoded  # type: ignore[return-value]


def mapped(plan_state: dict) -> mmap.mmap:
    """A stripe's shard in a private mapping, as a restore through shared memory maps its segment."""
    data = serialization.encode(plan_state)
    mm = mmap.mmap(-1, len(data), flags=mmap.MAP_PRIVATE)
    mm[:] = bytes(data)
    return mm


def assembled_bytes(stripes: list[dict]) -> bytes:
    n = stripes[0]["logical_nbytes"]
    out = assemble(stripes, None, zero_copy=True)
    return bytes(serialization.encode(out)), n


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7])
def test_stripes_cover_the_logical_shard_and_assemble_to_its_exact_bytes(count: int) -> None:
    state = mixed_state()
    expected = bytes(serialization.encode(state))
    plans = [stripe_state(state, None, None, list(range(10, 10 + count)), i) for i in range(count)]
    assert {p.logical_nbytes for p in plans} == {len(expected)}
    assert sum(p.stripe_nbytes for p in plans) == len(expected)
    stripes = [roundtrip(p.state) for p in plans]
    for zero_copy in (True, False):
        restored = assemble(stripes, None, zero_copy=zero_copy)
        assert bytes(serialization.encode(restored)) == expected


def test_large_tensors_restore_as_views_of_their_stripes_and_nothing_is_copied_whole() -> None:
    state = {f"t{i}": torch.randn(64 << 10) for i in range(8)}  # 256 KiB each: every one larger than a small copy
    stripes = [roundtrip(stripe_state(state, None, None, [0, 1], i).state) for i in range(2)]
    pieces = {p.data_ptr() for s in stripes for p in s["pieces"] if isinstance(p, torch.Tensor)}
    restored = assemble(stripes, None, zero_copy=True)
    shared = [t for t in restored.values() if t.data_ptr() in pieces]
    assert len(shared) >= 6  # all but the (at most one) tensor split between the two stripes
    assert all(torch.equal(restored[k], state[k]) for k in state)
    copied = assemble(stripes, None, zero_copy=False)
    assert not any(t.data_ptr() in pieces for t in copied.values())


def test_each_stripe_holds_about_its_share_of_a_large_state() -> None:
    state = {f"t{i}": torch.randn(256, 1024) for i in range(8)}  # 8 MiB
    plans = [stripe_state(state, None, None, [0, 1, 2, 3], i) for i in range(4)]
    n = plans[0].logical_nbytes
    for p in plans:
        assert abs(p.stripe_nbytes - n / 4) <= 4096
        assert abs(serialization.plan(p.state).nbytes - n / 4) < 0.01 * n  # the saved shard: framing is small


def test_one_large_tensor_is_split_across_every_member() -> None:
    state = {"embedding": torch.randn(1 << 20)}
    plans = [stripe_state(state, None, None, [0, 1, 2, 3], i) for i in range(4)]
    assert all(abs(p.stripe_nbytes - (1 << 20)) <= 8192 for p in plans)  # 4 MiB of floats: about 1 MiB each
    restored = assemble([roundtrip(p.state) for p in plans], None, zero_copy=True)
    assert torch.equal(restored["embedding"], state["embedding"])


def test_stripe_bounds_are_even_page_aligned_and_complete() -> None:
    assert bounds(0, 3) == [0, 0, 0, 0]
    assert bounds(100, 4) == [0, 0, 0, 0, 100]
    cuts = bounds(10 * 4096 + 17, 4)
    assert cuts[0] == 0 and cuts[-1] == 10 * 4096 + 17 and all(c % 4096 == 0 for c in cuts[:-1]) and cuts == sorted(cuts)


def test_a_mixed_state_keeps_its_own_part_and_its_key_order() -> None:
    state = {"step": 3, "model": {"w": torch.ones(4)}, "optim": {"m": torch.full((4,), 2.0)}}
    shared, own, order = split_state(state, ["model"])
    assert list(shared) == ["model"] and list(own) == ["step", "optim"] and order == ["step", "model", "optim"]
    plans = [stripe_state(shared, own, order, [0, 1], i) for i in range(2)]
    stripes = [roundtrip(p.state) for p in plans]
    whole = merge(assemble(stripes, None, zero_copy=False), stripes[1]["own"], stripes[1]["order"])
    assert list(whole) == ["step", "model", "optim"]
    assert torch.equal(whole["model"]["w"], torch.ones(4)) and torch.equal(whole["optim"]["m"], torch.full((4,), 2.0))


@pytest.mark.parametrize(
    ("state", "replicated", "message"),
    [
        ({"a": 1}, ["b"], "lacks: ['b']"),
        ([1, 2], ["a"], "needs a state that is a mapping"),
        ({"a": 1}, "a", "expected a list"),
    ],
)
def test_bad_replicated_arguments_are_named(state: object, replicated: object, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message.replace("[", r"\[").replace("]", r"\]")):
        split_state(state, replicated)  # type: ignore[arg-type]


def test_stripes_that_do_not_fit_together_are_refused() -> None:
    state = {f"t{i}": torch.randn(4096) for i in range(4)}
    stripes = [roundtrip(stripe_state(state, None, None, [0, 1, 2], i).state) for i in range(3)]
    with pytest.raises(CorruptShardError, match="does not fit"):
        assemble([stripes[0], stripes[2], stripes[1]], None, zero_copy=True)
    with pytest.raises(CorruptShardError, match="cover"):
        assemble(stripes[:2], None, zero_copy=True)
    other = [roundtrip(stripe_state({"x": torch.zeros(5)}, None, None, [0, 1, 2], i).state) for i in range(3)]
    with pytest.raises(CorruptShardError, match="does not fit"):
        assemble([stripes[0], other[1], stripes[2]], None, zero_copy=True)
    stripes[1]["offsets"][0] = stripes[1]["end"]  # a slice outside its stripe's range
    with pytest.raises(CorruptShardError, match="outside its range"):
        assemble(stripes, None, zero_copy=True)


def test_stripe_cuts_move_to_blob_starts_so_no_tensor_is_split() -> None:
    state = {f"t{i}": torch.randn(50_000 + 10 * i) for i in range(12)}  # 12 tensors of ~200 KB: 3 in each of 4 stripes
    plans = [stripe_state(state, None, None, [0, 1, 2, 3], i) for i in range(4)]
    sizes = {t.numel() * 4 for t in state.values()}
    pieces = [p for plan in plans for p in plan.state["pieces"] if isinstance(p, torch.Tensor)]
    assert len(pieces) == 12 and all(p.numel() in sizes for p in pieces)  # each a whole tensor
    assert max(p.stripe_nbytes for p in plans) < 1.2 * plans[0].logical_nbytes / 4  # still about even
    cuts = bounds(100_000, 4, starts=[0, 20_000, 26_000, 49_000, 90_000])
    assert cuts == [0, 26_000, 49_000, 73_728, 100_000]  # within 1/16 of a share (1,562 bytes) of a start, else a page


@pytest.mark.parametrize("count", [1, 2, 3])
def test_stripes_read_as_spans_assemble_each_tensor_once_over_their_mappings(count: int) -> None:
    state = {**mixed_state(), **{f"big{i}": torch.randn(30_000 + 7 * i) for i in range(6)}}  # large ones: views
    expected = bytes(serialization.encode(state))
    maps = [mapped(stripe_state(state, None, None, list(range(count)), i).state) for i in range(count)]
    stripes = [decode_stripe(mm) for mm in maps]
    pieces = [p for s in stripes for p in s["pieces"]]
    spans = [p for p in pieces if isinstance(p, Span)]
    assert not any(isinstance(p, torch.Tensor) and p.numel() > SMALL_COPY for p in pieces)  # no tensor made for a large slice
    assert len(spans) >= 5 and all(any(p.buffer is mm for mm in maps) for p in spans)
    restored = assemble(stripes, None, zero_copy=True)
    assert bytes(serialization.encode(restored)) == expected
    ranges = [(a, a + len(mm)) for mm in maps for a in [torch.frombuffer(mm, dtype=torch.uint8).data_ptr()]]
    viewed = [k for k in state if k.startswith("big") and any(lo <= restored[k].data_ptr() < hi for lo, hi in ranges)]
    assert len(viewed) >= 6 - (count - 1)  # each a view of its stripe's mapping, but a tensor split between two stripes
    assert bytes(serialization.encode(assemble(stripes, None, zero_copy=False))) == expected


def test_a_stripe_whose_own_part_holds_a_large_byte_tensor_gets_it_back_as_a_tensor() -> None:
    state = {"model": {"w": torch.randn(40_000)}, "buffer": torch.arange(100_000, dtype=torch.int64).to(torch.uint8)}
    shared, own, order = split_state(state, ["model"])
    stripes = [decode_stripe(mapped(stripe_state(shared, own, order, [0, 1], i).state)) for i in range(2)]
    assert isinstance(stripes[0]["own"]["buffer"], torch.Tensor)
    whole = whole_state(0, 1, stripes[0], {1: stripes[1]}, None, zero_copy=True)
    assert list(whole) == ["model", "buffer"] and torch.equal(whole["buffer"], state["buffer"])
    assert torch.equal(whole["model"]["w"], state["model"]["w"])


def copies_of(state: dict, count: int, replicated: list[str] | None = None) -> list[StripeCopy]:
    """The ``count`` stripes of ``state`` as a restore reads them: each a mapped shard with the stripe its manifest names."""
    shared, own, order = split_state(state, replicated)
    plans = [stripe_state(shared, own, order, list(range(count)), i) for i in range(count)]
    out = []
    for i, p in enumerate(plans):
        mm = mapped(p.state)
        out.append(StripeCopy(mm, len(mm), Stripe(tuple(range(count)), i, p.logical_nbytes, p.stripe_nbytes, p.slices_only)))
    return out


def with_stripe(copy: StripeCopy, **changes: object) -> StripeCopy:
    return StripeCopy(copy.buffer, copy.nbytes, dataclasses.replace(copy.stripe, **changes))


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7])
def test_stripes_assembled_from_their_manifests_give_the_logical_shards_exact_bytes(count: int) -> None:
    state = {**mixed_state(), **{f"big{i}": torch.randn(30_000 + 7 * i) for i in range(6)}}  # large ones: views
    expected = bytes(serialization.encode(state))
    copies = copies_of(state, count)
    assert all(c.stripe.slices_only for c in copies)
    for zero_copy in (True, False):
        restored, held = assemble_copies(copies, None, zero_copy)
        assert bytes(serialization.encode(restored)) == expected
        # The table the assembly read (each stripe's range and slices) is the one each stripe records.
        decoded = [decode_stripe(c.buffer) for c in copies]
        assert held == [{"start": d["start"], "end": d["end"], "offsets": d["offsets"]} for d in decoded]
    restored, _ = assemble_copies(copies, None, zero_copy=True)
    ranges = [(a, a + c.nbytes) for c in copies for a in [torch.frombuffer(c.buffer, dtype=torch.uint8).data_ptr()]]
    viewed = [k for k in state if k.startswith("big") and any(lo <= restored[k].data_ptr() < hi for lo, hi in ranges)]
    assert len(viewed) >= 6 - (count - 1)  # each a view of its stripe's mapping, but a tensor split between two stripes


def test_a_restore_of_stripes_that_hold_only_their_slices_decodes_none_of_them(monkeypatch: pytest.MonkeyPatch) -> None:
    state = {f"t{i}": torch.randn(40_000 + i) for i in range(5)}
    copies = copies_of(state, 2)

    def refused(buf: object) -> None:
        raise AssertionError("a stripe was decoded")

    monkeypatch.setattr(stripes, "decode_stripe", refused)
    whole = whole_state(1, 7, copies[1], {0: copies[0]}, None, zero_copy=True)
    assert list(whole) == list(state) and all(torch.equal(whole[k], v) for k, v in state.items())


def test_a_mixed_state_from_copies_keeps_its_own_part_and_its_key_order() -> None:
    state = {"step": 3, "model": {"w": torch.randn(50_000)}, "optim": {"m": torch.full((4,), 2.0)}}
    copies = copies_of(state, 2, replicated=["model"])
    assert not any(c.stripe.slices_only for c in copies)  # each holds its own part too: its own stripe is decoded
    whole = whole_state(0, 1, copies[0], {1: copies[1]}, None, zero_copy=False)
    assert list(whole) == ["step", "model", "optim"] and whole["step"] == 3
    assert torch.equal(whole["model"]["w"], state["model"]["w"]) and torch.equal(whole["optim"]["m"], state["optim"]["m"])


def test_copies_and_stripes_decoded_by_an_older_stores_path_assemble_together() -> None:
    state = {f"t{i}": torch.randn(30_000) for i in range(4)}
    copies = copies_of(state, 2)
    decoded = decode_stripe(copies[1].buffer)  # a store that named no stripe in its manifest: read as a decoded stripe
    whole = whole_state(0, 1, copies[0], {1: decoded}, None, zero_copy=True)
    assert all(torch.equal(whole[k], v) for k, v in state.items())


def moved_cut(copies: list[StripeCopy], by: int) -> list[StripeCopy]:
    """The same stripes with manifests that put the cut between the first two ``by`` bytes later (still tiling N)."""
    a, b = copies[0].stripe, copies[1].stripe
    return [with_stripe(copies[0], stripe_nbytes=a.stripe_nbytes + by), with_stripe(copies[1], stripe_nbytes=b.stripe_nbytes - by)]


@pytest.mark.parametrize(
    ("state", "by"),
    [
        *[({f"t{i}": torch.randn(40_000 + 3 * i) for i in range(8)}, by) for by in (4, 64, 4096, 160_000, -4096)],  # cut at a start
        *[({"embedding": torch.randn(1 << 18)}, by) for by in (4, -4, 64, -64, 4096)],  # cut inside the one tensor
    ],
)
def test_manifests_whose_ranges_are_not_the_stripes_cuts_are_refused_not_read(state: dict, by: int) -> None:
    copies = copies_of(state, 2)
    with pytest.raises(CorruptShardError, match="its manifest does not describe it"):
        assemble_copies(moved_cut(copies, by), None, zero_copy=True)
    unsaid = [with_stripe(c, slices_only=False) for c in moved_cut(copies, by)]  # as an older client's: its own stripe decoded
    for rank in (0, 1):
        with pytest.raises(CorruptShardError, match=r"holds other slices than its replica group's manifests say|does not describe it"):
            whole_state(rank, 1, unsaid[rank], {1 - rank: unsaid[1 - rank]}, None, zero_copy=True)


def test_a_range_that_moves_a_cut_only_across_padding_reads_the_same_slices() -> None:
    state = {f"t{i}": torch.randn(40_000 + 3 * i) for i in range(8)}  # 52 bytes of padding after each but the last
    restored, _ = assemble_copies(moved_cut(copies_of(state, 2), -4), None, zero_copy=True)
    assert bytes(serialization.encode(restored)) == bytes(serialization.encode(state))


def test_manifests_that_do_not_fit_together_or_their_shards_are_refused() -> None:
    state = {f"t{i}": torch.randn(40_000) for i in range(6)}
    copies = copies_of(state, 3)
    with pytest.raises(CorruptShardError, match="does not fit the others"):
        assemble_copies([copies[0], copies[2], copies[1]], None, zero_copy=True)
    with pytest.raises(CorruptShardError, match=r"hold \d+ bytes of a logical shard of"):
        assemble_copies([copies[0], with_stripe(copies[1], stripe_nbytes=copies[1].stripe.stripe_nbytes + 64), copies[2]], None, True)
    n = copies[0].stripe.logical_nbytes + 64  # every manifest agreeing on another logical size
    grown = [with_stripe(c, logical_nbytes=n, stripe_nbytes=c.stripe.stripe_nbytes + 64 * (i == 2)) for i, c in enumerate(copies)]
    with pytest.raises(CorruptShardError, match=r"does not describe it|manifests say"):
        assemble_copies(grown, None, zero_copy=True)
    short = StripeCopy(copies[1].buffer, copies[1].nbytes - 100, copies[1].stripe)  # a shard shorter than its slices
    with pytest.raises(CorruptShardError, match="its manifest does not describe it"):
        assemble_copies([copies[0], short, copies[2]], None, zero_copy=True)
    other = copies_of({"x": torch.zeros(5000)}, 3)
    with pytest.raises(CorruptShardError):
        assemble_copies([copies[0], other[1], copies[2]], None, zero_copy=True)


def test_a_stripe_with_an_own_part_that_its_manifest_says_holds_only_slices_is_refused() -> None:
    state = {"model": {"w": torch.randn(40_000)}, "buffer": torch.randn(10_000)}
    copies = [with_stripe(c, slices_only=True) for c in copies_of(state, 2, replicated=["model"])]
    with pytest.raises(CorruptShardError, match="its manifest does not describe it"):
        whole_state(0, 1, copies[0], {1: copies[1]}, None, zero_copy=True)
