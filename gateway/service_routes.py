"""GET /health (open) and /metrics (--metrics-auth): the routes operators and proxies poll."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.guard import metrics_guard
from gateway.state import gateway_state
from routing.deployment import Deployment, DeploymentState
from routing.health import probe
from routing.registry import ModelEntry

log = logging.getLogger("switchyard.gateway")
router = APIRouter()
HEALTH_TIMEOUT_S = 5.0


async def _deployment_health(deployment: Deployment) -> dict[str, Any]:
    """Ready: its backend answers ready now and routing has not taken it out for failures."""
    health = await probe(deployment.backend, HEALTH_TIMEOUT_S)
    cooling = deployment.state is DeploymentState.COOLING_DOWN
    return {
        "ready": health.ready and not cooling,
        "detail": deployment.detail if health.ready else health.detail,
        "state": deployment.state.value, "in_flight": deployment.in_flight,
    }


async def _model_health(entry: ModelEntry) -> dict[str, Any]:
    reports = await asyncio.gather(*(_deployment_health(d) for d in entry.deployments))
    ready = any(r["ready"] for r in reports)
    details = [] if ready else [r["detail"] for r in reports if r["detail"]]
    return {
        "ready": ready, "detail": "; ".join(details),
        "deployments": {d.name: r for d, r in zip(entry.deployments, reports, strict=True)},
    }


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 when every model has a ready deployment; 503 while any model has none."""
    models = gateway_state(request).models.models()
    reports = await asyncio.gather(*(_model_health(m) for m in models))
    ready = all(r["ready"] for r in reports)
    return JSONResponse(
        {"status": "ok" if ready else "unavailable",
         "models": {m.name: r for m, r in zip(models, reports, strict=True)}},
        status_code=200 if ready else 503,
    )


@router.get("/metrics", dependencies=[Depends(metrics_guard)])
async def metrics(request: Request) -> Response:
    return Response(gateway_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)

