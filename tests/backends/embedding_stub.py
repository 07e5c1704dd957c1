"""A scripted OpenAI-compatible embeddings upstream (`POST /v1/embeddings`, `GET /v1/models`).

Input i's vector is `vector_of(i's words or ids)` (tests/gateway/echo_embedding.py), cut to
`dimensions` when asked. `EmbeddingStub.mode`: "ok"; "status:<code>" (OpenAI's error body,
naming `dimensions`); "malformed" (one vector too few); "no_usage" (no usage in the answer);
"base64" (vectors as base64 whatever was asked); "nan" (a vector holding NaN).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tests.gateway.echo_embedding import vector_of, words

SIZE = 12


@dataclass
class EmbeddingStub:
    mode: str = "ok"
    requests: list[dict[str, Any]] = field(default_factory=list)


def stub_vector(item: str | list[int], dimensions: int | None = None) -> np.ndarray:
    ids = words(item, 1000) if isinstance(item, str) else item
    vector = vector_of(ids, SIZE, True)
    if dimensions is not None:
        vector = vector[:dimensions] / np.linalg.norm(vector[:dimensions])
    return vector.astype(np.float32)


def _answer(stub: EmbeddingStub, body: dict[str, Any]) -> Response:
    if stub.mode.startswith("status:"):
        status = int(stub.mode.split(":")[1])
        return JSONResponse({"error": {"message": f"stub says {status}", "type": "invalid_"
                                       "request_error", "param": "dimensions",
                                       "code": "stub_code"}}, status)
    items = body["input"] if isinstance(body["input"], list) else [body["input"]]
    vectors = [stub_vector(item, body.get("dimensions")) for item in items]
    if stub.mode == "nan":
        vectors[0][0] = np.nan
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode()
             if stub.mode == "base64" else [float(x) for x in v]}
            for i, v in enumerate(vectors)]
    if stub.mode == "malformed":
        data = data[:-1]
    answer: dict[str, Any] = {"object": "list", "data": list(reversed(data)), "model": "m"}
    if stub.mode != "no_usage":
        answer["usage"] = {"prompt_tokens": 11 * len(items), "total_tokens": 11 * len(items)}
    # json.dumps writes NaN (which JSON has not), where JSONResponse would refuse it
    return Response(json.dumps(answer), media_type="application/json")


def create_embedding_stub(stub: EmbeddingStub) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "stub-embedder"}]})

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        body = await request.json()
        stub.requests.append(body)
        return _answer(stub, body)

    return app
