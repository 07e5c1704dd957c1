"""Prometheus metrics, in a CollectorRegistry owned by one app (never the global one).

TGI's names where they apply, so TGI's dashboards work unchanged: `tgi_request_*`
per generation request (OpenAI and TGI routes alike), `tgi_batch_*` and
`tgi_queue_size` from each backend's `stats()`, `tgi_batch_forward_duration`
from its step timings. `switchyard_*` for the rest (per-route HTTP counts, time
to first token, inter-token latency, KV blocks, prefix cache, preemptions).
Every series has a `model` label: one gateway serves several models.
`switchyard_deployment_*` (gateway/routing_metrics.py) add a `deployment` label.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from backends.base import Backend, BackendStats, RequestTimings, Usage
from gateway.key_metrics import KeyMetrics
from gateway.routing_metrics import DeploymentCollector, Deployments

log = logging.getLogger("switchyard.gateway")
Backends = Callable[[], list[tuple[str, Backend]]]

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)
# TGI's: 35 buckets, a geometric series from 0.15 ms by 1.5 (up to ~2.5 minutes).
DURATION_BUCKETS = tuple(0.0001 * 1.5**k for k in range(1, 36))
TOKEN_BUCKETS = tuple(float(2**k) for k in range(18))  # 1 .. 131072 tokens
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0,
)
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)


@dataclass
class RequestLabels:
    """What the middleware learns about one HTTP request while it runs."""

    model: str = ""
    status: int = 500
    error: str | None = None  # the failure kind (tgi_request_failure's `err`), once known
    succeeded: bool = False  # a generation finished normally
    # For the access line (gateway/access_log.py):
    request_id: str = ""
    generation_id: str | None = None  # the response's `id`
    key_id: str | None = None  # the API key's id (never the key)
    deployment: str | None = None  # the deployment that answered
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    queue_s: float | None = None  # waiting to be scheduled
    ttft_s: float | None = None  # from the route's start to the first token


current_request: ContextVar[RequestLabels | None] = ContextVar(
    "switchyard_request", default=None)


def failure_kind(status: int, error_type: str | None = None) -> str:
    """tgi_request_failure's `err` label for an error answer (TGI's names where they exist)."""
    if error_type == "overloaded":
        return "overloaded"
    if error_type == "rate_limit_error":
        return "rate_limited"
    if status < 400 or status == 499:
        return "aborted"  # the client left, or the stream was cut short
    if status in (400, 413, 415, 422):
        return "validation"
    if status in (401, 403):
        return "unauthorized"
    if status == 404:
        return "not_found"
    if status == 429:
        return "overloaded"
    if status == 503:
        return "unavailable"
    if status == 504 or error_type == "timeout_error":
        return "timeout"
    return "generation"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class ExactCounter:
    """A counter exposed under its exact name, as TGI does (`tgi_request_count`, no `_total`).

    prometheus_client always appends `_total` to counters, so these few render themselves.
    """

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self._values: dict[tuple[str, ...], float] = {}
        self._lock = threading.Lock()

    def inc(self, *labels: str) -> None:
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + 1.0

    def value(self, *labels: str) -> float:
        return self._values.get(labels, 0.0)

    def expose(self) -> str:
        lines = [f"# HELP {self.name} {self.documentation}", f"# TYPE {self.name} counter"]
        with self._lock:
            items = sorted(self._values.items())
        for labels, value in items:
            pairs = ",".join(
                f'{k}="{_escape(v)}"' for k, v in zip(self.labelnames, labels, strict=True))
            lines.append(f"{self.name}{{{pairs}}} {float(value)!r}")
        return "\n".join(lines) + "\n"


_GAUGES = (  # (BackendStats field, metric name, help)
    ("queue_size", "tgi_queue_size", "Requests waiting to be scheduled"),
    ("running", "tgi_batch_current_size", "Sequences in the running batch"),
    ("batch_max_tokens", "tgi_batch_current_max_tokens",
     "Tokens the running batch may grow to (prompts + max new tokens)"),
    ("batch_next_size", "tgi_batch_next_size", "Sequences that joined the batch in the last step"),
    ("queue_size", "switchyard_queue_size", "Requests waiting to be scheduled"),
    ("running", "switchyard_running_requests", "Requests being generated"),
    ("kv_blocks_used", "switchyard_kv_blocks_used", "KV cache blocks in use"),
    ("kv_blocks_total", "switchyard_kv_blocks_total", "KV cache blocks in all"),
)
_CUMULATIVE = (  # counters the backend keeps itself; exposed with a `_total` suffix
    ("prefix_cache_queries", "switchyard_prefix_cache_queries",
     "Prompt blocks looked up in the prefix cache"),
    ("prefix_cache_hits", "switchyard_prefix_cache_hits",
     "Prompt blocks found in the prefix cache"),
    ("preemptions", "switchyard_preemptions",
     "Sequences preempted (blocks given back, recomputed later)"),
    ("step_failures", "switchyard_engine_step_failures",
     "Engine steps that raised (their requests were retried alone)"),
    ("failed_requests", "switchyard_engine_failed_requests",
     "Requests failed by an engine error"),
)
# Counters with one extra label: (metric name, help, label, ((label value, field), ...)).
_LABELLED = (
    ("switchyard_queue_rejections", "Requests refused with 429 for a full queue, by limit",
     "limit", (("requests", "queue_rejections_requests"), ("tokens", "queue_rejections_tokens"))),
    ("switchyard_request_timeouts", "Requests ended by a deadline (--queue-timeout: queue; "
     "--request-timeout: total)", "kind", (("queue", "queue_timeouts"),
                                           ("total", "request_timeouts"))),
)


class BackendCollector(Collector):
    """Gauges and cumulative counters read from each backend's `stats()` at scrape time."""

    def __init__(self, backends: Backends) -> None:
        self._backends = backends

    def collect(self) -> Iterator[Metric]:
        gauges = [(attr, GaugeMetricFamily(name, doc, labels=["model"]))
                  for attr, name, doc in _GAUGES]
        counters = [(attr, CounterMetricFamily(name, doc, labels=["model"]))
                    for attr, name, doc in _CUMULATIVE]
        labelled = [(values, CounterMetricFamily(name, doc, labels=["model", label]))
                    for name, doc, label, values in _LABELLED]
        experts = CounterMetricFamily(
            "switchyard_moe_expert_tokens", "Tokens routed to each expert of a mixture-of-experts "
            "model, summed over its MoE layers (an uneven spread is expert imbalance)",
            labels=["model", "expert"])
        for name, stats in self._stats():
            for expert, tokens in enumerate(stats.expert_tokens):
                experts.add_metric([name, str(expert)], float(tokens))
            for attr, family in (*gauges, *counters):
                family.add_metric([name], float(getattr(stats, attr)))
            for values, family in labelled:
                for value, attr in values:
                    family.add_metric([name, value], float(getattr(stats, attr)))
        yield from (family for _, family in gauges)
        yield from (family for _, family in counters)
        yield from (family for _, family in labelled)
        if experts.samples:
            yield experts

    def _stats(self) -> Iterator[tuple[str, BackendStats]]:
        for name, backend in self._backends():
            try:
                yield name, backend.stats()
            except Exception:  # a scrape must not fail because one backend is broken
                log.exception("stats() failed for model %s", name)


class GatewayMetrics:
    def __init__(self, backends: Backends, deployments: Deployments | None = None) -> None:
        self._backends = backends
        self.registry = CollectorRegistry(auto_describe=True)
        self._http_metrics()
        self.keys = KeyMetrics(self.registry)
        self._request_metrics()
        self._latency_metrics()
        self.registry.register(BackendCollector(backends))
        if deployments is not None:
            self.registry.register(DeploymentCollector(deployments))

    def _http_metrics(self) -> None:
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

    def _request_metrics(self) -> None:
        r, model = self.registry, ["model"]
        self.request_count = ExactCounter(
            "tgi_request_count", "Generation requests received", ("model",))
        self.request_success = ExactCounter(
            "tgi_request_success", "Generation requests that finished normally", ("model",))
        self.request_failure = ExactCounter(
            "tgi_request_failure", "Generation requests that failed, by kind", ("err", "model"))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, model, buckets=buckets, registry=r)

        self.request_duration = histogram(
            "tgi_request_duration", "Whole request duration, successes (s)", DURATION_BUCKETS)
        self.queue_duration = histogram(
            "tgi_request_queue_duration", "Time waiting to be scheduled (s)", DURATION_BUCKETS)
        self.inference_duration = histogram(
            "tgi_request_inference_duration", "Time from first scheduled step to end (s)",
            DURATION_BUCKETS)
        self.time_per_token = histogram(
            "tgi_request_mean_time_per_token_duration", "Inference time per generated token (s)",
            DURATION_BUCKETS)
        self.input_length = histogram(
            "tgi_request_input_length", "Prompt tokens per request", TOKEN_BUCKETS)
        self.request_generated_tokens = histogram(
            "tgi_request_generated_tokens", "Generated tokens per request", TOKEN_BUCKETS)

    def _latency_metrics(self) -> None:
        r = self.registry
        self.ttft = Histogram(
            "switchyard_time_to_first_token_seconds", "Time from request to first token",
            ["model"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(
            "switchyard_inter_token_latency_seconds", "Time between token-bearing chunks",
            ["model"], buckets=ITL_BUCKETS, registry=r)
        self.forward_duration = Histogram(
            "tgi_batch_forward_duration", "Engine step duration by method (s)",
            ["model", "method"], buckets=DURATION_BUCKETS, registry=r)

    def render(self) -> bytes:
        self._observe_steps()
        counters = (self.request_count, self.request_success, self.request_failure)
        exact = "".join(c.expose() for c in counters).encode()
        return generate_latest(self.registry) + exact

    def _observe_steps(self) -> None:
        """Step timings the backends recorded since the last scrape -> the forward histogram."""
        for name, backend in self._backends():
            drain = getattr(backend, "drain_step_timings", None)
            if drain is None:
                continue
            try:
                steps = drain()
            except Exception:
                log.exception("drain_step_timings() failed for model %s", name)
                continue
            for step in steps:
                self.forward_duration.labels(name, step.method).observe(step.seconds)

    def trace(self, model: str) -> GenerationTrace:
        return GenerationTrace(self, model, current_request.get())

    def generation_done(self, labels: RequestLabels, elapsed: float) -> None:
        """One generation request's outcome, when its HTTP exchange (stream included) ends."""
        self.request_count.inc(labels.model)
        if labels.succeeded:
            self.request_success.inc(labels.model)
            self.request_duration.labels(labels.model).observe(elapsed)
        else:
            err = labels.error or failure_kind(labels.status)
            self.request_failure.inc(err, labels.model)


@dataclass
class GenerationTrace:
    """One generation's token accounting: first-token and inter-token latency, then usage."""

    metrics: GatewayMetrics
    model: str
    request: RequestLabels | None = None
    started: float = field(default_factory=time.perf_counter)
    _last_token_at: float | None = None
    _itl: Histogram | None = None  # the model's inter-token histogram, looked up once

    def event(self, has_tokens: bool) -> None:
        if not has_tokens:
            return
        now = time.perf_counter()
        if self._last_token_at is None:
            self.metrics.ttft.labels(self.model).observe(now - self.started)
            self._itl = self.metrics.itl.labels(self.model)
            if self.request is not None:
                self.request.ttft_s = now - self.started
        elif self._itl is not None:
            self._itl.observe(now - self._last_token_at)
        self._last_token_at = now

    def finished(self, usage: Usage, timings: RequestTimings | None = None) -> None:
        m, model = self.metrics, self.model
        m.prompt_tokens.labels(model).inc(usage.prompt_tokens)
        m.generated_tokens.labels(model).inc(usage.completion_tokens)
        m.input_length.labels(model).observe(usage.prompt_tokens)
        m.request_generated_tokens.labels(model).observe(usage.completion_tokens)
        if timings is not None:
            m.queue_duration.labels(model).observe(timings.queue_seconds)
            m.inference_duration.labels(model).observe(timings.inference_seconds)
            if usage.completion_tokens:
                per_token = timings.inference_seconds / usage.completion_tokens
                m.time_per_token.labels(model).observe(per_token)
        if self.request is not None:
            self.request.succeeded = True
            self.request.prompt_tokens = usage.prompt_tokens
            self.request.completion_tokens = usage.completion_tokens
            self.request.queue_s = timings.queue_seconds if timings is not None else None

    def failed(self, kind: str) -> None:
        """A failure after the response started (an error event in a stream)."""
        if self.request is not None and self.request.error is None:
            self.request.error = kind
