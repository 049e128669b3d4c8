"""memstore on a Ray cluster (slow stage): a node lost, a node added in its slot, a node drained, every store stopped.

One 4-node cluster (a head without CPUs, three 1-CPU workers) runs the scenario of ``scenario.Scenario`` past its
start (about 80 s of the default suite's two cores, hence the slow stage); ``test_ray_stores.py`` runs its start
in the default suite.
"""

from __future__ import annotations

import pytest

from tests.ray_integration.conftest import RayCluster
from tests.ray_integration.scenario import Scenario

pytestmark = [pytest.mark.ray, pytest.mark.slow]
RAY_WORKER_NODES = 3


@pytest.fixture(scope="module")
def scenario(ray_cluster: RayCluster) -> Scenario:
    return Scenario(ray_cluster)


def test_a_lost_node_restores_bit_exact_on_the_survivors(scenario: Scenario) -> None:
    scenario.reach("lost")


def test_a_new_node_takes_the_lost_slot_and_repairs(scenario: Scenario) -> None:
    scenario.reach("replaced")


def test_a_drained_node_leaves_and_loses_nothing(scenario: Scenario) -> None:
    scenario.reach("drained")


def test_stop_stores_stops_every_actor(scenario: Scenario) -> None:
    scenario.reach("stopped")
