"""trainer_client.framework_state: a framework's checkpoint dict round-trips, objects the shard format cannot hold pickled."""

from __future__ import annotations

import collections
import enum
import pickle
from pathlib import PurePosixPath

import pytest
import torch

from trainer_client import serialization
from trainer_client.errors import InvalidArgumentError
from trainer_client.framework_state import FORMAT, pack, unpack, wrap

pytestmark = pytest.mark.unit


class Color(enum.Enum):
    RED = 1


def roundtrip(state: object, weights_only: bool | None = False) -> object:
    stored = serialization.decode(serialization.encode(pack(state)))
    return unpack(stored, weights_only=weights_only)


def test_storable_values_stay_as_they_are_and_only_the_rest_is_pickled() -> None:
    sd = collections.OrderedDict(w=torch.arange(4.0))
    sd._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    state = {"state_dict": sd, "hparams": {"path": PurePosixPath("/data"), "lr": 0.1, "pair": (Color.RED, 3)}, "epoch": 2}
    packed = pack(state)
    assert packed["format"] == FORMAT
    assert sorted(map(tuple, packed["pickled"])) == [("hparams", "pair", 0), ("hparams", "path")]
    assert packed["state"]["state_dict"] is sd and packed["state"]["hparams"]["lr"] == 0.1
    back = roundtrip(state)
    assert back["hparams"] == {"path": PurePosixPath("/data"), "lr": 0.1, "pair": (Color.RED, 3)}
    assert torch.equal(back["state_dict"]["w"], sd["w"]) and back["state_dict"]._metadata == sd._metadata


def test_a_container_with_a_key_the_format_refuses_is_pickled_whole() -> None:
    state = {"by_color": {Color.RED: torch.ones(2)}}
    assert pack(state)["pickled"] == [["by_color"]]
    back = roundtrip(state)
    assert torch.equal(back["by_color"][Color.RED], torch.ones(2))


def test_pickled_entries_follow_torch_loads_weights_only() -> None:
    stored = serialization.decode(serialization.encode(pack({"p": PurePosixPath("/x")})))
    with pytest.raises(pickle.UnpicklingError):
        unpack(stored, weights_only=True)


def test_a_state_with_nothing_to_pickle_and_a_foreign_shard() -> None:
    assert unpack(wrap({"a": 1})) == {"a": 1}
    with pytest.raises(InvalidArgumentError, match="not a framework checkpoint"):
        unpack({"a": 1})
