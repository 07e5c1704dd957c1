"""Anthropic's Messages API in front of a remote deployment (a scripted OpenAI-compatible
upstream on a free port): what the upstream is asked is the chat completion the conversation
translates to; its answer, usage and failures come back in Anthropic's shapes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from backends.registry import BackendSpec, create_backend
from gateway.app import create_app
from gateway.settings import Settings
from tests.backends.openai_stub import PIECES, OpenAIStub, create_openai_stub
from tests.gateway.conftest import running_server

WHOLE = "".join(PIECES)
BODY_LIMIT = 4096


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[str, OpenAIStub]]:
    stub = OpenAIStub()
    with running_server(create_openai_stub(stub)) as url:
        yield url + "/v1", stub


@pytest.fixture(scope="module")
def client(upstream: tuple[str, OpenAIStub]) -> Iterator[anthropic.Anthropic]:
    spec = BackendSpec(name="m", model_id="unused", backend="remote",
                       options={"base_url": upstream[0], "model": "stub-model"})
    app = create_app(Settings(model_id="unused", max_request_body_bytes=BODY_LIMIT),
                     backends={"m": create_backend(spec)})
    with running_server(app) as url:
        yield anthropic.Anthropic(base_url=url, api_key="k", max_retries=0, timeout=30)


@pytest.fixture
def stub(upstream: tuple[str, OpenAIStub]) -> OpenAIStub:
    upstream[1].mode, upstream[1].cached_tokens = "ok", None
    upstream[1].requests.clear()
    return upstream[1]


def _create(client: anthropic.Anthropic, **extra: Any) -> anthropic.types.Message:
    ask: dict[str, Any] = {"model": "m", "max_tokens": 30,
                           "messages": [{"role": "user", "content": "hi"}], **extra}
    return client.messages.create(**ask)


def test_the_upstream_is_asked_the_translated_chat_completion(client, stub) -> None:
    message = _create(client, system=[{"type": "text", "text": "Be brief."}],
                      stop_sequences=["END"], extra_body={"top_k": 5})
    sent = stub.requests[-1]
    assert sent["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "hi"}]
    assert sent["max_tokens"] == 30 and sent["stop"] == ["END"] and sent["top_k"] == 5
    assert message.content[0].text == WHOLE and message.stop_reason == "end_turn"


def test_a_tool_round_trip_asks_the_upstream_what_chat_completions_ask(client, stub) -> None:
    """tool_use blocks are the assistant's tool_calls, tool_result blocks `tool` messages: the
    upstream gets exactly what the equivalent chat completion sends it."""
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
            {"type": "text", "text": "Thanks."}]},
    ]
    tool = {"name": "get_weather", "description": "Weather.",
            "input_schema": {"type": "object"}}
    _create(client, messages=history, tools=[tool], tool_choice={"type": "auto"})
    sent = stub.requests[-1]
    chat = openai.OpenAI(base_url=f"{str(client.base_url).rstrip('/')}/v1", api_key="k",
                         max_retries=0)
    chat.chat.completions.create(model="m", max_tokens=30, tool_choice="auto", tools=[
        {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                          "parameters": {"type": "object"}}}], messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
        {"role": "user", "content": "Thanks."}])
    reference = stub.requests[-1]
    assert sent == reference
    assert "Sunny" in str(sent["messages"]) and '"city": "Oslo"' in str(sent["messages"])


def test_the_upstreams_cached_tokens_are_cache_reads(client, stub) -> None:
    stub.cached_tokens = 5
    usage = _create(client).usage
    assert (usage.input_tokens, usage.cache_read_input_tokens) == (7 - 5, 5)
    with client.messages.stream(model="m", max_tokens=30,
                                messages=[{"role": "user", "content": "hi"}]) as stream:
        final = stream.get_final_message()
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens) == (2, 5)
    assert final.content[0].text == WHOLE


def test_upstream_failures_answer_in_anthropics_shape(client, stub) -> None:
    stub.mode = "status:429"
    with pytest.raises(anthropic.RateLimitError) as limited:
        _create(client)
    assert limited.value.body["error"]["type"] == "rate_limit_error"
    stub.mode = "die"  # after two pieces: the stream already started
    with pytest.raises(anthropic.APIStatusError) as failed:
        with client.messages.stream(model="m", max_tokens=30,
                                    messages=[{"role": "user", "content": "hi"}]) as stream:
            stream.get_final_message()
    assert failed.value.body["type"] == "error"


def test_a_body_over_the_limit_is_anthropics_413(client, stub) -> None:
    with pytest.raises(anthropic.APIStatusError) as refused:
        _create(client, messages=[{"role": "user", "content": "x" * BODY_LIMIT}])
    assert refused.value.status_code == 413
    assert refused.value.body["error"]["type"] == "request_too_large"
    assert not stub.requests
