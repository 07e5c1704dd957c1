"""A scripted OpenAI-compatible upstream: streams fixed pieces as chat or completion chunks.

`OpenAIStub.mode`: "ok", "status:<code>" (OpenAI's error body; 429 with Retry-After),
"no_stream_options" (a 400 naming stream_options when asked for it, as some servers do),
"malformed" (a non-JSON event), "no_choices" (a chunk without choices), "die" (the socket
breaks after two pieces), "hang" (nothing is sent), "json" (a non-streamed answer),
"ignore_n" (one choice, whatever `n` asked), "endless_line" (one SSE line that never ends),
"huge_json" (a JSON answer of HUGE_BYTES), "negative_usage" (usage counts below zero),
"retry_after:<value>" (a 429 with that Retry-After), "slow_long_prompts" (a prompt of more
than LONG_PROMPT characters waits 2 s before its answer starts; others are answered),
"error_event" (`error_frame` in place of piece `error_at`, then the stream ends). With
`n` > 1, choice k streams PIECES less its
last k pieces (finish "length" for k > 0, the usage totals them); with logprobs each piece has
the logprob -0.1 * (k + 1) and the asked number of alternatives, worse ones named `alt<j>`,
listed worst first.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

PIECES = ("Hello", ",", " brave", " little", " toaster", "!")
HUGE_BYTES = 64 * 2**20
SERVER_ERROR = {"error": {"message": "The server had an error", "type": "server_error",
                          "param": None, "code": None}}
LONG_PROMPT = 1000


@dataclass
class OpenAIStub:
    mode: str = "ok"
    delay_s: float = 0.0
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    cancelled: int = 0
    gets: int = 0  # GET /v1/models (health checks, limits discovery)
    sent_bytes: int = 0  # of the endless and huge answers
    max_model_len: int | None = 2048  # listed on /v1/models; None: not listed
    models_status: int = 200  # what GET /v1/models answers
    streaming: int = 0  # answers streaming now
    peak: int = 0  # the most streaming at once
    error_frame: dict[str, Any] = field(default_factory=lambda: dict(SERVER_ERROR))
    error_at: int = 2
    cached_tokens: int | None = None  # usage's prompt_tokens_details.cached_tokens, when set


def _logprobs(chat: bool, piece: str, k: int, index: int) -> dict[str, Any]:
    """Choice `index`'s piece at logprob -0.1 * (index + 1), with k - 1 worse alternatives
    `alt<j>` listed worst first (an upstream need not sort them)."""
    lp = -0.1 * (index + 1)
    alternatives = [(f"alt{j}", lp - j) for j in range(k - 1, 0, -1)] + [(piece, lp)][:k]
    if chat:
        return {"content": [{"token": piece, "logprob": lp, "bytes": list(piece.encode()),
                             "top_logprobs": [{"token": t, "logprob": v, "bytes": None}
                                              for t, v in alternatives]}]}
    return {"tokens": [piece], "token_logprobs": [lp], "top_logprobs": [dict(alternatives)],
            "text_offset": [0]}


def _chunk(
    chat: bool, piece: str | None, finish: str | None, index: int = 0, top: int | None = None,
) -> dict[str, Any]:
    if chat:
        choice: dict[str, Any] = {"index": index, "delta": {"content": piece} if piece else {},
                                  "finish_reason": finish}
    else:
        choice = {"index": index, "text": piece or "", "finish_reason": finish}
    if piece and top is not None:
        choice["logprobs"] = _logprobs(chat, piece, top, index)
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": "c1", "object": kind, "choices": [choice]}


def _sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def _top(chat: bool, body: dict[str, Any]) -> int | None:
    """How many alternatives were asked for; None: no logprobs."""
    if chat:
        return int(body.get("top_logprobs") or 0) if body.get("logprobs") else None
    value = body.get("logprobs")
    return None if value is None else int(value)


async def _stream(stub: OpenAIStub, chat: bool, body: dict[str, Any]) -> AsyncIterator[bytes]:
    """Choice k says PIECES without its last k pieces; the choices interleave piece by piece."""
    usage = bool((body.get("stream_options") or {}).get("include_usage"))
    n = 1 if stub.mode == "ignore_n" else int(body.get("n") or 1)
    top = _top(chat, body)
    lengths = [len(PIECES) - k for k in range(n)]
    done = False
    stub.streaming += 1
    stub.peak = max(stub.peak, stub.streaming)
    try:
        for i, piece in enumerate(PIECES):
            if stub.delay_s:
                await asyncio.sleep(stub.delay_s)
            if stub.mode == "die" and i == 2:
                raise RuntimeError("the stub dies mid-stream")
            if stub.mode == "error_event" and i == stub.error_at:
                yield _sse(stub.error_frame)
                done = True
                return
            if stub.mode == "malformed" and i == 1:
                yield b"data: {oops\n\n"
            if stub.mode == "no_choices" and i == 1:
                yield _sse({"id": "c1", "object": "chat.completion.chunk"})
            for k in range(n):
                if i < lengths[k]:
                    yield _sse(_chunk(chat, piece, None, k, top))
                if i == lengths[k] - 1:
                    yield _sse(_chunk(chat, None, "stop" if k == 0 else "length", k))
        if usage:
            sign = -10**6 if stub.mode == "negative_usage" else 1
            yield _sse({"id": "c1", "choices": [], "usage": _cached(stub, {
                "prompt_tokens": 7 * sign, "completion_tokens": sum(lengths) * sign,
                "total_tokens": (7 + sum(lengths)) * sign})})
        yield _sse("[DONE]")
        done = True
    finally:
        stub.streaming -= 1
        stub.cancelled += 0 if done else 1


def _cached(stub: OpenAIStub, usage: dict[str, Any]) -> dict[str, Any]:
    if stub.cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": stub.cached_tokens}
    return usage


def _error(status: int) -> Response:
    body = {"error": {"message": f"stub says {status}", "type": "invalid_request_error",
                      "param": "temperature", "code": "stub_code"}}
    headers = {"Retry-After": "7"} if status == 429 else None
    return JSONResponse(body, status, headers=headers)


def _whole(chat: bool) -> dict[str, Any]:
    text = "".join(PIECES)
    choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {
        "index": 0, "text": text}
    choice["finish_reason"] = "length"
    return {"id": "c1", "choices": [choice],
            "usage": {"prompt_tokens": 7, "completion_tokens": 6, "total_tokens": 13}}


async def _endless(stub: OpenAIStub, head: bytes) -> AsyncIterator[bytes]:
    yield head
    while True:  # a client that left cancels it (sleep: a gap for that to happen)
        await asyncio.sleep(0.001)
        stub.sent_bytes += 2**16
        yield b"x" * 2**16


async def _huge(stub: OpenAIStub) -> AsyncIterator[bytes]:
    yield b'{"id": "c1", "choices": [], "padding": "'
    for _ in range(HUGE_BYTES // 2**16):
        await asyncio.sleep(0.001)
        stub.sent_bytes += 2**16
        yield b"x" * 2**16
    yield b'"}'


def _prompt_size(body: dict[str, Any]) -> int:
    return len(json.dumps(body.get("messages") or body.get("prompt") or ""))


async def _answer(stub: OpenAIStub, request: Request, chat: bool) -> Response:
    body = await request.json()
    stub.requests.append(body)
    stub.headers.append(dict(request.headers))
    if stub.mode.startswith("status:"):
        return _error(int(stub.mode.split(":")[1]))
    if stub.mode.startswith("retry_after:"):
        return JSONResponse({"error": {"message": "slow down", "type": "rate_limit"}}, 429,
                            headers={"Retry-After": stub.mode.split(":", 1)[1]})
    if stub.mode == "endless_line":
        return StreamingResponse(_endless(stub, b"data: "), media_type="text/event-stream")
    if stub.mode == "huge_json":
        return StreamingResponse(_huge(stub), media_type="application/json")
    if stub.mode == "slow_long_prompts" and _prompt_size(body) > LONG_PROMPT:
        await asyncio.sleep(2)
    if stub.mode == "hang":
        await asyncio.sleep(2)
    if stub.mode == "json":
        return JSONResponse(_whole(chat))
    if stub.mode == "no_stream_options" and "stream_options" in body:
        return JSONResponse({"error": {"message": "Unrecognized request argument supplied: "
                                       "stream_options", "type": "invalid_request_error",
                                       "param": None, "code": None}}, 400)
    return StreamingResponse(_stream(stub, chat, body), media_type="text/event-stream")


def create_openai_stub(stub: OpenAIStub) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> Response:
        stub.gets += 1
        card: dict[str, Any] = {"id": "stub-model", "object": "model"}
        if stub.max_model_len is not None:
            card["max_model_len"] = stub.max_model_len
        return JSONResponse({"object": "list", "data": [card]}, stub.models_status)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _answer(stub, request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _answer(stub, request, chat=False)

    return app
