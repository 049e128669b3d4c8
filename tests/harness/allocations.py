"""Counting the Allocate calls a client's saves make on their own path (the ring's reservations ahead are not counted)."""

from __future__ import annotations

from typing import Any

from trainer_client import CheckpointClient


def allocations_now(client: CheckpointClient) -> list[int]:
    """The byte counts of the Allocate calls ``client``'s saves make on their own path from now on: none when a save
    finds the memory reserved ahead for it big enough."""
    calls: list[int] = []
    allocate = client._ring._allocate

    def counted(request: Any) -> Any:
        calls.append(request.nbytes)
        return allocate(request)

    client._ring._allocate = counted
    return calls
