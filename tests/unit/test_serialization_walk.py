"""What the walk of a state accepts and how it comes back, and what it refuses, naming the path (trainer_client.serialization.walk)."""

from __future__ import annotations

import collections
import math
import struct
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

from tests.harness.shards import (
    decode,
    roundtrip,
    trained,
)
from trainer_client import serialization as ser
from trainer_client.errors import SerializationError
from trainer_client.serialization import (
    encode,
    plan,
)

pytestmark = pytest.mark.unit


# --------------------------------------------------------------------------------------
# real training state
# --------------------------------------------------------------------------------------


def test_adamw_state_dict_with_int_keys_round_trips_and_loads() -> None:
    _, opt = trained()
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [0, 1, 2, 3, 4, 5]
    out = roundtrip(sd)
    assert list(out["state"]) == list(sd["state"])
    assert torch.equal(out["state"][3]["exp_avg"], sd["state"][3]["exp_avg"])
    model2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=5.0)
    opt2.load_state_dict(out)
    assert opt2.param_groups[0]["lr"] == 1e-3
    assert torch.equal(opt2.state[next(iter(model2.parameters()))]["exp_avg_sq"], sd["state"][0]["exp_avg_sq"])


def test_model_state_dict_keeps_ordered_dict_and_metadata() -> None:
    model, _ = trained()
    sd = model.state_dict()
    assert isinstance(sd, collections.OrderedDict) and hasattr(sd, "_metadata")
    out = roundtrip(sd)
    assert type(out) is collections.OrderedDict
    assert out._metadata == sd._metadata  # type: ignore[attr-defined]
    assert list(out) == list(sd)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    fresh.load_state_dict(out)
    assert torch.equal(fresh[1].running_mean, model[1].running_mean)  # type: ignore[index,arg-type]


def test_full_checkpoint_with_rng_states() -> None:
    model, opt = trained()
    import random as pyrandom

    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "step": 12345,
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.get_state(),
        "numpy_gen": np.random.default_rng(3).bit_generator.state,
        "python_rng": pyrandom.Random(5).getstate(),
    }
    out = roundtrip(state)
    rng = pyrandom.Random()
    rng.setstate(out["python_rng"])
    np.random.set_state(out["numpy_rng"])
    torch.set_rng_state(out["torch_rng"])


# --------------------------------------------------------------------------------------
# plain values, numpy
# --------------------------------------------------------------------------------------


def test_python_scalars_and_containers() -> None:
    nan_payload = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000ABCDEF))[0]
    roundtrip(
        {
            "none": None,
            "bools": [True, False],
            "ints": [0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 2**64, -(2**64) - 1, 10**5000, -(10**5000)],
            "floats": [0.0, -0.0, 1.5, float("inf"), float("-inf"), float("nan"), nan_payload, 5e-324],
            "strs": ["", "héllo ✓ \U0001f600", "\ud800 lone surrogate", "\x00nul"],
            "bytes": [b"", b"\x00\xff" * 10],
            "bytearray": bytearray(b"mutable"),
            "list": [1, [2, [3]]],
            "tuple": (1, (2, 3), []),
            "empty": [(), [], {}, collections.OrderedDict()],
            "size": torch.Size([2, 3, 4]),
            "dtypes": [torch.bfloat16, torch.float8_e4m3fn, torch.qint8, torch.bool],
            "devices": [torch.device("cpu"), torch.device("cuda", 1), torch.device("meta")],
            "sets": [{1, "a", (2, 3.5)}, frozenset({None, False})],
        }
    )


def test_tuple_and_list_stay_distinct() -> None:
    out = decode(encode([(1, 2), [1, 2], ((),), [[]]]))
    assert out == [(1, 2), [1, 2], ((),), [[]]]
    assert [type(x) for x in out] == [tuple, list, tuple, list]
    assert type(out[2][0]) is tuple and type(out[3][0]) is list


def test_non_str_dict_keys() -> None:
    state = {
        0: "int",
        -5: "neg",
        2**70: "bigint",
        1.5: "float",
        True: "bool",
        None: "none",
        ("a", 1, (2.5, None)): "tuple",
        "s": "str",
    }
    out = roundtrip(state)
    assert list(out) == list(state)
    neg_zero = decode(encode({-0.0: 1}))
    assert math.copysign(1.0, next(iter(neg_zero))) == -1.0


@pytest.mark.parametrize(
    "dtype",
    [
        "<f4",
        ">f4",
        "<f2",
        "<f8",
        ">i8",
        "u1",
        "<u2",
        "?",
        "<c16",
        "<U5",
        "S3",
        "<M8[ns]",
        "<m8[s]",
        "V4",
        [("a", "<f4"), ("b", ">i2", (2,))],
    ],
    ids=str,
)
def test_numpy_arrays(dtype: Any) -> None:
    dt = np.dtype(dtype)
    data = np.random.default_rng(0).integers(0, 256, size=24 * dt.itemsize, dtype=np.uint8)
    if dt.kind == "b":
        data = data % 2
    if dt.kind == "U":
        data = np.frombuffer("abcde".encode("utf-32-le") * 24, dtype=np.uint8)
    arr = data.view(dt).reshape(4, 6)
    out = roundtrip({"arr": arr, "nc": arr[:, ::2], "t": arr.T, "zero_d": arr[1, 1].reshape(()), "empty": arr[:0], "scalar": arr[2, 3]})
    assert out["arr"].dtype == dt


def test_numpy_scalars_and_dtypes() -> None:
    values = [
        np.float32(1.5),
        np.float64(-0.0),
        np.float16(3),
        np.int8(-3),
        np.uint64(2**64 - 1),
        np.int64(-(2**63)),
        np.bool_(True),
        np.complex64(1 + 2j),
        np.str_("héllo"),
        np.str_(""),
        np.bytes_(b"ab"),
        np.datetime64("2020-01-01T00:00"),
        np.timedelta64(5, "s"),
        np.dtype("<f4"),
        np.dtype(">i2"),
        np.dtype([("x", "<u1"), ("y", "<f8")]),
    ]
    out = roundtrip(values)
    assert [type(v) for v in out] == [type(v) for v in values]


def test_empty_and_nested_oddities() -> None:
    roundtrip(None)
    roundtrip(torch.randn(3))
    roundtrip([])
    roundtrip({"a": {"b": {"c": {"d": [[[[torch.ones(1)]]]]}}}})


def test_max_depth_is_accepted_one_more_is_not() -> None:
    ok: Any = 1
    for _ in range(ser.MAX_DEPTH):
        ok = [ok]
    assert decode(encode(ok)) == ok
    with pytest.raises(SerializationError, match="nesting deeper"):
        plan([ok])


# --------------------------------------------------------------------------------------
# rejected input
# --------------------------------------------------------------------------------------


class Custom:
    pass


class Point(NamedTuple):
    x: int
    y: int


class MyTensor(torch.Tensor):
    pass


@pytest.mark.parametrize(
    ("make", "type_fragment"),
    [
        (Custom, "Custom"),
        (lambda: lambda: 1, "function"),
        (lambda: Point(1, 2), "namedtuple"),
        (lambda: collections.defaultdict(list), "defaultdict"),
        (lambda: np.array([1, object()], dtype=object), "Python objects"),
        (lambda: torch.zeros(2).to_sparse(), "sparse"),
        (lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8), "quantized"),
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
        (lambda: torch.empty(2, device="meta"), "meta"),
        (lambda: torch.zeros(2).as_subclass(MyTensor), "subclass"),
        (lambda: range(3), "range"),
        (lambda: 1 + 2j, "complex"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_unsupported_values_name_their_path(make: Callable[[], Any], type_fragment: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized / nested tensors warn on creation
        bad = make()
        state = {"optim": {"state": {0: {"step": torch.tensor(1.0)}, 3: {"step": 1, "exp_avg": bad}}}}
        with pytest.raises(SerializationError) as info:
            plan(state)
    assert info.value.path == "state['optim']['state'][3]['exp_avg']"
    assert "state['optim']['state'][3]['exp_avg']" in str(info.value)
    assert type_fragment in str(info.value)
    assert isinstance(info.value, TypeError)


def test_unsupported_keys_and_nested_paths() -> None:
    with pytest.raises(SerializationError, match=r"state\['a'\]\[1\]\[0\]: .*Custom.*convert it"):
        plan({"a": [0, (Custom(),)]})
    with pytest.raises(SerializationError, match="dict key") as info:
        plan({"a": {torch.zeros(1).dtype: 1, Custom(): 2}})
    assert info.value.path.startswith("state['a'][")
    with pytest.raises(SerializationError, match=r"state\._metadata"):
        od: collections.OrderedDict[str, int] = collections.OrderedDict(a=1)
        od._metadata = {"": Custom()}  # type: ignore[attr-defined]
        plan(od)


def test_reference_cycles_are_detected() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    with pytest.raises(SerializationError, match="cycle") as info:
        plan({"x": loop})
    assert info.value.path == "state['x'][1]"
    d: dict[str, Any] = {}
    d["inner"] = {"back": d}
    with pytest.raises(SerializationError, match="cycle"):
        plan(d)
    od: collections.OrderedDict[str, int] = collections.OrderedDict()
    od._metadata = {"self": od}  # type: ignore[attr-defined]
    with pytest.raises(SerializationError, match="cycle"):
        plan(od)


def test_too_deep_for_the_stack_is_a_serialization_error() -> None:
    deep: Any = 0
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(SerializationError):
        plan(deep)
