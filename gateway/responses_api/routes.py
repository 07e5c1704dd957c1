"""POST /v1/responses, and GET / DELETE of stored responses and their input items.

A request is translated into the chat completion request it amounts to (translate.py) and
takes the chat route's path: model resolution, the tool plan, sampling defaults, admission
against the key's limits, --max-output-tokens, the model's router with its fallbacks,
metering and metrics. Only its answer differs: output items (output.py), whole or streamed
(answers.py), stored with the conversation unless `store` is false.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from backends.base import GenerationRequest, Usage
from gateway.body import parse_body, read_json
from gateway.errors import OpenAIError, bad_request
from gateway.generation import unless_disconnected
from gateway.guard import GUARD, open_admitted, principal_of
from gateway.middleware import set_model_label
from gateway.openai.routes import chat_generation, resolve_model
from gateway.openai.tools import ToolPlan
from gateway.openapi import COMMON_ERRORS, GENERATION_ERRORS, Answer, documented
from gateway.responses_api import schema
from gateway.responses_api.answers import Finish, streamed, whole
from gateway.responses_api.items import Item, items_json, new_id, parse_input, parse_stored
from gateway.responses_api.output import OutputBuilder
from gateway.responses_api.request import ResponsesRequest
from gateway.responses_api.response import ResponseHead
from gateway.responses_api.store import (
    ResponseStore,
    StoredResponse,
    delete_owned,
    keep,
    owned,
    owner_of,
)
from gateway.responses_api.stores import responses_store
from gateway.responses_api.translate import chat_body, responses_errors
from gateway.settings import RequestLimits
from gateway.sse import SSEResponse
from gateway.state import gateway_state
from gateway.translated_chat import admitted as admit_chat
from routing.registry import ModelEntry

router = APIRouter(dependencies=[GUARD])  # the key is checked before the body is read
JSON = dict[str, Any]
MAX_PAGE = 100


@dataclass(frozen=True)
class Prepared:
    """A request ready to generate: what it asks, its conversation, the chat request."""

    body: ResponsesRequest
    entry: ModelEntry
    owner: str
    items: list[Item]  # the conversation: a previous response's items, then the input's
    plan: ToolPlan | None
    gen_request: GenerationRequest
    head: ResponseHead


def _too_long(field: str, limit: int, got: int) -> OpenAIError:
    return bad_request(f"Invalid '{field}': the conversation has {got} items; this server "
                       f"allows at most {limit} (--max-messages).", field,
                       "array_above_max_length")


def _check_raw(data: Any, limits: RequestLimits) -> None:
    """Limits on the parsed JSON, before the schema walks it."""
    items = data.get("input") if isinstance(data, dict) else None
    if isinstance(items, list) and len(items) > limits.max_messages:
        raise _too_long("input", limits.max_messages, len(items))


async def _history(store: ResponseStore, owner: str, previous_id: str | None) -> list[Item]:
    """The stored conversation `previous_id` continues: its input items, then its output."""
    if previous_id is None:
        return []
    record = await owned(store, owner, previous_id, "previous_response_id")
    return parse_stored([*record.input_items, *record.response.get("output", [])])


async def _prepare(request: Request) -> Prepared:
    state = gateway_state(request)
    limits = state.settings.request_limits()
    data = await read_json(request)
    _check_raw(data, limits)
    body = parse_body(data, ResponsesRequest)
    owner = owner_of(principal_of(request))
    history = await _history(responses_store(request), owner, body.previous_response_id)
    items = history + parse_input(body.input)
    if len(items) > limits.max_messages:
        raise _too_long("input", limits.max_messages, len(items))
    chat = chat_body(body, items, limits)
    entry = resolve_model(state, request, body.model)
    set_model_label(request.scope, entry.name)
    response_id = new_id("resp")  # the generation's id too (the access line's)
    plan, gen_request = await chat_generation(entry, chat, response_id)
    head = ResponseHead.of(response_id, body, entry.name, gen_request.sampling)
    return Prepared(body, entry, owner, items, plan, gen_request, head)


def _finisher(request: Request, prepared: Prepared) -> Finish:
    """The final response object, stored with its conversation unless `store` is false."""
    store = responses_store(request)

    async def finish(status: str, output: list[JSON], usage: Usage) -> JSON:
        response = prepared.head.body(status, output, usage)
        if prepared.head.store:
            record = StoredResponse(prepared.owner, response, items_json(prepared.items))
            if not await keep(store, record):
                response = {**response, "store": False}
        return response

    return finish


async def _respond(request: Request, prepared: Prepared) -> Response:
    state = gateway_state(request)
    backend = prepared.entry.router  # balances and falls back over the model's deployments
    trace = state.metrics.trace(prepared.entry.name)
    admitted, gen_request = await admit_chat(request, prepared.entry, prepared.gen_request)
    builder = OutputBuilder(prepared.plan.parser() if prepared.plan is not None else None)
    finish = _finisher(request, prepared)
    if prepared.body.streams():
        # The first event is pulled before the response starts: early errors stay 4xx.
        opening = open_admitted(request, admitted, backend, gen_request, trace)
        gen = await unless_disconnected(request.receive, opening)
        return SSEResponse(streamed(gen, prepared.head, builder, finish))

    async def answer() -> JSON:
        gen = await open_admitted(request, admitted, backend, gen_request, trace)
        return await whole(gen, builder, finish)

    return JSONResponse(await unless_disconnected(request.receive, answer()))


_CREATE_DOCS = documented(
    Answer(200, "The response; with `stream`, its events as server-sent events.",
           model=schema.ResponseObject, stream=schema.ResponseStreamEvent, stream_done=False),
    body=schema.CreateResponseRequest, errors=GENERATION_ERRORS, model_header=True)


@router.post("/v1/responses", response_model=None, **_CREATE_DOCS)
async def create_response(request: Request) -> Response:
    with responses_errors():
        prepared = await _prepare(request)
        return await _respond(request, prepared)


async def _owned(request: Request, response_id: str) -> StoredResponse:
    owner = owner_of(principal_of(request))
    return await owned(responses_store(request), owner, response_id)


@router.get("/v1/responses/{response_id}", **documented(
    Answer(200, "The stored response.", model=schema.ResponseObject), errors=COMMON_ERRORS))
async def retrieve_response(request: Request, response_id: str) -> JSONResponse:
    return JSONResponse((await _owned(request, response_id)).response)


@router.delete("/v1/responses/{response_id}", **documented(
    Answer(200, "The response is deleted.", model=schema.DeletedResponse),
    errors=COMMON_ERRORS))
async def delete_response(request: Request, response_id: str) -> JSONResponse:
    owner = owner_of(principal_of(request))
    await delete_owned(responses_store(request), owner, response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def page(items: list[JSON], after: str | None, limit: int, order: str) -> JSON:
    """One page of `items` in `order`, starting after the item `after`."""
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise bad_request(f"No item '{after}' is among this response's input items.",
                              "after", "invalid_value")
        start = ids.index(after) + 1
    data = ordered[start:start + limit]
    return {"object": "list", "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": start + limit < len(ordered)}


@router.get("/v1/responses/{response_id}/input_items", **documented(
    Answer(200, "The input items of the stored response (its whole conversation).",
           model=schema.RespInputItemList), errors=COMMON_ERRORS))
async def list_input_items(
    request: Request, response_id: str, after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 20,
    order: Literal["asc", "desc"] = "desc",
    include: Annotated[list[str] | None, Query(description="Accepted; nothing to add.")] = None,
) -> JSONResponse:
    record = await _owned(request, response_id)
    return JSONResponse(page(record.input_items, after, limit, order))
