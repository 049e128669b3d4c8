"""The save path on real store processes and real rank processes (gloo), clients built as the quick start shows (no
``group=``): retention costs each store at most 2 x R List/LatestStep calls per saved step, and no more at 16 hosts
than at 8. (32 hosts are in the benchmark, ``benchmarks/save_scale.py``: 0.00 calls, docs/bench/issue40-save-scale.json;
here they would add a minute to CI's slow stage.)

The clients agree over the job's default process group without being told (``trainer_client.job_group``): the ranks'
restorable floor rides on their commits and on the replicas' headers, so no store lists the cluster to evict
(``tools.save_scale``). With ``group=False`` each store would list its peers at every save beyond --keep.
"""

from __future__ import annotations

import pytest

from tools import save_scale

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPLICAS = 2


def test_retention_at_8_and_16_hosts_costs_each_store_at_most_2r_calls_per_saved_step_at_the_defaults() -> None:
    results = {n: save_scale.run(hosts=n, replicas=REPLICAS, keep=2, measured=3, compare=False)["floor"] for n in (8, 16)}
    for result in results.values():
        assert result["retention_calls_per_store_per_save_max"] <= 2 * REPLICAS, result
        assert result["listings_per_store_per_save_max"] == 0, result  # no store asked the cluster
        assert result["steps_held_max"] <= 2 + 2, result  # and retention still evicted (keep 2, the floor lags at most 2)
    calls = {n: r["retention_calls_per_store_per_save_max"] for n, r in results.items()}
    assert calls[16] <= calls[8], calls


def test_dcp_saves_at_8_and_16_hosts_cost_each_store_at_most_one_call_per_saved_step() -> None:
    """The same ranks through ``dcp.save``, a fresh MemStoreWriter per save: the floor rides DCP's plans
    (``trainer_client.dcp.floors``), so no store lists the cluster to evict; what each store serves is the coordinator's
    overwrite check (FileSystemWriter's rule), one cluster-wide LatestStep per save."""
    results = {n: save_scale.run(hosts=n, replicas=REPLICAS, keep=2, measured=3, variants=("dcp",))["dcp"] for n in (8, 16)}
    for result in results.values():
        assert result["retention_calls_per_store_per_save_max"] <= 1.5, result
        assert result["listings_per_store_per_save_max"] == 0, result
        assert result["steps_held_max"] <= 2 + 2, result
    calls = {n: r["retention_calls_per_store_per_save_max"] for n, r in results.items()}
    assert calls[16] <= calls[8], calls
