"""TGI's API: POST /generate, /generate_stream and / (TGI's compat route), GET /info.

Every failure on these routes answers in TGI's shape `{"error", "error_type"}` (its
`text-generation` client turns `error_type` into its exception classes): validation is a
real 422 before any stream starts, an overloaded engine a 429 with `Retry-After`.

Model selection: the `x-model` header (a model or an alias), else the only served model;
the model's router picks the deployment. The routes live on
an `APIRouter` whose route class converts errors, so a dependency added when including
the router (auth) answers in TGI's shape too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute

from backends.base import (
    Backend,
    BackendUnavailable,
    GenerationRequest,
)
from gateway.body import read_json
from gateway.errors import (
    OpenAIError,
    bad_request,
    internal_error,
    tgi_error_response,
    to_openai_error,
)
from gateway.generation import (
    ClientDisconnected,
    Generation,
    gather_choices,
    unless_disconnected,
)
from gateway.guard import GUARD, Admitted, admit, open_admitted, principal_of
from gateway.limits import check_tgi_fields, output_ceiling
from gateway.metrics import GenerationTrace
from gateway.middleware import set_failure_label, set_model_label
from gateway.openai.sampling import new_request_id
from gateway.openapi import Answer, ErrorResponse, TGIErrorResponse, documented
from gateway.sampling_defaults import effective
from gateway.sse import SSEResponse
from gateway.state import GatewayState, gateway_state
from gateway.tgi import schema
from gateway.tgi.info import info_body, loading_response
from gateway.tgi.prompt import TGIPrompt
from gateway.tgi.requests import (
    TGIRequest,
    TGIValidationError,
    check_length,
    check_truncate,
    parse_request,
    plan,
)
from gateway.tgi.responses import TGIView, generate_body, generate_headers, stream_events
from routing.registry import ModelEntry

log = logging.getLogger("switchyard.gateway")
Handler = Callable[[Request], Coroutine[Any, Any, Response]]


class TGIRoute(APIRoute):
    """Errors raised anywhere in the route (dependencies included) answer in TGI's shape."""

    def get_route_handler(self) -> Handler:
        handler = super().get_route_handler()

        async def tgi_handler(request: Request) -> Response:
            try:
                return await handler(request)
            except ClientDisconnected:
                raise
            except TGIValidationError as exc:
                set_failure_label(request.scope, "validation")
                return JSONResponse({"error": exc.message, "error_type": "validation"}, 422)
            except Exception as exc:
                err = to_openai_error(exc)
                if err is None:
                    log.exception("unhandled error on %s %s", request.method, request.url.path)
                    err = internal_error()
                set_failure_label(request.scope, err.failure_kind())
                return tgi_error_response(err)

        return tgi_handler


router = APIRouter(route_class=TGIRoute)
# TGI answers every input problem with 422
_ERRORS = (401, 403, 404, 422, 429, 500, 502, 503, 504)
_BODY_LIMIT = {413: ErrorResponse}  # gateway/limits.py answers before the route, in OpenAI's shape
_TIMING = {name: {"description": "Milliseconds (tokens, for x-*-tokens).",
                  "schema": {"type": "string"}}
           for name in ("x-prompt-tokens", "x-generated-tokens", "x-total-time")}


def _docs(*answers: Answer, body: type[schema.GenerateRequest] = schema.GenerateRequest,
          ) -> dict[str, Any]:
    return documented(*answers, body=body, errors=_ERRORS, error=TGIErrorResponse,
                      error_overrides=_BODY_LIMIT, model_header=True)


@dataclass(frozen=True)
class Prepared:
    """A validated request, ready to run."""

    state: GatewayState
    entry: ModelEntry
    backend: Backend
    gen_request: GenerationRequest
    view: TGIView
    admitted: Admitted


def resolve_model(state: GatewayState, request: Request) -> ModelEntry:
    name = (request.headers.get("x-model") or "").strip()
    if name:
        return state.models.resolve(name)
    sole = state.models.sole_model()
    if sole is None:
        raise bad_request("Several models are served here: choose one with the `x-model` header.",
                          "model", "missing_required_parameter")
    return sole


async def prepare(request: Request, *, stream: bool | None) -> tuple[Prepared, bool]:
    """Authenticate, parse, validate, admit against the key (before the prompt is counted),
    then TGI's length checks; `stream` None: the body's."""
    state = gateway_state(request)
    data = await read_json(request)
    check_tgi_fields(data, state.settings.request_limits())
    body: TGIRequest = parse_request(data)
    entry = resolve_model(state, request)
    set_model_label(request.scope, entry.name)
    await state.access.authorize(principal_of(request), entry.name)
    entry.router.require("generate")
    compat = stream is None  # POST /: TGI's compat route
    streamed = body.stream if compat else bool(stream)
    todo = plan(body, stream=streamed, full_text_default=compat)
    backend = entry.router
    info = backend.info()
    check_truncate(todo.truncate, info)
    cap = state.settings.max_output_tokens  # also the ceiling of the default (100) or null
    prompt = TGIPrompt(backend, info, body.inputs, todo, cap)
    admitted = await admit(request, entry.name, prompt)
    async with admitted.unless_failing():
        count, ids = await prompt.measured()
        limit = output_ceiling(todo.sampling.max_tokens, count, info.max_total_tokens, cap)
        todo = replace(todo, sampling=replace(todo.sampling, max_tokens=limit))
        check_length(count, todo.sampling.max_tokens, info)
    gen_request = GenerationRequest(
        request_id=new_request_id(), sampling=todo.sampling, prompt=body.inputs,
        prompt_token_ids=ids,
    )
    seed = None if todo.sampling.is_greedy else todo.sampling.seed
    view = TGIView(body.inputs, todo.details, todo.return_full_text, seed,
                   top_n_tokens=todo.top_n_tokens, prefill=todo.prefill)
    return Prepared(state, entry, backend, gen_request, view, admitted), streamed


async def _whole(request: Request, ready: Prepared) -> tuple[dict[str, Any], dict[str, str]]:
    trace = ready.state.metrics.trace(ready.entry.name)
    started = time.perf_counter()

    async def run() -> tuple[dict[str, Any], dict[str, str]]:
        gen = await _open(request, ready, trace)
        answer, total = await gather_choices(gen)
        headers = generate_headers(answer, total, time.perf_counter() - started)
        return generate_body(answer, total, ready.view), headers

    return await unless_disconnected(request.receive, run())


async def _open(request: Request, ready: Prepared, trace: GenerationTrace) -> Generation:
    """The generation, its first event pulled; a grammar the backend's engine cannot compile
    is TGI's "grammar is not valid" (422)."""
    try:
        return await open_admitted(
            request, ready.admitted, ready.backend, ready.gen_request, trace)
    except OpenAIError as err:
        if err.param == "grammar" and ready.gen_request.sampling.structured is not None \
                and err.status_code in (400, 422):
            raise TGIValidationError(f"grammar is not valid: {err.message}") from None
        raise


async def _stream(request: Request, ready: Prepared) -> Response:
    trace = ready.state.metrics.trace(ready.entry.name)
    # The first event is pulled before the response starts: early errors stay 4xx.
    gen = await unless_disconnected(request.receive, _open(request, ready, trace))
    return SSEResponse(stream_events(gen, ready.view))


@router.post("/generate", response_model=None, dependencies=[GUARD], **_docs(
    Answer(200, "The generated text (and details when asked).", model=schema.GenerateResponse,
           headers=_TIMING)))
async def generate(request: Request) -> Response:
    ready, _ = await prepare(request, stream=False)
    body, headers = await _whole(request, ready)
    return JSONResponse(body, headers=headers)


@router.post("/generate_stream", response_model=None, dependencies=[GUARD], **_docs(
    Answer(200, "One server-sent event per token (TGI sends no [DONE]).",
           stream=schema.TGIStreamEvent, stream_done=False)))
async def generate_stream(request: Request) -> Response:
    ready, _ = await prepare(request, stream=True)
    return await _stream(request, ready)


@router.post("/", response_model=None, dependencies=[GUARD], **_docs(
    Answer(200, "A list of one answer; with `stream`, one server-sent event per token.",
           model=schema.CompatGenerateResponse, stream=schema.TGIStreamEvent,
           stream_done=False, headers=_TIMING),
    body=schema.CompatGenerateRequest))
async def compat_generate(request: Request) -> Response:
    """TGI's (and the Inference API's) route: streams when `stream`, else a list of one."""
    ready, streamed = await prepare(request, stream=None)
    if streamed:
        return await _stream(request, ready)
    body, headers = await _whole(request, ready)
    return JSONResponse([body], headers=headers)


@router.get("/info", response_model=None, **documented(
    Answer(200, "The model's limits and engine settings (`x-model` chooses the model).",
           model=schema.Info),
    errors=(404, 422, 503), error=TGIErrorResponse, secured=False,
    model_header=True))
async def info(request: Request) -> Response:
    state = gateway_state(request)
    entry = resolve_model(state, request)
    try:
        model_info = entry.router.info()
    except BackendUnavailable as exc:  # still loading: which stage (gateway/tgi/info.py)
        return await loading_response(entry.deployments, exc)
    body = info_body(model_info, version=request.app.version,
                     limits=state.settings.request_limits())
    body["sampling_defaults"] = effective(entry, model_info).report()  # ours, per model
    body["task"] = entry.task  # ours: generate or embed
    if entry.task == "embed":
        body["model_pipeline_tag"] = "feature-extraction"
    return JSONResponse(body)
