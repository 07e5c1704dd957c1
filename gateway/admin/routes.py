"""/admin/keys (the admin key) and usage: /admin/keys/{id}/usage (the admin, or that key),
/v1/usage (the caller's own)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from auth.access import AccessDenied, Principal
from auth.admin import KeyAdmin, KeyChanges, KeyNotFound, NewKey
from auth.policy import unavailable
from auth.store import ReadOnlyStore, StoreUnavailable
from gateway.admin import schema
from gateway.body import parse_body, read_json
from gateway.errors import OpenAIError
from gateway.guard import require_admin, require_key
from gateway.openapi import Answer, documented
from gateway.state import gateway_state

log = logging.getLogger("switchyard.gateway")
router = APIRouter()

CALLER = Depends(require_key)
ADMIN = [Depends(require_admin)]
_READ = (401, 403, 404, 422, 503)
_WRITE = (400, 401, 403, 404, 409, 413, 422, 503)


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


@router.post("/admin/keys", dependencies=ADMIN, status_code=201, **documented(
    Answer(201, "The new key, with its secret (shown this once).", model=schema.NewApiKey),
    body=schema.NewKeyRequest, errors=_WRITE))
async def create_key(request: Request) -> JSONResponse:
    spec = parse_body(await read_json(request), NewKey)
    with _key_errors():
        secret, record = await _key_admin(request).create(spec)
    log.info("created API key %s (%s)", record.id, record.name or "unnamed")
    return JSONResponse({**record.public(), "key": secret}, status_code=201)


@router.get("/admin/keys", dependencies=ADMIN, **documented(
    Answer(200, "Every key (never a secret).", model=schema.ApiKeyList), errors=_READ))
async def list_keys(request: Request) -> JSONResponse:
    with _key_errors():
        records = await _key_admin(request).list()
    return JSONResponse({"object": "list", "data": [r.public() for r in records]})


@router.get("/admin/keys/{key_id}", dependencies=ADMIN, **documented(
    Answer(200, "The key.", model=schema.ApiKey), errors=_READ))
async def get_key(request: Request, key_id: str) -> JSONResponse:
    with _key_errors():
        return JSONResponse((await _key_admin(request).get(key_id)).public())


@router.patch("/admin/keys/{key_id}", dependencies=ADMIN, **documented(
    Answer(200, "The key, changed.", model=schema.ApiKey),
    body=schema.KeyChangesRequest, errors=_WRITE))
async def update_key(request: Request, key_id: str) -> JSONResponse:
    changes = parse_body(await read_json(request), KeyChanges)
    with _key_errors():
        record = await _key_admin(request).update(key_id, changes)
    log.info("updated API key %s", key_id)
    return JSONResponse(record.public())


@router.delete("/admin/keys/{key_id}", dependencies=ADMIN, **documented(
    Answer(200, "The key is revoked.", model=schema.DeletedApiKey),
    errors=(401, 403, 404, 409, 422, 503)))
async def revoke_key(request: Request, key_id: str) -> JSONResponse:
    with _key_errors():
        await _key_admin(request).revoke(key_id)
    gateway_state(request).metrics.keys.forget(key_id)
    log.info("revoked API key %s", key_id)
    return JSONResponse({"id": key_id, "object": "api_key", "deleted": True})


@router.get("/admin/keys/{key_id}/usage", **documented(
    Answer(200, "The key's usage per model, and its budget.", model=schema.KeyUsage),
    errors=_READ))
async def key_usage(request: Request, key_id: str, principal: Principal = CALLER) -> JSONResponse:
    if not principal.admin and principal.key_id != key_id:
        raise AccessDenied("An API key may read only its own usage.", status_code=403,
                           code="permission_denied")
    with _key_errors():
        admin = _key_admin(request)
        return JSONResponse(await admin.usage(await admin.get(key_id)))


@router.get("/v1/usage", **documented(
    Answer(200, "The calling key's usage per model, and its budget.", model=schema.KeyUsage),
    errors=(400, 401, 404, 503)))
async def own_usage(request: Request, principal: Principal = CALLER) -> JSONResponse:
    """The calling key's own usage per model (and budget)."""
    if principal.key is None:
        raise OpenAIError(400, "Only an API key has usage; the admin key reads a key's usage "
                          "at /admin/keys/{key_id}/usage.", code="no_usage")
    return await key_usage(request, principal.key.id, principal)
