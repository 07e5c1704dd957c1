"""Embeddings on a remote deployment: the request passed through to the upstream's
OpenAI-compatible `/embeddings` (vLLM, TEI's OpenAI route, OpenAI, another Switchyard).

The inputs, `dimensions` and `user` go as given (the upstream judges them: its 4xx pass
through as they are); vectors are always asked as floats, and the gateway encodes base64
itself. The answer is checked before it is believed: one vector per input, each index once,
numbers only, all of one length (else a 502 `upstream_malformed`, which routing may fall back
from). Usage is the upstream's, clamped at 0, or counted here when it sends none.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np

from backends.embeddings import EmbeddingRequest, Embeddings
from backends.remote.client import UpstreamClient
from backends.remote.http import malformed
from backends.remote.tokenizer import TokenCounter, estimate_tokens

PATH = "/embeddings"


def embedding_tokens(counter: TokenCounter, req: EmbeddingRequest) -> int:
    """The inputs' tokens: exact with the deployment's tokenizer, else erring high."""
    total = 0
    for item in req.inputs:
        if not isinstance(item, str):
            total += len(item)
        elif counter.tokenizer is not None:
            total += len(counter.tokenizer.encode(item, special=True))
        else:
            total += estimate_tokens(item)
    return total


def payload(req: EmbeddingRequest, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "encoding_format": "float",
        "input": [item if isinstance(item, str) else list(item) for item in req.inputs],
    }
    if req.dimensions is not None:
        body["dimensions"] = req.dimensions
    if req.user is not None:
        body["user"] = req.user
    return body


async def remote_embeddings(client: UpstreamClient, model: str, counter: TokenCounter,
                            req: EmbeddingRequest) -> Embeddings:
    response = await client.open_stream(PATH, payload(req, model))
    try:
        raw = await client.read_whole(response)
    finally:
        response.close()
    try:
        answer = json.loads(raw)
    except ValueError:
        raise malformed(f"the embeddings answer is not JSON: {raw[:200]!r}") from None
    vectors = _vectors(answer, len(req.inputs))
    usage = answer.get("usage") if isinstance(answer, dict) else None
    tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if not isinstance(tokens, int) or isinstance(tokens, bool):
        tokens = embedding_tokens(counter, req)
    return Embeddings(vectors, max(tokens, 0))


def _vectors(answer: Any, count: int) -> np.ndarray:
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list) or len(data) != count:
        raise malformed(f"the embeddings answer does not hold {count} vectors")
    rows: list[np.ndarray | None] = [None] * count
    for item in data:
        index = item.get("index") if isinstance(item, dict) else None
        if not isinstance(index, int) or not 0 <= index < count or rows[index] is not None:
            raise malformed("an embedding's index is missing, repeated or out of range")
        rows[index] = _vector(item.get("embedding"))
    sizes = {len(row) for row in rows if row is not None}
    if len(sizes) != 1 or 0 in sizes:
        raise malformed("the embeddings answer's vectors differ in length or are empty")
    return np.stack([row for row in rows if row is not None])


def _vector(value: Any) -> np.ndarray:
    if isinstance(value, str):  # an upstream that sends base64 whatever was asked
        try:
            return np.frombuffer(base64.b64decode(value, validate=True), dtype="<f4").copy()
        except ValueError:
            raise malformed("an embedding is not base64 float32") from None
    if not isinstance(value, list) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in value):
        raise malformed("an embedding is not a list of numbers")
    vector = np.asarray(value, dtype=np.float32)
    if not np.isfinite(vector).all():
        raise malformed("an embedding holds a value out of float32's range")
    return vector
