"""POST /v1/embeddings: OpenAI's embeddings API, for models whose task is `embed`.

The model comes from the `x-model` header or the body's `model` (gateway/openai/routes.py's
rule); a model of another task is a 400 naming it and its task. The request is admitted and
settled against the caller's key like a generation (metering.py), routed over the model's
deployments with their fallbacks (ModelRouter.embed), and answered with one vector per input,
in input order: float lists, or with `encoding_format: base64` each vector's little-endian
float32 bytes (as OpenAI sends them; the OpenAI SDK asks for base64 by default).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from backends.embeddings import EmbeddingRequest, Embeddings
from gateway.body import parse_body, read_json
from gateway.embeddings import schema
from gateway.embeddings.metering import embed_admitted
from gateway.embeddings.requests import EmbeddingBody, inputs
from gateway.generation import unless_disconnected
from gateway.guard import GUARD, principal_of
from gateway.middleware import set_model_label
from gateway.openai.routes import resolve_model
from gateway.openai.sampling import new_request_id
from gateway.openapi import GENERATION_ERRORS, Answer, documented
from gateway.state import gateway_state

router = APIRouter(dependencies=[GUARD])  # the key is checked before the body is read

_DOCS = documented(
    Answer(200, "One vector per input, in input order.", model=schema.CreateEmbeddingResponse),
    body=schema.CreateEmbeddingRequest, errors=GENERATION_ERRORS, model_header=True)


@router.post("/v1/embeddings", response_model=None, **_DOCS)
async def embeddings(request: Request) -> JSONResponse:
    state = gateway_state(request)
    body = parse_body(await read_json(request), EmbeddingBody)
    items = inputs(body.input, state.settings.max_embedding_inputs)
    entry = resolve_model(state, request, body.model)
    set_model_label(request.scope, entry.name)
    await state.access.authorize(principal_of(request), entry.name)
    entry.router.require("embed")
    req = EmbeddingRequest(new_request_id(), items, body.dimensions, body.user)
    result = await unless_disconnected(request.receive, embed_admitted(request, entry, req))
    return JSONResponse(response_body(result, entry.name, body.base64))


def response_body(result: Embeddings, model: str, as_base64: bool) -> dict[str, Any]:
    vectors: list[Any]
    if as_base64:
        little = np.ascontiguousarray(result.vectors, dtype="<f4")
        vectors = [base64.b64encode(row.tobytes()).decode("ascii") for row in little]
    else:
        vectors = result.vectors.astype(np.float32).tolist()
    data = [{"object": "embedding", "index": i, "embedding": vector}
            for i, vector in enumerate(vectors)]
    tokens = result.prompt_tokens
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
