"""Anthropic's Messages API on the real engine: a real uvicorn server, the real `anthropic` SDK
(keys on, sent as `x-api-key`), a tiny random Llama with the default model's chat template."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from backends.native.backend import NativeBackend
from backends.native.config import EngineConfig
from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.conftest import running_server

MODEL = "tiny-llama"
ADMIN_KEY = "sy-admin-" + secrets.token_urlsafe(32)
SYSTEM = "You are a terse assistant for the lighthouse keepers' guild."
MESSAGES = [{"role": "user", "content": "Tell me a story about a brave little toaster."}]
WEATHER = {
    "name": "get_weather", "description": "The weather in a city.",
    # Cities from a list: a random model's free string could outrun max_tokens.
    "input_schema": {"type": "object",
                     "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]}},
                     "required": ["city"], "additionalProperties": False},
}


@pytest.fixture(scope="module")
def base_url(tiny_model: Callable[[str], Path]) -> Iterator[str]:
    config = EngineConfig(
        model=str(tiny_model("llama_gqa")), served_model_name=MODEL, dtype="float32",
        max_total_tokens=256, max_batch_total_tokens=2048, block_size=8, compile=False,
    )
    app = create_app(Settings(model_id="unused", admin_key=ADMIN_KEY),
                     backends={MODEL: NativeBackend(config)})
    with running_server(app, timeout_s=120) as url:
        yield url


def _key(base_url: str, **limits: Any) -> str:
    answer = httpx.post(f"{base_url}/admin/keys", json={"name": "messages", **limits},
                        headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
    assert answer.status_code == 201, answer.text
    return answer.json()["key"]


@pytest.fixture(scope="module")
def key(base_url: str) -> str:
    return _key(base_url)


@pytest.fixture(scope="module")
def client(base_url: str, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def chat(base_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=60)


# The newest SDKs no longer take sampling parameters; the API still accepts them when sent.
GREEDY = {"extra_body": {"temperature": 0}}


def _create(client: anthropic.Anthropic, **extra: Any) -> anthropic.types.Message:
    ask: dict[str, Any] = {"model": MODEL, "max_tokens": 16, "messages": MESSAGES,
                           **GREEDY, **extra}
    return client.messages.create(**ask)


def _text(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_greedy_answer_equals_the_chat_completion(client, chat) -> None:
    """The same conversation through both APIs: the same tokens, the same usage."""
    message = _create(client, system=SYSTEM)
    reference = chat.chat.completions.create(
        model=MODEL, max_tokens=16, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, *MESSAGES])
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_")
    assert _text(message) == reference.choices[0].message.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        reference.choices[0].finish_reason]
    usage = message.usage
    assert usage.output_tokens == reference.usage.completion_tokens
    assert usage.input_tokens + usage.cache_read_input_tokens == reference.usage.prompt_tokens
    assert usage.cache_creation_input_tokens == 0
    # Asked again: the prompt's full blocks come from the prefix cache.
    again = _create(client, system=SYSTEM).usage
    assert again.cache_read_input_tokens == (reference.usage.prompt_tokens - 1) // 8 * 8 > 0
    assert again.input_tokens + again.cache_read_input_tokens == reference.usage.prompt_tokens


def test_the_system_prompt_reaches_the_chat_template(client, base_url: str, key: str) -> None:
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=MESSAGES)
    conversation = [{"role": "system", "content": SYSTEM}, *MESSAGES]
    tokenized = httpx.post(f"{base_url}/tokenize", headers={"Authorization": f"Bearer {key}"},
                           json={"model": MODEL, "messages": conversation}, timeout=10).json()
    assert counted.input_tokens == tokenized["count"]
    # Without one, this template writes its own default system prompt.
    without = client.messages.count_tokens(model=MODEL, messages=MESSAGES)
    assert without.input_tokens != counted.input_tokens
    # The answer changes with it: the system text is part of the prompt the model reads.
    assert _create(client, system=SYSTEM).usage != _create(client).usage


def test_max_tokens_ends_with_max_tokens(client) -> None:
    message = _create(client, max_tokens=5)
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 5


def test_a_stop_sequence_ends_with_stop_sequence(client) -> None:
    whole = _text(_create(client, max_tokens=24))
    stop = whole[len(whole) // 2:len(whole) // 2 + 3]
    assert stop.strip(), whole
    message = _create(client, max_tokens=24, stop_sequences=["\u2603never", stop])
    assert _text(message) == whole[:whole.find(stop)]
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop


def test_the_stream_gives_the_same_message(client) -> None:
    whole = _create(client, max_tokens=24)
    with client.messages.stream(model=MODEL, max_tokens=24, messages=MESSAGES,
                                **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == _text(whole) == _text(final)
    assert final.stop_reason == whole.stop_reason and final.id.startswith("msg_")
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == (
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens)


def test_the_stream_sends_anthropics_events_in_order(base_url: str, key: str) -> None:
    body = {"model": MODEL, "max_tokens": 6, "messages": MESSAGES, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/messages", json=body, timeout=60,
                      headers={"x-api-key": key, "anthropic-version": "2023-06-01"}) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in answer.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines
             if line.startswith("data: ")]
    assert [d["type"] for d in datas] == names
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert datas[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert datas[-2]["usage"]["output_tokens"] == 6
    assert datas[0]["message"]["usage"]["input_tokens"] > 0


def test_a_forced_tool_call_and_its_result(client) -> None:
    forced = _create(client, max_tokens=64, tools=[WEATHER],
                     tool_choice={"type": "tool", "name": "get_weather"})
    assert forced.stop_reason == "tool_use"
    (call,) = [block for block in forced.content if block.type == "tool_use"]
    assert call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    with client.messages.stream(model=MODEL, max_tokens=64, messages=MESSAGES, **GREEDY,
                                tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        streamed = stream.get_final_message()
    (again,) = [block for block in streamed.content if block.type == "tool_use"]
    assert (again.name, again.input) == (call.name, call.input)
    assert streamed.stop_reason == "tool_use"

    history = [*MESSAGES, {"role": "assistant", "content": forced.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": "Sunny, 21 degrees."}]}]
    answer = _create(client, max_tokens=8, tools=[WEATHER], messages=history)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens > (
        forced.usage.input_tokens + forced.usage.cache_read_input_tokens)


def test_output_config_format_constrains_the_answer(client) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string",
                                                          "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    message = _create(client, max_tokens=32,
                      output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(_text(message)), schema)


def test_the_x_model_header_wins(base_url: str, key: str) -> None:
    client = anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0,
                                 default_headers={"x-model": MODEL})
    message = client.messages.create(model="claude-not-served", max_tokens=3, messages=MESSAGES)
    assert message.model == MODEL


def test_a_bearer_token_works_too(base_url: str, key: str) -> None:
    client = anthropic.Anthropic(base_url=base_url, auth_token=key, max_retries=0)
    assert client.messages.count_tokens(model=MODEL, messages=MESSAGES).input_tokens > 0


def test_an_invalid_request_is_a_bad_request_error(client) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        _create(client, extra_body={"temperature": 1.5})
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature" in bad.value.body["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        _create(client, messages=[{"role": "user", "content": [image]}])
    assert "vision model" in refused.value.message
    with pytest.raises(anthropic.NotFoundError):
        _create(client, model="claude-not-served")
    unusable = {"type": "json_schema", "schema": {"type": "string", "pattern": "(unclosed"}}
    with pytest.raises(anthropic.BadRequestError) as uncompiled:  # the engine's own refusal
        _create(client, output_config={"format": unusable})
    assert "output_config.format" in uncompiled.value.message


def test_a_bad_key_is_an_authentication_error(base_url: str) -> None:
    client = anthropic.Anthropic(base_url=base_url, api_key="sk-sy-" + "0" * 43, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        _create(client)
    assert denied.value.body["type"] == "error"
    assert denied.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        client.messages.count_tokens(model=MODEL, messages=MESSAGES)


def test_a_rate_limited_key_gets_anthropics_429(base_url: str) -> None:
    client = anthropic.Anthropic(base_url=base_url, api_key=_key(base_url, rpm=1),
                                 max_retries=0)
    _create(client, max_tokens=2)
    with pytest.raises(anthropic.RateLimitError) as limited:
        _create(client, max_tokens=2)
    assert limited.value.status_code == 429
    assert limited.value.body["error"]["type"] == "rate_limit_error"
    assert int(limited.value.response.headers["retry-after"]) >= 1
    with pytest.raises(anthropic.RateLimitError):  # a stream is refused before it starts
        with client.messages.stream(model=MODEL, max_tokens=2, messages=MESSAGES) as stream:
            stream.get_final_message()
