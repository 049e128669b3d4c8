"""Unit tests for memstore.core.redundancy: the text forms, their numbers, and every bad form refused by name."""

from __future__ import annotations

import pickle

import pytest

from memstore.core.redundancy import MAX_EC_COLUMNS, Redundancy

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("text", ["replicas:1", "replicas:2", "replicas:3", "ec:4+1", "ec:1+1", "ec:10+4", "ec:63+1", "ec:32+32"])
def test_text_round_trips(text: str) -> None:
    r = Redundancy.parse(text)
    assert str(r) == text
    assert Redundancy.parse(str(r)) == r
    assert pickle.loads(pickle.dumps(r)) == r


def test_replicas_numbers() -> None:
    r = Redundancy.parse("replicas:3")
    assert (r.kind, r.replicas, r.k, r.m) == ("replicas", 3, 0, 0)
    assert r == Redundancy.of_replicas(3)
    assert not r.erasure_coded
    assert r.group_size == 3
    assert r.survives == 2
    assert r.ram_multiple_per_step == 3.0


def test_ec_numbers() -> None:
    r = Redundancy.parse("ec:4+1")
    assert (r.kind, r.replicas, r.k, r.m) == ("ec", 1, 4, 1)
    assert r == Redundancy.erasure(4, 1)
    assert r.erasure_coded
    assert r.group_size == 5
    assert r.survives == 1
    assert r.ram_multiple_per_step == 1.25
    assert Redundancy.parse("ec:6+2").ram_multiple_per_step == pytest.approx(4 / 3)


def test_surrounding_whitespace_is_accepted() -> None:
    assert Redundancy.parse(" ec:4+1\n") == Redundancy.erasure(4, 1)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "2",
        "replicas",
        "replicas:",
        "replicas:0",
        "replicas:-1",
        "replicas:two",
        "replicas=2",
        "Replicas:2",
        "ec",
        "ec:",
        "ec:4",
        "ec:4+",
        "ec:+1",
        "ec:0+1",
        "ec:4+0",
        "ec:4-1",
        "ec:4+1+1",
        "ec:4 + 1",
        f"ec:{MAX_EC_COLUMNS}+1",
        "ec:40+40",
        "raid:4+1",
        "ec:4+1,replicas:2",
    ],
)
def test_bad_forms_are_refused_by_name(text: str) -> None:
    with pytest.raises(ValueError) as err:
        Redundancy.parse(text)
    message = str(err.value)
    assert repr(text) in message
    assert "replicas:R" in message and "ec:K+M" in message


def test_not_a_string_is_refused() -> None:
    with pytest.raises(ValueError, match="replicas:R"):
        Redundancy.parse(2)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kind, replicas, k, m",
    [("replicas", 0, 0, 0), ("replicas", 2, 1, 0), ("ec", 1, 0, 1), ("ec", 2, 4, 1), ("ec", 1, 60, 5), ("mirror", 2, 0, 0)],
)
def test_direct_construction_is_validated(kind: str, replicas: int, k: int, m: int) -> None:
    with pytest.raises(ValueError):
        Redundancy(kind, replicas, k, m)


def test_largest_group_is_the_codec_limit() -> None:
    assert Redundancy.parse(f"ec:{MAX_EC_COLUMNS - 1}+1").group_size == MAX_EC_COLUMNS
