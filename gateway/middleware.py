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

from gateway.access_log import REQUEST_ID_HEADER, log_access, request_id
from gateway.metrics import GatewayMetrics, RequestLabels, current_request
from routing.router import served_by

LABELS_KEY = "switchyard.labels"
CLIENT_CLOSED = 499  # nginx's "client closed request", for metrics only
GENERATION_ROUTES = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/generate", "/generate_stream",
    "/", "/v1/messages", "/api/chat", "/api/generate",
    "/v1/embeddings",  # counted as a generation: its inputs are its prompt
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


def set_key_label(scope: Scope, key_id: str | None) -> None:
    """The caller's API key id (never the key), for the access line."""
    labels = _labels(scope)
    if labels is not None:
        labels.key_id = key_id


def set_generation_label(scope: Scope, generation_id: str) -> None:
    labels = _labels(scope)
    if labels is not None:
        labels.generation_id = generation_id


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
        labels = RequestLabels(request_id=request_id(scope))
        scope[LABELS_KEY] = labels
        token = current_request.set(labels)
        routed = served_by.set(lambda deployment: setattr(labels, "deployment", deployment))
        started = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                if labels.status != CLIENT_CLOSED:
                    labels.status = message["status"]
                headers = [*message.get("headers", []),
                           (REQUEST_ID_HEADER, labels.request_id.encode("latin-1"))]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            served_by.reset(routed)
            current_request.reset(token)
            elapsed = time.perf_counter() - started
            self._record(scope, labels, elapsed)
            log_access(scope, labels, elapsed)  # when the whole exchange (stream) is over

    def _record(self, scope: Scope, labels: RequestLabels, elapsed: float) -> None:
        route = scope.get("route")
        path = getattr(route, "path", None) or "unmatched"
        self.metrics.requests.labels(path, labels.model, str(labels.status)).inc()
        self.metrics.duration.labels(path, labels.model).observe(elapsed)
        if path in GENERATION_ROUTES and scope.get("method") == "POST":
            self.metrics.generation_done(labels, elapsed)

