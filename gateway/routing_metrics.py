"""Per-deployment metrics, read from routing's own counters at scrape time.

`switchyard_deployment_requests_total{model,deployment,outcome}` (success | failure |
fallback | client_error), `switchyard_deployment_in_flight`, `switchyard_deployment_healthy`
(1 in rotation, 0 cooling down or failing health checks),
`switchyard_deployment_cooldowns_total` and the `switchyard_deployment_latency_seconds`
histogram (each finished attempt, from opening to its last event or its failure).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from routing.deployment import Deployment
from routing.stats import OUTCOMES

Deployments = Callable[[], Iterable[tuple[str, Deployment]]]
_LABELS = ["model", "deployment"]


class DeploymentCollector(Collector):
    def __init__(self, deployments: Deployments) -> None:
        self._deployments = deployments

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "switchyard_deployment_requests", "Attempts on a deployment, by outcome",
            labels=[*_LABELS, "outcome"])
        in_flight = GaugeMetricFamily(
            "switchyard_deployment_in_flight", "Requests in flight on a deployment",
            labels=_LABELS)
        healthy = GaugeMetricFamily(
            "switchyard_deployment_healthy", "1 while a deployment is in rotation, else 0",
            labels=_LABELS)
        cooldowns = CounterMetricFamily(
            "switchyard_deployment_cooldowns", "Cooldowns a deployment entered after failures",
            labels=_LABELS)
        latency = HistogramMetricFamily(
            "switchyard_deployment_latency_seconds",
            "Duration of finished attempts on a deployment", labels=_LABELS)
        for model, d in self._deployments():
            labels = [model, d.name]
            for outcome in OUTCOMES:
                requests.add_metric([*labels, outcome], d.stats.outcomes[outcome])
            in_flight.add_metric(labels, d.in_flight)
            healthy.add_metric(labels, 1.0 if d.in_rotation else 0.0)
            cooldowns.add_metric(labels, d.stats.cooldowns)
            latency.add_metric(labels, d.stats.latency.cumulative(), d.stats.latency.total)
        yield from (requests, in_flight, healthy, cooldowns, latency)
