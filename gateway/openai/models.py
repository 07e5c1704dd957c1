"""GET /v1/models and /v1/models/{id}, guarded.

Every served model is listed, then each of its aliases as a card of its own (OpenAI's
shape, plus `alias_of`: the model it points to, `sampling_defaults`: what a request that
omits them gets, and `task`: generate or embed). Only models the caller's key may use are
listed; retrieving another one is a 403, as using it would be.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from backends.base import SamplingDefaults
from gateway.guard import GUARD, principal_of
from gateway.openai.response_schema import ModelCard, ModelList
from gateway.openapi import Answer, documented
from gateway.sampling_defaults import effective, model_info
from gateway.state import gateway_state
from routing.registry import ModelEntry

router = APIRouter(dependencies=[GUARD])


def _card(entry: ModelEntry, name: str, defaults: SamplingDefaults) -> dict[str, Any]:
    card: dict[str, Any] = {"id": name, "object": "model", "created": entry.created,
                            "owned_by": "switchyard"}
    if name != entry.name:
        card["alias_of"] = entry.name
    card["sampling_defaults"] = defaults.report()
    card["task"] = entry.task
    return card


async def _cards(entry: ModelEntry) -> list[dict[str, Any]]:
    defaults = effective(entry, await model_info(entry))
    return [_card(entry, name, defaults) for name in (entry.name, *entry.aliases)]


@router.get("/v1/models", **documented(
    Answer(200, "The models (and aliases) the caller may use.", model=ModelList),
    errors=(401, 503)))
async def list_models(request: Request) -> JSONResponse:
    principal = principal_of(request)
    entries = [e for e in gateway_state(request).models.models() if principal.may_use(e.name)]
    cards = [card for e in entries for card in await _cards(e)]
    return JSONResponse({"object": "list", "data": cards})


@router.get("/v1/models/{model_id:path}", **documented(
    Answer(200, "The model (or alias).", model=ModelCard), errors=(401, 403, 404, 422, 503)))
async def retrieve_model(request: Request, model_id: str) -> JSONResponse:
    state = gateway_state(request)
    entry = state.models.resolve(model_id)
    await state.access.authorize(principal_of(request), entry.name)
    defaults = effective(entry, await model_info(entry))
    return JSONResponse(_card(entry, model_id, defaults))
