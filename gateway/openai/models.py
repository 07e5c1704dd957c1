"""GET /v1/models and /v1/models/{id}, guarded.

/v1/models lists only the models the caller's key may use; retrieving another one
is a 403, as using it would be.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway.guard import GUARD, principal_of
from gateway.state import gateway_state
from routing.registry import ModelEntry

router = APIRouter(dependencies=[GUARD])


def _model_card(entry: ModelEntry) -> dict[str, Any]:
    return {"id": entry.name, "object": "model", "created": entry.created, "owned_by": "switchyard"}


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    principal = principal_of(request)
    entries = [e for e in gateway_state(request).models.models() if principal.may_use(e.name)]
    return JSONResponse({"object": "list", "data": [_model_card(e) for e in entries]})


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> JSONResponse:
    state = gateway_state(request)
    entry = state.models.resolve(model_id)
    await state.access.authorize(principal_of(request), entry.name)
    return JSONResponse(_model_card(entry))
