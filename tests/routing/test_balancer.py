"""Balancer: best priority first, least (in_flight + 1) / weight, ties round robin."""

from __future__ import annotations

from collections import Counter

import pytest

from routing import Balancer, Deployment, DeploymentState
from tests.routing.fakes import FakeBackend


def _dep(name: str, weight: float = 1.0, priority: int = 0) -> Deployment:
    return Deployment(name, FakeBackend(name), weight=weight, priority=priority)


def test_ties_go_round_robin() -> None:
    a, b, c = _dep("a"), _dep("b"), _dep("c")
    balancer = Balancer()
    assert [balancer.choose([a, b, c]).name for _ in range(6)] == list("abcabc")


def test_concurrent_load_follows_the_weights() -> None:
    heavy, light = _dep("heavy", weight=3), _dep("light", weight=1)
    balancer = Balancer()
    for _ in range(8):  # requests that stay in flight
        balancer.choose([heavy, light]).in_flight += 1
    assert (heavy.in_flight, light.in_flight) == (6, 2)


def test_least_in_flight_wins() -> None:
    a, b = _dep("a"), _dep("b")
    a.in_flight = 2
    assert Balancer().choose([a, b]) is b


def test_lower_priority_only_when_the_best_is_out_or_tried() -> None:
    main, spare = _dep("main", priority=0), _dep("spare", priority=1)
    balancer = Balancer()
    main.in_flight = 50  # load never spills over to a worse priority
    assert balancer.choose([spare, main]) is main
    assert balancer.choose([spare, main], exclude=[main]) is spare
    main.state = DeploymentState.COOLING_DOWN
    assert balancer.choose([spare, main]) is spare
    spare.state = DeploymentState.UNHEALTHY
    assert balancer.choose([spare, main]) is None


def test_idle_pool_prefers_the_heaviest() -> None:
    heavy, light = _dep("heavy", weight=2), _dep("light", weight=1)
    picks = Counter(Balancer().choose([light, heavy]).name for _ in range(4))
    assert picks == {"heavy": 4}


@pytest.mark.parametrize("weight", [0, -1, float("inf"), float("nan")])
def test_bad_weight_is_refused(weight: float) -> None:
    with pytest.raises(ValueError, match="weight"):
        _dep("x", weight=weight)
