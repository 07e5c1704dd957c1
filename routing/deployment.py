"""Deployment: one place a model is served from, and its routing state.

A deployment is in rotation while `healthy`. Failures (a `DeploymentError` or
`BackendUnavailable`) count up; `cooldown_after_failures` of them in a row put it
`cooling_down` until `retry_at`, when the health checker probes it. A probe that says
not ready makes it `unhealthy`, probed again every `policy.reprobe_seconds`; a ready
probe, or its backend finishing start(), puts it back in rotation. A success resets
the failure count. All of this runs on the event loop: no locks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from backends.base import Backend, Health
from routing.policy import RoutingPolicy
from routing.stats import DeploymentStats


class DeploymentState(StrEnum):
    HEALTHY = "healthy"
    COOLING_DOWN = "cooling_down"
    UNHEALTHY = "unhealthy"


@dataclass(eq=False)
class Deployment:
    """A backend serving one model, with its weight and priority (lower goes first)."""

    name: str
    backend: Backend
    weight: float = 1.0
    priority: int = 0
    in_flight: int = 0
    consecutive_failures: int = 0
    state: DeploymentState = DeploymentState.HEALTHY
    retry_at: float = 0.0  # monotonic: when an out-of-rotation deployment is probed next
    last_probe: float = -math.inf
    detail: str = ""  # why it is out of rotation
    stats: DeploymentStats = field(default_factory=DeploymentStats)

    def __post_init__(self) -> None:
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ValueError(f"deployment {self.name!r}: weight must be a number > 0")

    @property
    def in_rotation(self) -> bool:
        return self.state is DeploymentState.HEALTHY

    def succeeded(self) -> None:
        self.consecutive_failures = 0

    def failed(self, now: float, policy: RoutingPolicy, detail: str) -> bool:
        """Count one failure; True when it started a cooldown."""
        self.consecutive_failures += 1
        if not self.in_rotation or self.consecutive_failures < policy.cooldown_after_failures:
            return False
        self.state = DeploymentState.COOLING_DOWN
        self.retry_at = now + policy.cooldown_seconds
        self.detail = f"cooling down after {self.consecutive_failures} failures: {detail}"
        self.stats.cooldowns += 1
        return True

    def probe_due(self, now: float, policy: RoutingPolicy) -> bool:
        if self.in_rotation:
            return now - self.last_probe >= policy.health_check_interval
        return now >= self.retry_at

    def probed(self, now: float, health: Health, policy: RoutingPolicy) -> None:
        """A health probe's answer: ready puts it in rotation, not ready takes it out."""
        self.last_probe = now
        if health.ready:
            if not self.in_rotation:  # in rotation, only a served request resets the count
                self.recovered()
            return
        self.state = DeploymentState.UNHEALTHY
        self.retry_at = now + policy.reprobe_seconds
        self.detail = f"health check: {health.detail or 'not ready'}"

    def recovered(self) -> None:
        self.state = DeploymentState.HEALTHY
        self.consecutive_failures = 0
        self.detail = ""
