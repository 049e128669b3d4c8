"""The save path on 32 real store processes: retention costs each store at most 2 x R List/LatestStep calls per saved step.

With ``CheckpointClient(group=...)`` the ranks' restorable floor rides on their commits and on the replicas'
headers, so no store lists the cluster to evict (``memstore.devtools.save_scale``). Without it, each store would
list its 31 peers at every save beyond --keep.
"""

from __future__ import annotations

import pytest

from memstore.devtools import save_scale

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_retention_at_32_hosts_costs_each_store_at_most_2r_calls_per_saved_step() -> None:
    replicas = 2
    result = save_scale.run(hosts=32, replicas=replicas, keep=2, measured=3, compare=False)["floor"]
    assert result["retention_calls_per_store_per_save_max"] <= 2 * replicas, result
    assert result["listings_per_store_per_save_max"] == 0, result  # no store asked the cluster
    assert result["steps_held_max"] <= 2 + 2, result  # and retention still evicted (keep 2, the floor lags at most 2)
