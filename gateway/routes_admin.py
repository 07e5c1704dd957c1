"""GET /health (open), /metrics (--metrics-auth), /v1/models[/{id}] (guarded), /admin/keys.

/v1/models lists only the models the caller's key may use; retrieving another one
is a 403, as using it would be.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from auth.access import AccessDenied, Principal
from auth.admin import KeyAdmin, KeyChanges, KeyNotFound, NewKey
from auth.policy import unavailable
from auth.store import ReadOnlyStore, StoreUnavailable
from backends.base import Backend, Health
from gateway.errors import OpenAIError
from gateway.guard import GUARD, metrics_guard, principal_of, require_admin, require_key
from gateway.routes_openai import parse_body, read_json
from gateway.state import gateway_state
from routing.registry import ModelEntry

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


def _model_card(entry: ModelEntry) -> dict[str, Any]:
    return {"id": entry.name, "object": "model", "created": entry.created, "owned_by": "switchyard"}


@router.get("/v1/models", dependencies=[GUARD])
async def list_models(request: Request) -> JSONResponse:
    principal = principal_of(request)
    entries = [e for e in gateway_state(request).models.models() if principal.may_use(e.name)]
    return JSONResponse({"object": "list", "data": [_model_card(e) for e in entries]})


@router.get("/v1/models/{model_id:path}", dependencies=[GUARD])
async def retrieve_model(request: Request, model_id: str) -> JSONResponse:
    state = gateway_state(request)
    entry = state.models.resolve(model_id)
    await state.access.authorize(principal_of(request), entry.name)
    return JSONResponse(_model_card(entry))


# ---- API keys: /admin/keys (the admin key) and usage (the admin, or the key itself) ----

CALLER = Depends(require_key)


@contextmanager
def _key_errors() -> Iterator[None]:
    try:
        yield
    except KeyNotFound as exc:
        raise OpenAIError(404, exc.message, code="key_not_found") from None
    except ReadOnlyStore as exc:
        raise OpenAIError(409, f"Keys cannot be changed here: {exc}.", code="keys_read_only") \
            from None
    except StoreUnavailable as exc:
        raise unavailable() from exc


def _key_admin(request: Request) -> KeyAdmin:
    admin = gateway_state(request).access.key_admin()
    if admin is None:
        raise OpenAIError(404, "API keys are not enabled on this gateway.", code="not_found")
    return admin


@router.post("/admin/keys", dependencies=[Depends(require_admin)], status_code=201)
async def create_key(request: Request) -> JSONResponse:
    spec = parse_body(await read_json(request), NewKey)
    with _key_errors():
        secret, record = await _key_admin(request).create(spec)
    log.info("created API key %s (%s)", record.id, record.name or "unnamed")
    return JSONResponse({**record.public(), "key": secret}, status_code=201)


@router.get("/admin/keys", dependencies=[Depends(require_admin)])
async def list_keys(request: Request) -> JSONResponse:
    with _key_errors():
        records = await _key_admin(request).list()
    return JSONResponse({"object": "list", "data": [r.public() for r in records]})


@router.get("/admin/keys/{key_id}", dependencies=[Depends(require_admin)])
async def get_key(request: Request, key_id: str) -> JSONResponse:
    with _key_errors():
        return JSONResponse((await _key_admin(request).get(key_id)).public())


@router.patch("/admin/keys/{key_id}", dependencies=[Depends(require_admin)])
async def update_key(request: Request, key_id: str) -> JSONResponse:
    changes = parse_body(await read_json(request), KeyChanges)
    with _key_errors():
        record = await _key_admin(request).update(key_id, changes)
    log.info("updated API key %s", key_id)
    return JSONResponse(record.public())


@router.delete("/admin/keys/{key_id}", dependencies=[Depends(require_admin)])
async def revoke_key(request: Request, key_id: str) -> JSONResponse:
    with _key_errors():
        await _key_admin(request).revoke(key_id)
    log.info("revoked API key %s", key_id)
    return JSONResponse({"id": key_id, "object": "api_key", "deleted": True})


@router.get("/admin/keys/{key_id}/usage")
async def key_usage(request: Request, key_id: str, principal: Principal = CALLER) -> JSONResponse:
    if not principal.admin and principal.key_id != key_id:
        raise AccessDenied("An API key may read only its own usage.", status_code=403,
                           code="permission_denied")
    with _key_errors():
        admin = _key_admin(request)
        return JSONResponse(await admin.usage(await admin.get(key_id)))


@router.get("/v1/usage")
async def own_usage(request: Request, principal: Principal = CALLER) -> JSONResponse:
    """The calling key's own usage per model (and budget)."""
    if principal.key is None:
        raise OpenAIError(400, "Only an API key has usage; the admin key reads a key's usage "
                          "at /admin/keys/{key_id}/usage.", code="no_usage")
    return await key_usage(request, principal.key.id, principal)
