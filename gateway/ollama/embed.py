"""POST /api/embed and the older POST /api/embeddings: Ollama's embeddings, for models whose
task is `embed`.

A request takes /v1/embeddings' path: its input checks and limits (gateway/embeddings/
requests.py), admission and metering against the key (gateway/embeddings/metering.py),
routing with fallbacks. Only the names and the answer are Ollama's. `truncate` (default
true) cuts an input longer than the model takes to its first tokens; false refuses it (400).
No input (`""` or `[]`) loads the model, as Ollama does: no vectors, nothing charged.
`options` and `keep_alive` are accepted and ignored (served models stay loaded).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from backends.embeddings import EmbeddingRequest, Embeddings
from gateway.body import parse_body, read_json
from gateway.embeddings.metering import embed_admitted
from gateway.embeddings.requests import inputs
from gateway.errors import bad_request
from gateway.generation import unless_disconnected
from gateway.guard import GUARD, principal_of
from gateway.middleware import set_model_label
from gateway.ollama import schema
from gateway.ollama.translate import served_model
from gateway.openai.sampling import new_request_id
from gateway.openapi import GENERATION_ERRORS, Answer, documented
from gateway.state import gateway_state
from routing.registry import ModelEntry

router = APIRouter(dependencies=[GUARD])  # the key is checked before the body is read


def _docs(answer: type[schema.BaseModel], body: type[schema.BaseModel],
          text: str) -> dict[str, Any]:
    return documented(Answer(200, text, model=answer), body=body, errors=GENERATION_ERRORS,
                      error=schema.OllamaErrorResponse, model_header=True)


async def _embedding_model(request: Request, name: str) -> ModelEntry:
    """The served embedding model `name` means, once the key may use it (else a 4xx)."""
    state = gateway_state(request)
    entry = served_model(state, request, name)
    set_model_label(request.scope, entry.name)
    await state.access.authorize(principal_of(request), entry.name)
    if entry.router.task != "embed":
        raise bad_request(f'model "{name}" is not an embedding model: it generates text '
                          "(use /api/chat or /api/generate)", "model", "model_task_mismatch")
    return entry


async def _vectors(request: Request, entry: ModelEntry, items: Any, dimensions: int | None,
                   truncate: bool) -> Embeddings:
    limit = gateway_state(request).settings.max_embedding_inputs
    req = EmbeddingRequest(new_request_id(), inputs(items, limit), dimensions, truncate=truncate)
    return await unless_disconnected(request.receive, embed_admitted(request, entry, req))


def _floats(vectors: np.ndarray) -> list[list[float]]:
    return vectors.astype(np.float32).tolist()  # as /v1/embeddings answers them


@router.post("/api/embed", response_model=None, **_docs(
    schema.OllamaEmbedResponse, schema.OllamaEmbedRequest,
    "One vector per input, in input order (none for no input: the model is loaded)."))
async def embed(request: Request) -> JSONResponse:
    started = time.monotonic_ns()
    body = parse_body(await read_json(request), schema.OllamaEmbedRequest)
    entry = await _embedding_model(request, body.model)
    if not body.input:
        return JSONResponse({"model": body.model, "embeddings": []})
    truncate = body.truncate is not False
    result = await _vectors(request, entry, body.input, body.dimensions, truncate)
    return JSONResponse({
        "model": body.model, "embeddings": _floats(result.vectors),
        "total_duration": time.monotonic_ns() - started, "load_duration": 0,
        "prompt_eval_count": result.prompt_tokens})


@router.post("/api/embeddings", response_model=None, **_docs(
    schema.OllamaEmbeddingsResponse, schema.OllamaEmbeddingsRequest,
    "The prompt's vector (empty for no prompt: the model is loaded). Superseded by /api/embed."))
async def embeddings(request: Request) -> JSONResponse:
    body = parse_body(await read_json(request), schema.OllamaEmbeddingsRequest)
    entry = await _embedding_model(request, body.model)
    if not body.prompt:
        return JSONResponse({"embedding": []})
    result = await _vectors(request, entry, body.prompt, None, truncate=True)
    return JSONResponse({"embedding": _floats(result.vectors)[0]})
