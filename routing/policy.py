"""RoutingPolicy: when a deployment cools down, for how long, and how often it is probed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoutingPolicy:
    """The models file's `routing:` section (every field optional)."""

    cooldown_after_failures: int = 3  # consecutive failures that take a deployment out
    cooldown_seconds: float = 30.0  # how long it stays out before a health probe
    health_check_interval: float = 10.0  # seconds between probes of every deployment
    probe_timeout: float = 5.0  # a health() slower than this counts as not ready

    @property
    def reprobe_seconds(self) -> float:
        """How often a deployment out of rotation is probed until it answers ready."""
        return min(self.cooldown_seconds, self.health_check_interval)

    def __post_init__(self) -> None:
        if self.cooldown_after_failures < 1:
            raise ValueError("routing.cooldown_after_failures must be at least 1")
        for name in ("cooldown_seconds", "health_check_interval", "probe_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"routing.{name} must be greater than 0")
