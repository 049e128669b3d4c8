"""A replica group's CUDA state saved as stripes (each member copies its slices off the device) and restored whole,
onto the CPU and onto the device, bit for bit (docs/client.md, "Data parallelism")."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.gpu.test_gpu_capture import gpu_state
from tests.states import assert_same
from trainer_client import CheckpointClient, Connection

pytestmark = [pytest.mark.gpu, pytest.mark.integration]


def on_cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


@pytest.mark.parametrize("shared", [True, False], ids=["shm", "remote"])
@pytest.mark.parametrize("capture", ["copied", "enqueued"])
def test_a_cuda_state_saved_in_stripes_restores_bit_exactly(make_cluster, shared: bool, capture: str) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(hosts=2, replicas=2, capacity="1GiB")
    state, expected = gpu_state(5, scale=4)
    clients = [CheckpointClient(f"gpu-stripes-{capture}", r, 2, connection=Connection(cluster.address(f"h{r}"), shared_memory=shared),
                                run_id="r1", replica_group=[0, 1]) for r in range(2)]  # fmt: skip
    try:
        for step in (1, 2):
            handles = [c.save(step, state, capture=capture) for c in clients]
            for h in handles:
                h.wait_captured(block=True)
                assert h.wait(60).committed
        for c in clients:
            assert_same(c.load(2), expected)
            out = c.load(2, map_location="cuda")
            assert all(v.device.type == "cuda" for v in out.values() if isinstance(v, torch.Tensor))
            assert_same(on_cpu(out), on_cpu(expected))
    finally:
        for c in clients:
            c.close()
