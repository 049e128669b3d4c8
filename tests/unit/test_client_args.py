"""CheckpointClient refuses bad arguments before it connects, naming where the bad value came from."""

from __future__ import annotations

import pytest

from trainer_client import CheckpointClient
from trainer_client.errors import InvalidArgumentError

pytestmark = pytest.mark.unit


def test_bad_run_id_names_its_source(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidArgumentError, match=r"run_id 'a b' is invalid.*\(from run_id=\)"):
        CheckpointClient("j", 0, 1, store="127.0.0.1:1", run_id="a b")
    monkeypatch.setenv("MEMSTORE_RUN_ID", "x" * 101)
    with pytest.raises(InvalidArgumentError, match=r"is invalid.*\(from MEMSTORE_RUN_ID\)"):
        CheckpointClient("j", 0, 1, store="127.0.0.1:1")
