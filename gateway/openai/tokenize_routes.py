"""POST /tokenize and /detokenize in vLLM's shapes, with the served model's own tokenizer.

/tokenize takes `{"model"?, "prompt"}` or `{"model"?, "messages", "add_generation_prompt"?}`
(the chat template applied, as for a chat request) and answers
`{"count", "max_model_len", "tokens"}`; /detokenize takes `{"model"?, "tokens"}` and answers
`{"prompt"}`. Guarded and admitted like the generation routes: a key must be allowed the
model, and each call counts against its requests per minute and parallel requests (it
reserves and is billed no tokens), before anything is tokenized.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from backends.base import GenerationRequest
from gateway.body import parse_body, read_json
from gateway.guard import GUARD, Admitted, NoPrompt, admit
from gateway.middleware import set_model_label
from gateway.openai import response_schema as docs
from gateway.openai.messages import ChatMessage, checked_text
from gateway.openai.routes import resolve_model
from gateway.openai.sampling import new_request_id
from gateway.openapi import Answer, documented
from gateway.state import gateway_state
from routing.registry import ModelEntry

router = APIRouter(dependencies=[GUARD])
_TOKEN_ID_MAX = 2**31


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True

    @field_validator("model", "prompt")
    @classmethod
    def _text(cls, value: str | None) -> str | None:
        return None if value is None else checked_text(value)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("invalid_value", "give either prompt or messages")
        return self

    def generation_request(self) -> GenerationRequest:
        if self.messages is not None:
            return GenerationRequest(
                request_id=new_request_id(), messages=[m.as_dict() for m in self.messages],
                add_generation_prompt=self.add_generation_prompt)
        return GenerationRequest(request_id=new_request_id(), prompt=self.prompt)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    tokens: list[int]

    @field_validator("model")
    @classmethod
    def _text(cls, value: str | None) -> str | None:
        return None if value is None else checked_text(value)

    @field_validator("tokens")
    @classmethod
    def _ids(cls, value: list[int]) -> list[int]:
        if any(not 0 <= t < _TOKEN_ID_MAX for t in value):
            raise PydanticCustomError("invalid_value", "token ids must be >= 0 and < 2**31")
        return value


async def _admitted(request: Request, body_model: str | None) -> tuple[ModelEntry, Admitted]:
    state = gateway_state(request)
    entry = resolve_model(state, request, body_model)
    set_model_label(request.scope, entry.name)
    return entry, await admit(request, entry.name, NoPrompt())


@router.post("/tokenize", **documented(
    Answer(200, "The prompt's token ids.", model=docs.TokenizeResponse),
    body=docs.TokenizeRequest, model_header=True))
async def tokenize(request: Request) -> JSONResponse:
    body = parse_body(await read_json(request), TokenizeRequest)
    entry, admitted = await _admitted(request, body.model)
    try:
        tokens = await asyncio.to_thread(entry.router.tokenize, body.generation_request())
        info = await asyncio.to_thread(entry.router.info)
    finally:
        await admitted.abandon()  # nothing generated: the slot is freed, no tokens billed
    answer: dict[str, Any] = {"count": len(tokens), "max_model_len": info.max_total_tokens,
                              "tokens": tokens}
    return JSONResponse(answer)


@router.post("/detokenize", **documented(
    Answer(200, "The tokens' text.", model=docs.DetokenizeResponse),
    body=docs.DetokenizeRequest, model_header=True))
async def detokenize(request: Request) -> JSONResponse:
    body = parse_body(await read_json(request), DetokenizeRequest)
    entry, admitted = await _admitted(request, body.model)
    try:
        text = await asyncio.to_thread(entry.router.detokenize, body.tokens)
    finally:
        await admitted.abandon()
    return JSONResponse({"prompt": text})
