"""POST /v1/chat/completions and /v1/completions.

Model selection: the `x-model` header, when present and non-empty, wins over the
body's `model` (the header is what Envoy routes on, so both hops agree); else the
body's `model`; else, when exactly one model is served, that one. A name may be a
model or one of its aliases; the model's router (routing/router.py) then picks the
deployment and falls back to another one when a deployment fails before its first token.
"""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from backends.base import GenerationRequest
from gateway.body import parse_body, read_json
from gateway.errors import bad_request
from gateway.generation import collect, stream, unless_disconnected
from gateway.guard import GUARD, open_guarded
from gateway.middleware import set_model_label
from gateway.openai.requests import ChatCompletionRequest, CompletionRequest
from gateway.openai.responses import (
    ChatFormatter,
    CompletionFormatter,
    Formatter,
    chat_meta,
    completion_meta,
)
from gateway.openai.sampling import chat_request, completion_request, new_request_id
from gateway.sse import SSEResponse
from gateway.state import GatewayState, gateway_state
from routing.registry import ModelEntry

router = APIRouter(dependencies=[GUARD])  # the key is checked before the body is read
Body = TypeVar("Body", bound=BaseModel)


def resolve_model(state: GatewayState, request: Request, body_model: str | None) -> ModelEntry:
    header = (request.headers.get("x-model") or "").strip()
    name = header or body_model
    if not name:
        sole = state.models.sole_model()
        if sole is None:
            raise bad_request("You must provide a model parameter.", "model",
                              "missing_required_parameter")
        return sole
    return state.models.resolve(name)


async def _prepare(request: Request, schema: type[Body]) -> tuple[GatewayState, Body, ModelEntry]:
    state = gateway_state(request)
    body = parse_body(await read_json(request), schema)
    entry = resolve_model(state, request, getattr(body, "model", None))
    set_model_label(request.scope, entry.name)
    return state, body, entry


async def _respond(
    request: Request, state: GatewayState, entry: ModelEntry, gen_request: GenerationRequest,
    formatter: Formatter, *, streamed: bool,
) -> Response:
    backend = entry.router  # balances and falls back over the model's deployments
    trace = state.metrics.trace(entry.name)
    logprobs = gen_request.sampling.logprobs
    if streamed:
        # The first event is pulled before the response starts: early errors stay 4xx.
        opening = open_guarded(request, entry.name, backend, gen_request, trace)
        gen = await unless_disconnected(request.receive, opening)
        return SSEResponse(stream(gen, formatter, logprobs=logprobs))

    async def whole() -> dict[str, Any]:
        gen = await open_guarded(request, entry.name, backend, gen_request, trace)
        return await collect(gen, formatter)

    return JSONResponse(await unless_disconnected(request.receive, whole()))


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request) -> Response:
    state, body, entry = await _prepare(request, ChatCompletionRequest)
    formatter = ChatFormatter(
        chat_meta(entry.name), logprobs=bool(body.logprobs), include_usage=body.include_usage(),
    )
    gen_request = chat_request(body, new_request_id())
    return await _respond(request, state, entry, gen_request, formatter, streamed=bool(body.stream))


@router.post("/v1/completions", response_model=None)
async def completions(request: Request) -> Response:
    state, body, entry = await _prepare(request, CompletionRequest)
    formatter = CompletionFormatter(
        completion_meta(entry.name), logprobs=body.logprobs is not None,
        include_usage=body.include_usage(),
    )
    gen_request = completion_request(body, new_request_id())
    return await _respond(request, state, entry, gen_request, formatter, streamed=bool(body.stream))
