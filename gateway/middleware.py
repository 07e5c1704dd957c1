"""Pure ASGI middleware counting requests by route/model/status and timing them.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and `receive()`-based
disconnect detection pass through untouched.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.metrics import GatewayMetrics

LABELS_KEY = "switchyard.labels"
CLIENT_CLOSED = 499  # nginx's "client closed request", for metrics only


def set_model_label(scope: Scope, model: str) -> None:
    labels = scope.get(LABELS_KEY)
    if labels is not None:
        labels["model"] = model


def set_status_label(scope: Scope, status: int) -> None:
    labels = scope.get(LABELS_KEY)
    if labels is not None:
        labels["status"] = status


class MetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        labels: dict[str, Any] = {"model": "", "status": 500}
        scope[LABELS_KEY] = labels
        started = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start" and labels["status"] != CLIENT_CLOSED:
                labels["status"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self._record(scope, labels, time.perf_counter() - started)

    def _record(self, scope: Scope, labels: dict[str, Any], elapsed: float) -> None:
        route = scope.get("route")
        path = getattr(route, "path", None) or "unmatched"
        model = labels["model"]
        self.metrics.requests.labels(path, model, str(labels["status"])).inc()
        self.metrics.duration.labels(path, model).observe(elapsed)
