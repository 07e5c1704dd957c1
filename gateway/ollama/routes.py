"""POST /api/chat and /api/generate: Ollama's generation API (embeddings: embed.py).

A request is translated (translate.py) into the chat completions body, or for a raw
/api/generate the completions body, and takes that route's path (gateway/translated_chat.py):
its parser and checks, the tool plan, sampling defaults, the grammar engine for `format`,
admission against the key, routing with fallbacks, metering and metrics. Only the answer is
Ollama's: newline-delimited objects, or one (answer.py, stream.py). Keys come as
`Authorization: Bearer`, as on the OpenAI routes; a model is named as served, or
`name:latest`.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from backends.base import GenerationRequest
from gateway.body import parse_body, read_json
from gateway.errors import bad_request
from gateway.generation import gather_choices, unless_disconnected
from gateway.guard import GUARD, open_admitted, principal_of
from gateway.middleware import set_model_label
from gateway.ollama import schema
from gateway.ollama.answer import Clock, Shape
from gateway.ollama.options import check_fields
from gateway.ollama.stream import NDJSONResponse, answer_lines
from gateway.ollama.translate import chat_body, generate_body, served_model
from gateway.openai.requests import ChatCompletionRequest, CompletionRequest
from gateway.openai.responses import (
    CompletionFormatter,
    Formatter,
    ResponseOptions,
    completion_meta,
)
from gateway.openai.sampling import completion_request, new_request_id
from gateway.openapi import GENERATION_ERRORS, Answer, documented
from gateway.sampling_defaults import effective, model_info
from gateway.state import gateway_state
from gateway.translated_chat import admitted, constraint_named, prepare_chat
from routing.registry import ModelEntry

router = APIRouter(dependencies=[GUARD])
_FORMAT = "format"  # the output constraint's name in the engine's errors


def _docs(answer: type[schema.BaseModel], body: type[schema.BaseModel]) -> dict[str, object]:
    return documented(
        Answer(200, "With `stream` (the default), newline-delimited objects, the last with "
               "done: true; without, that last object alone, holding the whole answer.",
               model=answer, lines=answer),
        body=body, errors=GENERATION_ERRORS, error=schema.OllamaErrorResponse,
        model_header=True)


async def _generating(request: Request, entry: ModelEntry, name: str) -> ModelEntry:
    """`entry`, unless it is an embedding model (a 400, once the key may know of it)."""
    if entry.router.task == "embed":
        await gateway_state(request).access.authorize(principal_of(request), entry.name)
        raise bad_request(f'model "{name}" is an embedding model: it does not generate text '
                          "(use /api/embed)", "model", "model_task_mismatch")
    return entry


async def _loaded(request: Request, entry: ModelEntry, shape: Shape) -> JSONResponse:
    """Nothing to generate (Ollama's way to load a model): the key may use it, it is there."""
    await gateway_state(request).access.authorize(principal_of(request), entry.name)
    return JSONResponse(shape.loaded())


async def _answer(request: Request, entry: ModelEntry, formatter: Formatter,
                  gen_request: GenerationRequest, shape: Shape, clock: Clock,
                  streamed: bool) -> Response:
    backend, trace = entry.router, gateway_state(request).metrics.trace(entry.name)
    admission, gen_request = await admitted(request, entry, gen_request)
    clock.mark("started")
    if streamed:
        opening = open_admitted(request, admission, backend, gen_request, trace)
        gen = await unless_disconnected(request.receive, opening)
        clock.mark("first")
        return NDJSONResponse(answer_lines(gen, formatter, shape, clock))

    async def whole() -> dict[str, object]:
        gen = await open_admitted(request, admission, backend, gen_request, trace)
        clock.mark("first")
        got, usage = await gather_choices(gen)
        clock.mark("ended")
        return shape.whole(formatter.body(got.items, usage), got, usage, clock)

    return JSONResponse(await unless_disconnected(request.receive, whole()))


@router.post("/api/chat", response_model=None,
             **_docs(schema.OllamaChatResponse, schema.OllamaChatRequest))
async def chat(request: Request) -> Response:
    clock, state = Clock(), gateway_state(request)
    data = await read_json(request)
    check_fields(data, state.settings.request_limits())
    body = parse_body(data, schema.OllamaChatRequest)
    entry = await _generating(request, served_model(state, request, body.model), body.model)
    shape = Shape(body.model, chat=True)
    if not body.messages:
        return await _loaded(request, entry, shape)
    chat = parse_body(chat_body(body), ChatCompletionRequest)
    chat.check()
    prepared = await prepare_chat(request, chat, entry, _FORMAT)
    return await _answer(request, entry, prepared.formatter, prepared.request, shape, clock,
                         body.stream)


@router.post("/api/generate", response_model=None,
             **_docs(schema.OllamaGenerateResponse, schema.OllamaGenerateRequest))
async def generate(request: Request) -> Response:
    clock, state = Clock(), gateway_state(request)
    data = await read_json(request)
    check_fields(data, state.settings.request_limits())
    body = parse_body(data, schema.OllamaGenerateRequest)
    entry = await _generating(request, served_model(state, request, body.model), body.model)
    shape = Shape(body.model, chat=False)
    translated = generate_body(body)
    if not body.prompt and not body.system:
        return await _loaded(request, entry, shape)
    if not body.raw:
        chat = parse_body(translated, ChatCompletionRequest)
        chat.check()
        prepared = await prepare_chat(request, chat, entry, _FORMAT)
        return await _answer(request, entry, prepared.formatter, prepared.request, shape,
                             clock, body.stream)
    completion = parse_body(translated, CompletionRequest)
    completion.check()
    set_model_label(request.scope, entry.name)
    defaults = effective(entry, await model_info(entry))
    gen_request = constraint_named(completion_request(completion, new_request_id(), defaults),
                                   _FORMAT)
    formatter = CompletionFormatter(completion_meta(entry.name), ResponseOptions())
    return await _answer(request, entry, formatter, gen_request, shape, clock, body.stream)
