"""verify_replicas' fingerprint and decision (trainer_client.replica_check): what makes two states' fingerprints equal
or different, and which ranks a mismatch names. The collective is faked here (one all_reduce, monkeypatched); real
gloo groups run in tests/integration/test_replica_check.py."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.harness.shards import random_tensor
from trainer_client import replica_check
from trainer_client.errors import InvalidArgumentError, ReplicaMismatchError, SerializationError
from trainer_client.replica_check import sample_positions, state_fingerprint, verify_replicas
from trainer_client.serialization import dtypes
from trainer_client.serialization.walk import Kind

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
ALL_DTYPES = sorted(dtypes.TENSOR_DTYPES.values(), key=str)
FP8 = getattr(torch, "float8_e4m3fn", None)


def mixed_state(seed: int = 0) -> dict[str, Any]:
    """A state of every kind of leaf the shard format takes; built anew (no shared objects) on every call."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(64, 48, generator=g)
    state: dict[str, Any] = {
        "model": collections.OrderedDict(
            w=torch.nn.Parameter(base.clone()),
            bf16=base.to(torch.bfloat16),
            wt=base.t(),  # a non-contiguous view
            cols=base[:, ::3],
            expanded=torch.randn(7, 1, generator=g).expand(7, 500),
            conj=torch.randn(300, dtype=torch.complex64, generator=g).conj(),
            c128=torch.randn(40, dtype=torch.complex128, generator=g),
            mask=torch.rand(1000, generator=g) > 0.5,
            ids=torch.randint(-(2**40), 2**40, (77,), generator=g),
            empty=torch.zeros(0, 5),
            scalar=torch.tensor(3.5),
        ),
        "optim": {
            "state": {0: {"step": torch.tensor(10.0), "exp_avg": base * 0.1}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}],
        },
        "np": {"a": np.arange(600, dtype=np.float32).reshape(20, 30)[::-1, ::2], "rec": np.zeros(3, dtype=[("x", "<i4"), ("y", "<f8")])},
        "leaves": [None, True, 7, 2**70, -0.0, float("nan"), "text", b"raw", bytearray(b"buf"), torch.float16, torch.Size([2, 3])],
        "tags": {"alpha", "beta", "gamma", "delta"},  # set order differs between processes; the fingerprint must not
    }
    if FP8 is not None:
        state["model"]["fp8"] = base.to(FP8)
    return state


# -- equal states -----------------------------------------------------------------------------------------------


def test_states_built_separately_fingerprint_alike() -> None:
    assert state_fingerprint(mixed_state()) == state_fingerprint(mixed_state())
    assert 0 <= state_fingerprint(mixed_state()) < 2**63


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_fingerprints_by_its_bits(dtype: torch.dtype) -> None:
    small, big = random_tensor(dtype, (3, 5), seed=1), random_tensor(dtype, (200, 9), seed=2)
    state = {"small": small, "big": big, "view": big[::2, 1:]}
    again = {"small": random_tensor(dtype, (3, 5), seed=1), "big": random_tensor(dtype, (200, 9), seed=2)}
    again["view"] = again["big"][::2, 1:]
    assert state_fingerprint(state) == state_fingerprint(again)
    other = random_tensor(dtype, (3, 5), seed=3)
    if not torch.equal(other.view(torch.uint8), small.view(torch.uint8)):  # all of a small tensor is sampled
        assert state_fingerprint({**state, "small": other}) != state_fingerprint(state)


@pytest.mark.parametrize(
    "view",
    [
        lambda t: t.t(),
        lambda t: t[:, ::3],
        lambda t: t[5:9],
        lambda t: t[3, 4],
        lambda t: t[:1].expand(40, 48),
        lambda t: t.reshape(8, 8, 48).permute(2, 0, 1),
    ],
    ids=["transposed", "strided", "offset", "zero-d", "expanded", "permuted"],
)
def test_a_view_fingerprints_like_its_contiguous_copy(view: Any) -> None:
    t = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))
    assert state_fingerprint(view(t)) == state_fingerprint(view(t).contiguous())
    assert state_fingerprint(view(t)) != state_fingerprint(view(t + 1))


def test_conj_and_neg_views_count_by_their_values() -> None:
    z = torch.randn(300, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    assert state_fingerprint(z.conj()) == state_fingerprint(z.conj().resolve_conj())
    assert state_fingerprint(z.conj()) != state_fingerprint(z)
    neg = z.conj().imag  # a neg view
    assert neg.is_neg()
    assert state_fingerprint(neg) == state_fingerprint(neg.clone())
    assert state_fingerprint(neg) != state_fingerprint(z.imag)


def test_numpy_arrays_fingerprint_by_their_values_whatever_their_strides() -> None:
    a = np.arange(6000, dtype=np.float64).reshape(60, 100)
    assert state_fingerprint(a[::-1, ::7]) == state_fingerprint(np.ascontiguousarray(a[::-1, ::7]))
    b = a.copy()
    b[-1, -1] += 1  # the last element is always sampled
    assert state_fingerprint(b) != state_fingerprint(a)


def test_the_device_is_not_part_of_the_fingerprint() -> None:
    """A blob's record counts less its device: a state on cuda:3 and its copy on the CPU fingerprint alike."""
    record = {"kind": "tensor", "nbytes": 8, "dtype": "float32", "shape": [2]}
    on_gpu = Kind("tensor", 8, torch.float32, (2,), {**record, "device": "cuda:3"})
    on_cpu = Kind("tensor", 8, torch.float32, (2,), record)
    assert replica_check._described(on_gpu, {}) == replica_check._described(on_cpu, {})


def _moved(tensor: torch.Tensor, device: str) -> torch.Tensor:
    """A copy of ``tensor`` on ``device``, a conj view and a Parameter as such."""
    if tensor.is_conj():
        return _moved(tensor.conj(), device).conj()
    out = tensor.detach().to(device, copy=True)
    return torch.nn.Parameter(out, tensor.requires_grad) if isinstance(tensor, torch.nn.Parameter) else out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_copy_on_a_device_fingerprints_like_the_original(device: str) -> None:
    """The model's tensors copied to ``device`` (the optimizer's stay on the CPU: two devices in one state)."""
    state = mixed_state()
    moved = collections.OrderedDict((key, _moved(value, device)) for key, value in state["model"].items())
    assert moved["conj"].is_conj() and isinstance(moved["w"], torch.nn.Parameter)
    assert state_fingerprint({**state, "model": moved}) == state_fingerprint(state)
    moved["ids"][-1] += 1  # the last element is always sampled
    assert state_fingerprint({**state, "model": moved}) != state_fingerprint(state)


# -- different states -------------------------------------------------------------------------------------------


def _changed(path: list[Any], value: Any) -> dict[str, Any]:
    state = mixed_state()
    node = state
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return state


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda s: s["model"].__setitem__("renamed", s["model"].pop("mask")), id="key-renamed"),
        pytest.param(lambda s: s["model"].__setitem__("bf16", s["model"]["bf16"].view(torch.int16)), id="dtype-same-bits"),
        pytest.param(lambda s: s["model"].__setitem__("w", s["model"]["w"].detach().reshape(48, 64)), id="shape"),
        pytest.param(lambda s: s["model"].__setitem__("w", s["model"]["w"].detach()), id="parameter-to-tensor"),
        pytest.param(lambda s: s["optim"]["param_groups"][0].__setitem__("lr", 1e-3 + 1e-18), id="float-leaf"),
        pytest.param(lambda s: s["leaves"].__setitem__(4, 0.0), id="negative-zero"),
        pytest.param(lambda s: s["leaves"].__setitem__(6, "texT"), id="str-leaf"),
        pytest.param(lambda s: s["leaves"].__setitem__(7, b"raW"), id="bytes-leaf"),
        pytest.param(lambda s: s["leaves"].__setitem__(0, 0), id="none-to-int"),
        pytest.param(lambda s: s["optim"]["param_groups"][0].__setitem__("betas", [0.9, 0.999]), id="tuple-to-list"),
        pytest.param(lambda s: s.__setitem__("model", dict(s["model"])), id="ordereddict-to-dict"),
        pytest.param(lambda s: s["tags"].add("epsilon"), id="set-member"),
        pytest.param(lambda s: s["model"].move_to_end("w"), id="insertion-order"),
        pytest.param(lambda s: s["model"]["ids"].__setitem__(-1, 0), id="last-element"),
        pytest.param(lambda s: s["model"]["ids"].__setitem__(0, 1), id="first-element"),
        pytest.param(lambda s: s["model"]["scalar"].fill_(3.25), id="zero-d"),
        pytest.param(lambda s: s["model"].__setitem__("empty", torch.zeros(5, 0)), id="empty-shape"),
        pytest.param(lambda s: s["np"]["a"].__setitem__((0, 0), -1.0), id="numpy-element"),
    ],
)
def test_a_difference_the_fingerprint_sees(change: Any) -> None:
    state = mixed_state()
    change(state)
    assert state_fingerprint(state) != state_fingerprint(mixed_state())


def test_any_sampled_element_changes_it_and_an_unsampled_one_does_not() -> None:
    """Blob 0 (``w``) has 3072 elements, 32 sampled: flipping one bit of each sampled element is seen, of an
    element outside the sample is not (the documented limit of a sampled check)."""
    reference = state_fingerprint(mixed_state())
    sampled = sample_positions([0], [64 * 48], 32)[0]
    assert len(sampled) == 32 and sampled[0] == 0 and sampled[-1] == 64 * 48 - 1 and np.all(np.diff(sampled) > 0)
    for position in sampled.tolist():
        state = mixed_state()
        state["model"]["w"].data.view(-1).view(torch.int32)[position] ^= 1
        assert state_fingerprint(state) != reference, position
    unsampled = next(p for p in range(64 * 48) if p not in set(sampled.tolist()))
    state = mixed_state()
    state["model"]["w"].data.view(-1)[unsampled] += 1
    assert state_fingerprint(state) == reference


def test_samples_differ_between_blobs_and_depend_on_samples_per_tensor() -> None:
    a, b = sample_positions([0, 1], [10**6, 10**6], 32)
    assert not np.array_equal(a, b)
    assert state_fingerprint(mixed_state(), samples_per_tensor=8) != state_fingerprint(mixed_state())
    assert sample_positions([5], [10], 32)[0].tolist() == list(range(10))


def test_the_fingerprint_is_the_same_in_another_process() -> None:
    """Another interpreter with another hash seed (so its sets iterate in another order) gives the same number."""
    code = (
        "from tests.unit.test_replica_check import mixed_state; "
        "from trainer_client.replica_check import state_fingerprint; print(state_fingerprint(mixed_state()))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True, env=env, cwd=ROOT)
    assert int(out.stdout.strip()) == state_fingerprint(mixed_state())


def test_bad_input() -> None:
    with pytest.raises(InvalidArgumentError, match="samples_per_tensor"):
        state_fingerprint({}, samples_per_tensor=1)
    with pytest.raises(SerializationError, match=r"state\['x'\]"):
        state_fingerprint({"x": object()})


# -- the decision, over a faked all_reduce ------------------------------------------------------------------------


class FakeGroup:
    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def name(self) -> str:
        return "gloo"


class FakeReduce:
    """An all_reduce where the other members' slots hold ``others`` (None: this member's own slot)."""

    def __init__(self, others: list[int | None]) -> None:
        self.others = others
        self.mine: int | None = None
        self.calls = 0

    def __call__(self, tensor: torch.Tensor, op: Any = None, group: Any = None) -> None:
        self.calls += 1
        assert op == dist.ReduceOp.SUM and tensor.dtype == torch.int64 and len(tensor) == len(self.others)
        me = self.others.index(None)
        self.mine = int(tensor[me])
        assert int(tensor.count_nonzero()) <= 1  # only its own slot
        for i, value in enumerate(self.others):
            if value is not None:
                tensor[i] += value


def _run(monkeypatch: pytest.MonkeyPatch, others: list[int | None], members: list[int], rank: int, state: Any = None) -> FakeReduce:
    reduce = FakeReduce(others)
    monkeypatch.setattr(dist, "all_reduce", reduce)
    me = others.index(None)
    verify_replicas(mixed_state() if state is None else state, FakeGroup(len(others), me), members, rank)
    return reduce


SAME = state_fingerprint(mixed_state())
OTHER = state_fingerprint(mixed_state(seed=1))
ALSO = state_fingerprint(mixed_state(seed=2))


def test_equal_members_pass_with_one_all_reduce(monkeypatch: pytest.MonkeyPatch) -> None:
    reduce = _run(monkeypatch, [SAME, None, SAME, SAME], [10, 11, 12, 13], 11)
    assert reduce.calls == 1 and reduce.mine == SAME


@pytest.mark.parametrize(
    ("others", "ranks", "tie"),
    [
        ([None, SAME, OTHER, SAME], (12,), False),  # one liar
        ([None, OTHER, OTHER, OTHER], (10,), False),  # this member is the liar: it is named too
        ([None, OTHER, SAME, OTHER], (11, 13), True),  # 2 against 2: those unlike members[0]
        ([None, OTHER], (11,), True),  # a pair that disagrees: a tie
        ([None, OTHER, ALSO], (11, 12), True),  # all different
        ([None, OTHER, OTHER, ALSO], (10, 13), False),  # a plurality: 2 of 4, the others alone
    ],
)
def test_a_mismatch_names_the_ranks_unlike_the_majority(
    monkeypatch: pytest.MonkeyPatch, others: list[int | None], ranks: tuple[int, ...], tie: bool
) -> None:
    members = [10 + i for i in range(len(others))]
    with pytest.raises(ReplicaMismatchError) as info:
        _run(monkeypatch, others, members, 10)
    err = info.value
    assert (err.ranks, err.tie, err.members) == (ranks, tie, tuple(members))
    assert str(list(ranks)) in str(err) and str(members) in str(err)
    assert ("tie" in str(err)) == tie


def test_a_member_that_failed_is_named_and_one_whose_state_fails_raises_its_own_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ReplicaMismatchError, match="could not fingerprint") as info:
        _run(monkeypatch, [None, -1, SAME], [0, 1, 2], 0)
    assert info.value.ranks == (1,)
    reduce = FakeReduce([SAME, None])
    monkeypatch.setattr(dist, "all_reduce", reduce)
    with pytest.raises(SerializationError):
        verify_replicas({"x": object()}, FakeGroup(2, 1), [0, 1], 1)
    assert reduce.calls == 1 and reduce.mine == -1  # it took part first, so the others do not hang


@pytest.mark.parametrize(
    ("size", "members", "match"),
    [
        (3, [0, 1], "the 3 distinct job ranks"),  # one short
        (4, [0, 1, 1, 3], "distinct"),
        (4, [0, 5, 2, 3], r"members\[1\] must be its job rank 1"),
    ],
)
def test_members_that_do_not_fit_the_group_fail_after_taking_part(
    monkeypatch: pytest.MonkeyPatch, size: int, members: list[int], match: str
) -> None:
    reduce = FakeReduce([SAME, None] + [SAME] * (size - 2))
    monkeypatch.setattr(dist, "all_reduce", reduce)
    with pytest.raises(InvalidArgumentError, match=match):
        verify_replicas(mixed_state(), FakeGroup(size, 1), members, 1)
    assert reduce.calls == 1 and reduce.mine == -1  # the others learn of it instead of waiting


@pytest.mark.parametrize("group", [None, object(), "gloo"])
def test_something_that_is_no_process_group(monkeypatch: pytest.MonkeyPatch, group: Any) -> None:
    reduce = FakeReduce([None])
    monkeypatch.setattr(dist, "all_reduce", reduce)
    with pytest.raises(InvalidArgumentError, match=r"not an initialized torch\.distributed process group"):
        verify_replicas(mixed_state(), group, [0], 0)
    assert reduce.calls == 0
