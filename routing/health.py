"""HealthChecker: the background task that takes deployments out of rotation and back.

Every tick (at most a second) it probes, with `backend.check_health()` (an upstream
backend: asks its server) or else `backend.health()`, each deployment
whose probe is due: a cooling-down one when its cooldown ends, an unhealthy one every
`min(cooldown_seconds, health_check_interval)` (a ready answer puts either back in
rotation), a healthy one every `health_check_interval` (a not-ready answer takes it out,
so a dead deployment is noticed without traffic).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from backends.base import Backend, Health
from routing.deployment import Deployment, DeploymentState
from routing.policy import RoutingPolicy

log = logging.getLogger("switchyard.routing")
MAX_TICK_S = 1.0


async def probe(backend: Backend, timeout: float) -> Health:
    """A fresh answer: the backend's `check_health()` where it has one (an upstream backend
    asks its server; its `health()` only recalls the last answer), else `health()`. An
    exception or a timeout reads as not ready."""
    check = getattr(backend, "check_health", None) or backend.health
    return await current(check, timeout)


async def current(check: Callable[[], Awaitable[Health]], timeout: float) -> Health:
    """`check()`, where an exception or a timeout reads as not ready."""
    try:
        return await asyncio.wait_for(check(), timeout)
    except TimeoutError:
        return Health(ready=False, detail=f"health check timed out after {timeout:g} s")
    except Exception as exc:
        return Health(ready=False, detail=f"health check failed: {exc!r}")


class HealthChecker:
    def __init__(
        self, deployments: Callable[[], Iterable[tuple[str, Deployment]]], policy: RoutingPolicy,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._deployments = deployments  # (model name, deployment) pairs
        self._policy = policy
        self._clock = clock
        self._task: asyncio.Task[None] | None = None

    @property
    def tick(self) -> float:
        p = self._policy
        return min(MAX_TICK_S, p.health_check_interval, p.cooldown_seconds)

    async def check_due(self) -> None:
        """Probe every deployment whose probe is due (concurrently) and apply the answers."""
        now = self._clock()
        due = [(m, d) for m, d in self._deployments() if d.probe_due(now, self._policy)]
        if not due:
            return
        answers = await asyncio.gather(
            *(probe(d.backend, self._policy.probe_timeout) for _, d in due))
        for (model, deployment), health in zip(due, answers, strict=True):
            self._apply(model, deployment, health)

    def _apply(self, model: str, deployment: Deployment, health: Health) -> None:
        before = deployment.state
        deployment.probed(self._clock(), health, self._policy)
        if deployment.state is before:
            return
        if deployment.state is DeploymentState.HEALTHY:
            log.info("deployment %s of model %s is back in rotation", deployment.name, model)
        else:
            log.warning("deployment %s of model %s is out of rotation: %s",
                        deployment.name, model, deployment.detail)

    async def _run(self) -> None:
        while True:
            try:
                await self.check_due()
            except Exception:  # the checker must outlive any one bad probe
                log.exception("health check round failed")
            await asyncio.sleep(self.tick)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="switchyard-health-checker")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
