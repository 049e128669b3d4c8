"""CheckpointClient refuses bad arguments before it connects, naming where the bad value came from."""

from __future__ import annotations

import pytest

from trainer_client import CheckpointClient, Connection
from trainer_client.errors import InvalidArgumentError

pytestmark = pytest.mark.unit


def test_bad_run_id_names_its_source(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidArgumentError, match=r"run_id 'a b' is invalid.*\(from run_id=\)"):
        CheckpointClient("j", 0, 1, connection=Connection("127.0.0.1:1"), run_id="a b")
    monkeypatch.setenv("MEMSTORE_RUN_ID", "x" * 101)
    with pytest.raises(InvalidArgumentError, match=r"is invalid.*\(from MEMSTORE_RUN_ID\)"):
        CheckpointClient("j", 0, 1, connection=Connection("127.0.0.1:1"))


def test_store_address_from_the_environment(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """On Kubernetes the pod sets MEMSTORE_STORE=$(HOST_IP):7070; code that passes no store uses it."""
    from trainer_client.errors import StoreUnavailableError

    monkeypatch.setenv("MEMSTORE_STORE", "127.0.0.1:1")
    with pytest.raises(StoreUnavailableError, match=r"store at 127\.0\.0\.1:1 \(from MEMSTORE_STORE\) not reachable"):
        CheckpointClient("j", 0, 1, connection=Connection(timeout=0.5))
    with pytest.raises(StoreUnavailableError, match=r"store at 127\.0\.0\.1:2 not reachable"):  # an argument wins
        CheckpointClient("j", 0, 1, connection=Connection("127.0.0.1:2", timeout=0.5))
