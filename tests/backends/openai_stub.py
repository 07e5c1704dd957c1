"""A scripted OpenAI-compatible upstream: streams fixed pieces as chat or completion chunks.

`OpenAIStub.mode`: "ok", "status:<code>" (OpenAI's error body; 429 with Retry-After),
"no_stream_options" (a 400 naming stream_options when asked for it, as some servers do),
"malformed" (a non-JSON event), "no_choices" (a chunk without choices), "die" (the socket
breaks after two pieces), "hang" (nothing is sent), "json" (a non-streamed answer).
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


@dataclass
class OpenAIStub:
    mode: str = "ok"
    delay_s: float = 0.0
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    cancelled: int = 0


def _chunk(chat: bool, piece: str | None, finish: str | None) -> dict[str, Any]:
    if chat:
        choice: dict[str, Any] = {"index": 0, "delta": {"content": piece} if piece else {},
                                  "finish_reason": finish}
        return {"id": "c1", "object": "chat.completion.chunk", "choices": [choice]}
    return {"id": "c1", "object": "text_completion",
            "choices": [{"index": 0, "text": piece or "", "finish_reason": finish}]}


def _sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


async def _stream(stub: OpenAIStub, chat: bool, usage: bool) -> AsyncIterator[bytes]:
    done = False
    try:
        for i, piece in enumerate(PIECES):
            if stub.delay_s:
                await asyncio.sleep(stub.delay_s)
            if stub.mode == "die" and i == 2:
                raise RuntimeError("the stub dies mid-stream")
            if stub.mode == "malformed" and i == 1:
                yield b"data: {oops\n\n"
            if stub.mode == "no_choices" and i == 1:
                yield _sse({"id": "c1", "object": "chat.completion.chunk"})
            yield _sse(_chunk(chat, piece, None))
        yield _sse(_chunk(chat, None, "stop"))
        if usage:
            yield _sse({"id": "c1", "choices": [], "usage": {
                "prompt_tokens": 7, "completion_tokens": len(PIECES), "total_tokens": 13}})
        yield _sse("[DONE]")
        done = True
    finally:
        stub.cancelled += 0 if done else 1


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


async def _answer(stub: OpenAIStub, request: Request, chat: bool) -> Response:
    body = await request.json()
    stub.requests.append(body)
    stub.headers.append(dict(request.headers))
    if stub.mode.startswith("status:"):
        return _error(int(stub.mode.split(":")[1]))
    if stub.mode == "hang":
        await asyncio.sleep(2)
    if stub.mode == "json":
        return JSONResponse(_whole(chat))
    if stub.mode == "no_stream_options" and "stream_options" in body:
        return JSONResponse({"error": {"message": "Unrecognized request argument supplied: "
                                       "stream_options", "type": "invalid_request_error",
                                       "param": None, "code": None}}, 400)
    usage = bool((body.get("stream_options") or {}).get("include_usage"))
    return StreamingResponse(_stream(stub, chat, usage), media_type="text/event-stream")


def create_openai_stub(stub: OpenAIStub) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "stub-model", "object": "model",
                                            "max_model_len": 2048}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _answer(stub, request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _answer(stub, request, chat=False)

    return app
