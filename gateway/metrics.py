"""Prometheus metrics, in a CollectorRegistry owned by one app (never the global one)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from backends.base import Backend, Usage

log = logging.getLogger("switchyard.gateway")

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)


class BackendGauges(Collector):
    """Queue, running and KV-block gauges read from each backend's `stats()` at scrape time."""

    def __init__(self, backends: Callable[[], list[tuple[str, Backend]]]) -> None:
        self._backends = backends

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = {
            "queue_size": GaugeMetricFamily(
                "switchyard_queue_size", "Requests waiting to be scheduled", labels=["model"]),
            "running": GaugeMetricFamily(
                "switchyard_running_requests", "Requests being generated", labels=["model"]),
            "kv_blocks_used": GaugeMetricFamily(
                "switchyard_kv_blocks_used", "KV cache blocks in use", labels=["model"]),
            "kv_blocks_total": GaugeMetricFamily(
                "switchyard_kv_blocks_total", "KV cache blocks in all", labels=["model"]),
        }
        for name, backend in self._backends():
            try:
                stats = backend.stats()
            except Exception:  # a scrape must not fail because one backend is broken
                log.exception("stats() failed for model %s", name)
                continue
            for attr, family in families.items():
                family.add_metric([name], float(getattr(stats, attr)))
        yield from families.values()


class GatewayMetrics:
    def __init__(self, backends: Callable[[], list[tuple[str, Backend]]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "switchyard_requests", "HTTP requests by route, model and status",
            ["route", "model", "status"], registry=r)
        self.duration = Histogram(
            "switchyard_request_duration_seconds", "HTTP request duration (whole stream)",
            ["route", "model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(
            "switchyard_prompt_tokens", "Prompt tokens processed", ["model"], registry=r)
        self.generated_tokens = Counter(
            "switchyard_generated_tokens", "Tokens generated", ["model"], registry=r)
        self.ttft = Histogram(
            "switchyard_time_to_first_token_seconds", "Time from request to first token",
            ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        r.register(BackendGauges(backends))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def trace(self, model: str) -> GenerationTrace:
        return GenerationTrace(self, model)


@dataclass
class GenerationTrace:
    """One generation's token accounting: time to first token, then usage at the end."""

    metrics: GatewayMetrics
    model: str
    started: float = field(default_factory=time.perf_counter)
    _first_seen: bool = False

    def event(self, has_tokens: bool) -> None:
        if has_tokens and not self._first_seen:
            self._first_seen = True
            self.metrics.ttft.labels(self.model).observe(time.perf_counter() - self.started)

    def finished(self, usage: Usage) -> None:
        self.metrics.prompt_tokens.labels(self.model).inc(usage.prompt_tokens)
        self.metrics.generated_tokens.labels(self.model).inc(usage.completion_tokens)
