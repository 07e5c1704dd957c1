"""Per-deployment counters, kept by routing and read by the gateway's /metrics at scrape time."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Literal

Outcome = Literal["success", "failure", "fallback", "client_error"]
OUTCOMES: tuple[Outcome, ...] = ("success", "failure", "fallback", "client_error")
LATENCY_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)


@dataclass
class LatencyHistogram:
    """Counts per bucket (not cumulative; the last slot is +Inf) and the sum of seconds."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total += seconds

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus' (le, cumulative count) pairs, +Inf last."""
        out, running = [], 0
        for bound, count in zip((*LATENCY_BUCKETS, float("inf")), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


@dataclass
class DeploymentStats:
    """Attempts by outcome, cooldowns started, and the latency of finished attempts.

    `fallback`: the attempt failed before its first event and the request moved on.
    `failure`: it failed and the request ended with its error (or failed mid-stream).
    `client_error`: the backend refused the request as a client mistake (never a failure).
    """

    outcomes: dict[Outcome, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    cooldowns: int = 0
    latency: LatencyHistogram = field(default_factory=LatencyHistogram)

    def record(self, outcome: Outcome, seconds: float | None = None) -> None:
        self.outcomes[outcome] += 1
        if seconds is not None:
            self.latency.observe(seconds)
