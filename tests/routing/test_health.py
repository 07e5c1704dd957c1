"""HealthChecker: cooled-down deployments come back after a ready probe; dead ones go out."""

from __future__ import annotations

import asyncio

import pytest

from backends.base import DeploymentError, GenerationRequest, Health
from routing import Deployment, DeploymentState, HealthChecker, ModelRouter, RoutingPolicy
from routing.health import probe
from tests.routing.fakes import Clock, FakeBackend

POLICY = RoutingPolicy(cooldown_after_failures=1, cooldown_seconds=30, health_check_interval=10,
                       probe_timeout=0.2)


def _setup(*backends: FakeBackend) -> tuple[ModelRouter, HealthChecker, Clock]:
    clock = Clock()
    router = ModelRouter("m", [Deployment(b.name, b) for b in backends], POLICY, clock=clock)
    checker = HealthChecker(lambda: [("m", d) for d in router.deployments], POLICY, clock=clock)
    return router, checker, clock


async def _fail_once(router: ModelRouter) -> None:
    try:
        async for _ in router.generate(GenerationRequest(request_id="r", prompt="x")):
            pass
    except DeploymentError:
        pass


async def test_cooldown_ends_with_a_ready_probe() -> None:
    backend = FakeBackend("a", fail_open=DeploymentError("down"))
    router, checker, clock = _setup(backend)
    await checker.check_due()  # first round: every deployment is probed once
    await _fail_once(router)
    deployment = router.deployments[0]
    assert deployment.state is DeploymentState.COOLING_DOWN
    calls = backend.health_calls
    clock.now += 29
    await checker.check_due()
    assert backend.health_calls == calls  # still cooling down: not probed
    backend.ready = False
    clock.now += 1
    await checker.check_due()
    assert deployment.state is DeploymentState.UNHEALTHY and "a is down" in deployment.detail
    clock.now += 9
    await checker.check_due()
    assert deployment.state is DeploymentState.UNHEALTHY  # next probe one interval later
    backend.ready, backend.fail_open = True, None
    clock.now += 1
    await checker.check_due()
    assert deployment.in_rotation and deployment.consecutive_failures == 0


async def test_healthy_deployments_are_probed_every_interval() -> None:
    a, b = FakeBackend("a"), FakeBackend("b")
    router, checker, clock = _setup(a, b)
    await checker.check_due()
    assert (a.health_calls, b.health_calls) == (1, 1)
    clock.now += 5
    await checker.check_due()
    assert (a.health_calls, b.health_calls) == (1, 1)
    b.ready = False
    clock.now += 5
    await checker.check_due()
    assert [d.state for d in router.deployments] == [
        DeploymentState.HEALTHY, DeploymentState.UNHEALTHY]
    events = [e.text async for e in router.generate(GenerationRequest(request_id="r"))]
    assert set(events) == {"a"}


async def test_a_ready_probe_does_not_forgive_failures_in_rotation() -> None:
    """An upstream whose /health answers while every request fails must still cool down."""
    a = FakeBackend("a", fail_open=DeploymentError("404 from the upstream"))
    policy = RoutingPolicy(cooldown_after_failures=2, cooldown_seconds=30,
                           health_check_interval=10, probe_timeout=0.2)
    clock = Clock()
    router = ModelRouter("m", [Deployment("a", a)], policy, clock=clock)
    checker = HealthChecker(lambda: [("m", d) for d in router.deployments], policy, clock=clock)
    deployment = router.deployments[0]
    with pytest.raises(DeploymentError):
        _ = [e async for e in router.generate(GenerationRequest(request_id="r1"))]
    clock.now += 10
    await checker.check_due()
    assert a.health_calls == 1 and deployment.consecutive_failures == 1
    with pytest.raises(DeploymentError):
        _ = [e async for e in router.generate(GenerationRequest(request_id="r2"))]
    assert deployment.state is DeploymentState.COOLING_DOWN


async def test_a_hanging_or_raising_health_check_is_not_ready() -> None:
    class Hangs(FakeBackend):
        async def health(self) -> Health:
            await asyncio.sleep(10)
            return Health(ready=True)

    class Raises(FakeBackend):
        async def health(self) -> Health:
            raise ConnectionError("refused")

    assert "timed out" in (await probe(Hangs("h"), 0.05)).detail
    assert "refused" in (await probe(Raises("r"), 0.05)).detail


async def test_the_background_task_starts_and_stops() -> None:
    backend = FakeBackend("a")
    _, checker, _ = _setup(backend)
    checker.start()
    for _ in range(50):
        if backend.health_calls:
            break
        await asyncio.sleep(0.01)
    await checker.stop()
    assert backend.health_calls >= 1
