"""Which process group a client agrees over by default (``trainer_client.job_group``), against a stand-in for
``torch.distributed``'s state; the real default group is tested in tests/integration/test_job_group.py."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from trainer_client.errors import InvalidArgumentError
from trainer_client.job_group import default_job_group, resolve_group


@pytest.fixture
def initialized(monkeypatch):  # type: ignore[no-untyped-def]
    """A default group of 4 ranks in which this process is rank 1."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)


@pytest.mark.usefixtures("initialized")
def test_the_default_group_is_the_jobs_only_when_it_has_the_clients_world_and_rank() -> None:
    assert default_job_group(1, 4) is dist.group.WORLD
    assert default_job_group(0, 4) is None  # this process is rank 1 of it
    assert default_job_group(1, 8) is None  # another world
    assert default_job_group(0, 1) is None  # one rank: nothing to agree


def test_without_torch_distributed_initialized_there_is_none() -> None:
    assert not dist.is_initialized()
    assert default_job_group(0, 4) is None


@pytest.mark.usefixtures("initialized")
def test_group_false_opts_out_and_a_group_is_kept() -> None:
    assert resolve_group(None, 1, 4) is dist.group.WORLD
    assert resolve_group(False, 1, 4) is None
    sentinel = object()
    assert resolve_group(sentinel, 1, 4) is sentinel


@pytest.mark.parametrize("wrong", [True, 0, "world", [0, 1]])
def test_anything_else_is_an_error_naming_it(wrong: object) -> None:
    with pytest.raises(InvalidArgumentError, match="group=") as info:
        resolve_group(wrong, 0, 2)
    assert repr(wrong) in str(info.value)
