"""GET /health (open) and /metrics (--metrics-auth): the routes operators and proxies poll."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from backends.base import Backend, Health
from gateway.guard import metrics_guard
from gateway.state import gateway_state

log = logging.getLogger("switchyard.gateway")
router = APIRouter()
HEALTH_TIMEOUT_S = 5.0


async def _health(backend: Backend) -> Health:
    try:
        return await asyncio.wait_for(backend.health(), HEALTH_TIMEOUT_S)
    except Exception as exc:
        log.warning("health check failed: %r", exc)
        return Health(ready=False, detail=f"health check failed: {exc!r}")


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 when every model is ready, 503 while any is loading or broken."""
    registry = gateway_state(request).models
    models = registry.models()
    results = await asyncio.gather(*(_health(registry.pick(m).backend) for m in models))
    pairs = zip(models, results, strict=True)
    report = {m.name: {"ready": h.ready, "detail": h.detail} for m, h in pairs}
    ready = all(h.ready for h in results)
    return JSONResponse(
        {"status": "ok" if ready else "unavailable", "models": report},
        status_code=200 if ready else 503,
    )


@router.get("/metrics", dependencies=[Depends(metrics_guard)])
async def metrics(request: Request) -> Response:
    return Response(gateway_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)

