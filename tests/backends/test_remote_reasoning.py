"""A remote deployment's reasoning passes through: an upstream (as vLLM with a reasoning
parser answers) streams `reasoning_content` deltas, then content, then usage with
`reasoning_tokens`; our server answers them whole and streamed. Real HTTP both hops."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from backends.registry import BackendSpec, create_backend
from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.conftest import running_server

# (field, text) deltas as the upstream streams them: vLLM's `reasoning_content`, then the
# newer `reasoning` spelling, then the answer.
DELTAS = (("reasoning_content", "Let me"), ("reasoning", " think."), ("content", "Four"),
          ("content", "."))
REASONING, CONTENT = "Let me think.", "Four."
REASONING_TOKENS = 5


@dataclass
class Upstream:
    requests: list[dict[str, Any]] = field(default_factory=list)


def _sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


async def _stream() -> AsyncIterator[bytes]:
    head = {"id": "u1", "object": "chat.completion.chunk", "created": 0, "model": "up"}
    yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "finish_reason": None}]})
    for name, text in DELTAS:
        yield _sse({**head, "choices": [{"index": 0, "delta": {name: text},
                                         "finish_reason": None}]})
    yield _sse({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    yield _sse({**head, "choices": [], "usage": {
        "prompt_tokens": 9, "completion_tokens": 8, "total_tokens": 17,
        "completion_tokens_details": {"reasoning_tokens": REASONING_TOKENS}}})
    yield _sse("[DONE]")


def _upstream_app(upstream: Upstream) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "up", "object": "model",
                                            "max_model_len": 4096}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        upstream.requests.append(await request.json())
        return StreamingResponse(_stream(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[openai.OpenAI, Upstream]]:
    upstream = Upstream()
    with running_server(_upstream_app(upstream)) as upstream_url:
        spec = BackendSpec(name="m", model_id="unused", backend="remote",
                           options={"base_url": f"{upstream_url}/v1", "model": "up"})
        app = create_app(Settings(model_id="unused"), backends={"m": create_backend(spec)})
        with running_server(app) as url:
            yield openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0), upstream


def _ask(client: openai.OpenAI, **extra: Any) -> Any:
    return client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "2+2?"}], **extra)


def test_reasoning_passes_through_whole(served: tuple[openai.OpenAI, Upstream]) -> None:
    client, upstream = served
    answer = _ask(client, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    message = answer.choices[0].message
    assert (message.reasoning_content, message.content) == (REASONING, CONTENT)
    assert answer.usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS
    assert upstream.requests[-1]["chat_template_kwargs"] == {"enable_thinking": True}


def test_reasoning_passes_through_streamed(served: tuple[openai.OpenAI, Upstream]) -> None:
    client, _ = served
    reasoning, content, usage = [], [], None
    for chunk in _ask(client, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
            content.append(choice.delta.content or "")
    assert ("".join(reasoning), "".join(content)) == (REASONING, CONTENT)
    assert usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS


def test_include_reasoning_false_drops_the_upstreams(
    served: tuple[openai.OpenAI, Upstream],
) -> None:
    client, _ = served
    message = _ask(client, extra_body={"include_reasoning": False}).choices[0].message
    assert message.content == CONTENT
    assert "reasoning_content" not in (message.model_extra or {})
