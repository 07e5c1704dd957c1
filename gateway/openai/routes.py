"""POST /v1/chat/completions and /v1/completions.

Model selection: the `x-model` header, when present and non-empty, wins over the
body's `model` (the header is what Envoy routes on, so both hops agree); else the
body's `model`; else, when exactly one model is served, that one. A name may be a
model or one of its aliases; the model's router (routing/router.py) then picks the
deployment and falls back to another one when a deployment fails before its first token.

What a body leaves out of its sampling comes from the model's defaults
(gateway/sampling_defaults.py). Chat requests with tools get a tool plan
(gateway/openai/tools) from the model's chat template; completions with `best_of > n`
generate `best_of` candidates and answer the `n` likeliest.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from backends.base import GenerationRequest
from gateway.body import parse_body, read_json
from gateway.errors import bad_request
from gateway.generation import Collected, gather_choices, stream, unless_disconnected
from gateway.guard import GUARD, PromptTokens, admit, open_admitted, principal_of
from gateway.limits import cap_output, check_openai_fields
from gateway.middleware import set_model_label
from gateway.openai import response_schema as answers
from gateway.openai import schema
from gateway.openai.requests import ChatCompletionRequest, CompletionRequest, SamplingFields
from gateway.openai.responses import (
    ChatFormatter,
    CompletionFormatter,
    Formatter,
    ResponseOptions,
    chat_meta,
    completion_meta,
)
from gateway.openai.sampling import (
    chat_request,
    completion_request,
    new_request_id,
    tool_plan,
    uses_tools,
)
from gateway.openai.tools import ToolPlan
from gateway.openapi import GENERATION_ERRORS, Answer, documented
from gateway.sampling_defaults import effective, model_info
from gateway.sse import SSEResponse
from gateway.state import GatewayState, gateway_state
from routing.registry import ModelEntry

router = APIRouter(dependencies=[GUARD])  # the key is checked before the body is read
Body = TypeVar("Body", bound=SamplingFields)
Select = Callable[[list[Collected]], Sequence[Collected]]


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


async def chat_generation(entry: ModelEntry, chat: ChatCompletionRequest, request_id: str,
                          ) -> tuple[ToolPlan | None, GenerationRequest]:
    """A chat body's tool plan (from the model's template) and its generation request, with
    the model's sampling defaults: what every API translated onto chat runs."""
    info = await model_info(entry)  # None while loading: no template, configured defaults
    plan = None
    if uses_tools(chat):
        template = info.chat_template if info is not None else None
        plan = tool_plan(chat, template, entry.tool_call_parser)
    return plan, chat_request(chat, request_id, plan, effective(entry, info))


async def _prepare(request: Request, schema: type[Body]) -> tuple[GatewayState, Body, ModelEntry]:
    state = gateway_state(request)
    data = await read_json(request)
    check_openai_fields(data, state.settings.request_limits())
    body = parse_body(data, schema)
    body.check()
    entry = resolve_model(state, request, body.model)
    set_model_label(request.scope, entry.name)
    # A key learns a model's task only if it may use the model (403 first).
    await state.access.authorize(principal_of(request), entry.name)
    entry.router.require("generate")  # an embedding model: a 400 naming it and its task
    return state, body, entry


async def _respond(
    request: Request, state: GatewayState, entry: ModelEntry, gen_request: GenerationRequest,
    formatter: Formatter, *, streamed: bool, select: Select | None = None,
) -> Response:
    backend = entry.router  # balances and falls back over the model's deployments
    trace = state.metrics.trace(entry.name)
    cap = state.settings.max_output_tokens
    # Admitted first: a key over its limits costs no tokenization.
    admitted = await admit(request, entry.name, PromptTokens(backend, gen_request, cap))
    async with admitted.unless_failing():
        gen_request = await cap_output(backend, gen_request, cap, admitted.prompt.count)
    if streamed:
        # The first event is pulled before the response starts: early errors stay 4xx.
        opening = open_admitted(request, admitted, backend, gen_request, trace)
        gen = await unless_disconnected(request.receive, opening)
        return SSEResponse(stream(gen, formatter))

    async def whole() -> dict[str, Any]:
        gen = await open_admitted(request, admitted, backend, gen_request, trace)
        got, usage = await gather_choices(gen)
        choices = got.items if select is None else select(got.items)
        return formatter.body(choices, usage)

    return JSONResponse(await unless_disconnected(request.receive, whole()))


_CHAT_DOCS = documented(
    Answer(200, "The completion; with `stream`, chunks as server-sent events, then [DONE].",
           model=answers.ChatCompletion, stream=answers.ChatStreamEvent),
    body=schema.ChatCompletionRequest, errors=GENERATION_ERRORS, model_header=True)
_COMPLETION_DOCS = documented(
    Answer(200, "The completion; with `stream`, chunks as server-sent events, then [DONE].",
           model=answers.TextCompletion, stream=answers.CompletionStreamEvent),
    body=schema.CompletionRequest, errors=GENERATION_ERRORS, model_header=True)


@router.post("/v1/chat/completions", response_model=None, **_CHAT_DOCS)
async def chat_completions(request: Request) -> Response:
    state, body, entry = await _prepare(request, ChatCompletionRequest)
    plan, gen_request = await chat_generation(entry, body, new_request_id())
    options = ResponseOptions(body.choices(), bool(body.logprobs), body.top_logprobs_count(),
                              body.include_usage(), body.include_reasoning)
    formatter = ChatFormatter(chat_meta(entry.name), options, plan)
    return await _respond(request, state, entry, gen_request, formatter, streamed=bool(body.stream))


def _mean_logprob(choice: Collected) -> float:
    logprobs = [t.logprob for t in choice.tokens if t.logprob is not None]
    return sum(logprobs) / len(logprobs) if logprobs else -math.inf


def best_of(n: int) -> Select:
    """The `n` candidates with the highest mean token logprob (OpenAI's "highest log
    probability per token"), best first, renumbered 0..n-1."""
    def select(choices: list[Collected]) -> list[Collected]:
        ranked = sorted(choices, key=_mean_logprob, reverse=True)[:n]
        for index, choice in enumerate(ranked):
            choice.index = index
        return ranked
    return select


@router.post("/v1/completions", response_model=None, **_COMPLETION_DOCS)
async def completions(request: Request) -> Response:
    state, body, entry = await _prepare(request, CompletionRequest)
    options = ResponseOptions(body.choices(), body.logprobs is not None, body.logprobs or 0,
                              body.include_usage())
    formatter = CompletionFormatter(completion_meta(entry.name), options)
    defaults = effective(entry, await model_info(entry))
    gen_request = completion_request(body, new_request_id(), defaults)
    select = best_of(body.choices()) if body.candidates() > body.choices() else None
    return await _respond(request, state, entry, gen_request, formatter,
                          streamed=bool(body.stream), select=select)
