"""Pure ASGI middleware counting requests by route/model/status and timing them.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and `receive()`-based
disconnect detection pass through untouched. For generation routes it also
settles the request's `tgi_request_*` outcome once the exchange (the whole
stream) is over: the routes, error handlers and generation traces fill in the
request's `RequestLabels` while it runs.
"""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.metrics import GatewayMetrics, RequestLabels, current_request

LABELS_KEY = "switchyard.labels"
CLIENT_CLOSED = 499  # nginx's "client closed request", for metrics only
GENERATION_ROUTES = frozenset({
    "/v1/chat/completions", "/v1/completions", "/generate", "/generate_stream", "/",
})


def _labels(scope: Scope) -> RequestLabels | None:
    return scope.get(LABELS_KEY)


def set_model_label(scope: Scope, model: str) -> None:
    labels = _labels(scope)
    if labels is not None:
        labels.model = model


def set_status_label(scope: Scope, status: int) -> None:
    labels = _labels(scope)
    if labels is not None:
        labels.status = status


def set_failure_label(scope: Scope, kind: str) -> None:
    """Why a request failed (tgi_request_failure's `err`); the first reason given wins."""
    labels = _labels(scope)
    if labels is not None and labels.error is None:
        labels.error = kind


class MetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        labels = RequestLabels()
        scope[LABELS_KEY] = labels
        token = current_request.set(labels)
        started = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start" and labels.status != CLIENT_CLOSED:
                labels.status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            current_request.reset(token)
            self._record(scope, labels, time.perf_counter() - started)

    def _record(self, scope: Scope, labels: RequestLabels, elapsed: float) -> None:
        route = scope.get("route")
        path = getattr(route, "path", None) or "unmatched"
        self.metrics.requests.labels(path, labels.model, str(labels.status)).inc()
        self.metrics.duration.labels(path, labels.model).observe(elapsed)
        if path in GENERATION_ROUTES and scope.get("method") == "POST":
            self.metrics.generation_done(labels, elapsed)

