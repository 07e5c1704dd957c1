"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.

A request is translated into the chat completions body (translate.py) and then takes the
chat route's path: its parser and checks, model selection (`x-model` wins over `model`),
the tool plan, sampling defaults, admission against the key, routing with fallbacks,
metering and metrics. Only the answer differs: a message, or its event stream (stream.py).
Keys come as `x-api-key` (Anthropic's clients) or `Authorization: Bearer`;
`anthropic-version` is accepted and not needed.
"""

from __future__ import annotations

import asyncio
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from auth.access import Principal, bearer_token
from gateway.anthropic import schema
from gateway.anthropic.stream import BlockStream, ending_of, message_stream
from gateway.anthropic.translate import (
    chat_body,
    check_fields,
    conversation_body,
    message_body,
)
from gateway.body import parse_body, read_json
from gateway.generation import gather_choices, unless_disconnected
from gateway.guard import NoPrompt, admit, authenticate, open_admitted
from gateway.openai.requests import ChatCompletionRequest
from gateway.openai.routes import resolve_model
from gateway.openapi import GENERATION_ERRORS, Answer, documented
from gateway.sse import SSEResponse
from gateway.state import gateway_state
from gateway.translated_chat import PreparedChat, admitted, prepare_chat


async def require_messages_key(request: Request) -> Principal:
    """The caller, by `x-api-key` or else `Authorization: Bearer` (401 without a valid key)."""
    api_key = (request.headers.get("x-api-key") or "").strip()
    return await authenticate(request,
                              api_key or bearer_token(request.headers.get("authorization")))


router = APIRouter(dependencies=[Depends(require_messages_key)])
_DESCRIPTION = ("Anthropic's Messages API. The key may come as `x-api-key` or `Authorization: "
                "Bearer`; `anthropic-version` is accepted. Errors answer in Anthropic's shape.")
_MESSAGES_DOCS = documented(
    Answer(200, "The message; with `stream`, Anthropic's server-sent events.",
           model=schema.AnthropicMessage, stream=schema.AnthropicMessageStreamEvent,
           stream_done=False),
    body=schema.AnthropicMessagesRequest, errors=GENERATION_ERRORS,
    error=schema.AnthropicErrorResponse, model_header=True)
_COUNT_DOCS = documented(
    Answer(200, "The conversation's prompt tokens after the chat template.",
           model=schema.AnthropicCountTokensResponse),
    body=schema.AnthropicCountTokensRequest, error=schema.AnthropicErrorResponse,
    model_header=True)


async def _prepared(request: Request, chat: ChatCompletionRequest) -> PreparedChat:
    chat.check()
    entry = resolve_model(gateway_state(request), request, chat.model)
    return await prepare_chat(request, chat, entry, "output_config.format")


@router.post("/v1/messages", response_model=None, description=_DESCRIPTION, **_MESSAGES_DOCS)
async def messages(request: Request) -> Response:
    state = gateway_state(request)
    data = await read_json(request)
    check_fields(data, state.settings.request_limits())
    body = parse_body(data, schema.AnthropicMessagesRequest)
    chat = parse_body(chat_body(body), ChatCompletionRequest)
    prepared = await _prepared(request, chat)
    entry, formatter, backend = prepared.entry, prepared.formatter, prepared.entry.router
    trace = state.metrics.trace(entry.name)
    admission, gen_request = await admitted(request, entry, prepared.request)
    async with admission.unless_failing():
        input_tokens = await admission.prompt.count() if body.stream else 0
    message_id = f"msg_{uuid.uuid4().hex}"
    if body.stream:
        opening = open_admitted(request, admission, backend, gen_request, trace)
        gen = await unless_disconnected(request.receive, opening)
        blocks = BlockStream(message_id, entry.name, body.stop_sequences)
        return SSEResponse(message_stream(gen, formatter, blocks, input_tokens))

    async def whole() -> dict[str, object]:
        gen = await open_admitted(request, admission, backend, gen_request, trace)
        got, usage = await gather_choices(gen)
        answer = formatter.body(got.items, usage)
        return message_body(answer, ending_of(got), usage, body.stop_sequences, message_id)

    return JSONResponse(await unless_disconnected(request.receive, whole()))


@router.post("/v1/messages/count_tokens", description=_DESCRIPTION, **_COUNT_DOCS)
async def count_tokens(request: Request) -> JSONResponse:
    data = await read_json(request)
    check_fields(data, gateway_state(request).settings.request_limits())
    body = parse_body(data, schema.AnthropicCountTokensRequest)
    chat = parse_body(conversation_body(body), ChatCompletionRequest)
    prepared = await _prepared(request, chat)
    admission = await admit(request, prepared.entry.name, NoPrompt())
    try:
        count = await asyncio.to_thread(prepared.entry.router.count_tokens, prepared.request)
    finally:
        await admission.abandon()  # nothing generated: the slot is freed, no tokens billed
    return JSONResponse({"input_tokens": count})
