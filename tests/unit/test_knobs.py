"""trainer_client.knobs: every switch of the trainer side read and checked in one place, a bad value named."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from memstore.v1.security import Credentials
from trainer_client import knobs
from trainer_client.errors import InvalidArgumentError

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def test_defaults_when_nothing_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(knobs.os, "cpu_count", lambda: 2)
    assert knobs.store_address({}) is None
    assert knobs.credentials({}) == Credentials()
    assert knobs.run_id(None, {}) is None
    assert knobs.trainer_hashing({}) is False
    assert knobs.marked_captures({}) is False  # auto on 2 cores: the push would take the copy's cores
    assert knobs.strict_pinning({}) is False
    assert knobs.save_switches({}) == {"trainer_hashing": False, "marked_captures": False}


def test_each_switch_follows_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(knobs.os, "cpu_count", lambda: 16)
    assert knobs.marked_captures({}) is True  # auto with enough cores
    assert knobs.store_address({"MEMSTORE_STORE": "10.0.0.5:7070"}) == "10.0.0.5:7070"
    assert knobs.credentials({"MEMSTORE_AUTH_TOKEN": "t" * 24}).token == "t" * 24
    assert knobs.run_id(None, {"MEMSTORE_RUN_ID": "run-7"}) == "run-7"
    assert knobs.run_id("given", {"MEMSTORE_RUN_ID": "run-7"}) == "given"  # run_id= wins
    assert knobs.trainer_hashing({"MEMSTORE_TRAINER_HASHING": " ON "}) is True
    assert knobs.marked_captures({"MEMSTORE_MARKED_CAPTURES": "off"}) is False
    assert knobs.strict_pinning({"MEMSTORE_STRICT_PINNING": "1"}) is True
    assert knobs.strict_pinning({"MEMSTORE_STRICT_PINNING": "0"}) is False


@pytest.mark.parametrize(
    ("read", "env", "named"),
    [
        (knobs.store_address, {"MEMSTORE_STORE": "store.local"}, r"MEMSTORE_STORE='store.local' is invalid: expected HOST:PORT"),
        (knobs.credentials, {"MEMSTORE_TLS_CA": "/no/such.pem"}, r"MEMSTORE_TLS_CA='/no/such.pem' is invalid: no such file"),
        (lambda env: knobs.run_id(None, env), {"MEMSTORE_RUN_ID": "a b"}, r"run_id 'a b' is invalid.*\(from MEMSTORE_RUN_ID\)"),
        (knobs.trainer_hashing, {"MEMSTORE_TRAINER_HASHING": "auto"}, r"MEMSTORE_TRAINER_HASHING='auto' is invalid: expected on or off"),
        (knobs.marked_captures, {"MEMSTORE_MARKED_CAPTURES": "sometimes"}, r"MEMSTORE_MARKED_CAPTURES='sometimes' is invalid"),
    ],
)
def test_a_bad_value_is_refused_naming_its_variable(read, env: dict[str, str], named: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidArgumentError, match=named):
        read(env)


def test_a_bad_token_is_named_but_never_echoed() -> None:
    with pytest.raises(InvalidArgumentError, match="MEMSTORE_AUTH_TOKEN is invalid") as err:
        knobs.credentials({"MEMSTORE_AUTH_TOKEN": "short secret"})
    assert "short secret" not in str(err.value)


def test_no_other_module_of_the_trainer_side_reads_the_environment() -> None:
    """The one place: ``os.environ``/``os.getenv`` appear in trainer_client only in knobs.py."""
    readers = []
    for path in sorted((ROOT / "trainer_client").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and getattr(node.value, "id", "") == "os":
                readers.append(str(path.relative_to(ROOT)))
    assert sorted(set(readers)) == ["trainer_client/knobs.py"]
