"""GET /health (open; its detail for the admin key) and /metrics (--metrics-auth): the routes
operators and proxies poll.

/health never reaches an upstream: a remote deployment's health is what routing's background
checker last heard from it (and the router's own cooldowns), so polling /health costs the
upstreams nothing. Where keys are on, it answers its status alone unless asked with the admin
key; with it (and in open mode, where every caller is trusted) every model's and
deployment's state and why (never an upstream's address: backends leave those out).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from auth.access import OpenAccess, bearer_token
from auth.keys import hash_key, same_hash
from gateway.drain import drain_of
from gateway.guard import metrics_guard
from gateway.openapi import Answer, documented
from gateway.service_schema import Health
from gateway.state import gateway_state
from routing.deployment import Deployment, DeploymentState
from routing.health import current
from routing.registry import ModelEntry

log = logging.getLogger("switchyard.gateway")
router = APIRouter()
HEALTH_TIMEOUT_S = 5.0


async def _deployment_health(deployment: Deployment) -> dict[str, Any]:
    """Ready: its backend is ready (by what it knows now, asking no upstream) and routing has
    not taken it out for failures."""
    health = await current(deployment.backend.health, HEALTH_TIMEOUT_S)
    cooling = deployment.state is DeploymentState.COOLING_DOWN
    report: dict[str, Any] = {
        "ready": health.ready and not cooling,
        "detail": deployment.detail if health.ready else health.detail,
        "state": deployment.state.value, "in_flight": deployment.in_flight,
    }
    if health.load is not None and not health.ready:  # loading: the stage now, those done
        report["load"] = health.load.report()
    return report


async def _model_health(entry: ModelEntry) -> dict[str, Any]:
    reports = await asyncio.gather(*(_deployment_health(d) for d in entry.deployments))
    ready = any(r["ready"] for r in reports)
    details = [] if ready else [r["detail"] for r in reports if r["detail"]]
    return {
        "ready": ready, "detail": "; ".join(details),
        "deployments": {d.name: r for d, r in zip(entry.deployments, reports, strict=True)},
    }


def _shows_detail(request: Request) -> bool:
    """In open mode (no keys: every caller is trusted with everything) or for the admin key,
    checked here without the key store: /health must answer while Redis is away."""
    state = gateway_state(request)
    if isinstance(state.access, OpenAccess):
        return True
    admin = state.settings.admin_key
    token = bearer_token(request.headers.get("authorization"))
    if admin is None or not admin.get_secret_value() or token is None:
        return False
    return same_hash(hash_key(token), hash_key(admin.get_secret_value()))


@router.get("/health", **documented(
    Answer(200, "Every model has a ready deployment.", model=Health),
    Answer(503, "Some model has no ready deployment, or the server is draining.",
           model=Health),
    errors=(), secured=False))
async def health(request: Request) -> JSONResponse:
    """200 when every model has a ready deployment; 503 while any model has none, and
    while the server drains before it exits (gateway/drain.py). Where API keys are on, the
    per-model and per-deployment report comes with the admin key only."""
    if drain_of(request.app).draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    models = gateway_state(request).models.models()
    reports = await asyncio.gather(*(_model_health(m) for m in models))
    ready = all(r["ready"] for r in reports)
    body: dict[str, Any] = {"status": "ok" if ready else "unavailable"}
    if _shows_detail(request):
        body["models"] = {m.name: r for m, r in zip(models, reports, strict=True)}
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics", dependencies=[Depends(metrics_guard)], **documented(
    Answer(200, "Prometheus text exposition.", text=CONTENT_TYPE_LATEST),
    errors=(401, 403, 503)))
async def metrics(request: Request) -> Response:
    return Response(gateway_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)

