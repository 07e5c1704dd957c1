"""A stand-in TGI server: `/generate_stream`, `/generate`, `/health`, `/info` in TGI's wire
format.

It "generates" a fixed sentence, token by token, as TGI streams it: one event per token
(`{"index", "token": {"id", "text", "logprob", "special"}, "top_tokens", "generated_text",
"details"}`), the last with `generated_text` and `details` (`finish_reason`
length / eos_token / stop_sequence, `generated_tokens`, `seed`, `input_length`). A stop
sequence stays in TGI's text. The prompt's token count is its number of words.
`top_n_tokens` lists the token and worse `alt<j>` ones (`top_tokens`); `/generate` answers
whole, with `details.prefill` (one token per prompt word) for `decoder_input_details`.

`StubTGI.mode` scripts failures: "ok", "status:<code>", "malformed", "die" (the socket breaks
after two tokens), "hang" (nothing is sent), "error_event" (TGI's in-stream error: `error_frame`
in place of token `error_at`; TGI sends a request's validation errors so, as the first event).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

PIECES = (" The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".",
          " It", " naps")
EOS = {"id": 2, "text": "</s>", "logprob": -0.5, "special": True}
GENERATION_ERROR = {"error": "CUDA out of memory", "error_type": "generation"}
MAX_TOTAL_TOKENS = 64
LOGPROB = -0.25


def token(i: int) -> dict[str, Any]:
    return {"id": 100 + i, "text": PIECES[i], "logprob": LOGPROB, "special": False}


def script(max_new: int, stop: list[str]) -> tuple[list[dict[str, Any]], str]:
    """The tokens TGI would stream and its finish reason."""
    tokens: list[dict[str, Any]] = []
    text = ""
    for i in range(max_new):
        if i == len(PIECES):
            return [*tokens, EOS], "eos_token"
        tokens.append(token(i))
        text += PIECES[i]
        if any(s in text for s in stop):
            return tokens, "stop_sequence"
    return tokens, "length"


@dataclass
class StubTGI:
    mode: str = "ok"
    delay_s: float = 0.0
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    active: int = 0
    cancelled: int = 0
    error_frame: dict[str, Any] = field(default_factory=lambda: dict(GENERATION_ERROR))
    error_at: int = 2


def top_tokens(tok: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """top_n_tokens: the token itself and n - 1 worse ones (`alt<j>`, id 900 + j), listed
    worst first."""
    worse = [{"id": 900 + j, "text": f"alt{j}", "logprob": tok["logprob"] - j,
              "special": False} for j in range(n - 1, 0, -1)]
    return [*worse, tok][-n:] if n else []


def prefill(inputs: str) -> list[dict[str, Any]]:
    """decoder_input_details: one token per word of the prompt (id = its position)."""
    return [{"id": i, "text": word, "logprob": None if i == 0 else -1.5}
            for i, word in enumerate(inputs.split())]


def _frame(index: int, tok: dict[str, Any], last: dict[str, Any] | None, top: int) -> bytes:
    event = {"index": index, "token": tok, "top_tokens": top_tokens(tok, top),
             "generated_text": None, "details": None}
    if last is not None:
        event.update(last)
    return f"data:{json.dumps(event)}\n\n".encode()


async def _frames(stub: StubTGI, body: dict[str, Any]) -> AsyncIterator[bytes]:
    params = body.get("parameters") or {}
    input_length = len(str(body.get("inputs", "")).split())
    max_new = params.get("max_new_tokens")
    max_new = MAX_TOTAL_TOKENS - input_length if max_new is None else max_new
    tokens, reason = script(max_new, params.get("stop") or [])
    stub.active += 1
    done = False
    try:
        for i, tok in enumerate(tokens):
            if stub.delay_s:
                await asyncio.sleep(stub.delay_s)
            if stub.mode == "die" and i == 2:
                raise RuntimeError("the stub dies mid-stream")
            if stub.mode == "malformed" and i == 1:
                yield b"data:{not json\n\n"
                continue
            if stub.mode == "error_event" and i == stub.error_at:
                yield f"data:{json.dumps(stub.error_frame)}\n\n".encode()
                done = True
                return
            last = None
            if i == len(tokens) - 1:
                text = "".join(t["text"] for t in tokens if not t["special"])
                last = {"generated_text": text, "details": {
                    "finish_reason": reason, "generated_tokens": len(tokens), "seed": None,
                    "input_length": input_length}}
            yield _frame(i + 1, tok, last, params.get("top_n_tokens") or 0)
        done = True
    finally:
        stub.active -= 1
        stub.cancelled += 0 if done else 1


def _status(code: int) -> Response:
    headers = {"Retry-After": "7"} if code == 429 else None
    kind = {422: "validation", 429: "overloaded", 424: "generation"}.get(code, "unavailable")
    return JSONResponse({"error": f"stub says {code}", "error_type": kind}, code,
                        headers=headers)


def create_stub_app(stub: StubTGI) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/info")
    async def info() -> dict[str, Any]:
        return {"model_id": "stub", "max_total_tokens": MAX_TOTAL_TOKENS,
                "max_input_tokens": MAX_TOTAL_TOKENS - 1, "max_stop_sequences": 4}

    async def refusal(request: Request) -> tuple[dict[str, Any], Response | None]:
        body = await request.json()
        stub.requests.append(body)
        stub.headers.append(dict(request.headers))
        if stub.mode.startswith("status:"):
            return body, _status(int(stub.mode.split(":")[1]))
        if stub.mode == "hang":
            await asyncio.sleep(2)
        words = len(str(body.get("inputs", "")).split())
        max_new = (body.get("parameters") or {}).get("max_new_tokens") or 0
        if words >= MAX_TOTAL_TOKENS or words + max_new > MAX_TOTAL_TOKENS:
            return body, JSONResponse({"error": f"`inputs` tokens + `max_new_tokens` must be "
                                       f"<= {MAX_TOTAL_TOKENS}. Given: {words}",
                                       "error_type": "validation"}, 422)
        return body, None

    @app.post("/generate_stream")
    async def generate_stream(request: Request) -> Response:
        body, refused = await refusal(request)
        if refused is not None:
            return refused
        return StreamingResponse(_frames(stub, body), media_type="text/event-stream")

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body, refused = await refusal(request)
        if refused is not None:
            return refused
        params = body.get("parameters") or {}
        inputs = str(body.get("inputs", ""))
        max_new = params.get("max_new_tokens")
        max_new = MAX_TOTAL_TOKENS - len(inputs.split()) if max_new is None else max_new
        tokens, reason = script(max_new, params.get("stop") or [])
        top = params.get("top_n_tokens") or 0
        details: dict[str, Any] = {
            "finish_reason": reason, "generated_tokens": len(tokens), "seed": None,
            "prefill": prefill(inputs) if params.get("decoder_input_details") else [],
            "tokens": tokens, "top_tokens": [top_tokens(t, top) for t in tokens]}
        text = "".join(t["text"] for t in tokens if not t["special"])
        return JSONResponse({"generated_text": text, "details": details})

    return app
